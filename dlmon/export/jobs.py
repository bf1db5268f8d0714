"""``dlmon export --all-jobs``: every training job of this user on one /metrics endpoint.

A job is a process of this user whose agent serves a socket in the user's dlmon runtime directory,
or one that has DataLoader workers (children named ``pt_data_worker``) without being a worker
itself. Each job gets its own Sampler and Exporter, all reading one NVML sweep per tick (a
:class:`SharedGpuSweep`: NVML's cost does not grow with the jobs); jobs are found again every ``REDISCOVER_S``
seconds and a job that exited is dropped with its series. Scrapes render the published tuple of
(job pid, Published): each series gets a ``job`` label, each metric family one HELP/TYPE.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

from dlmon.agent._paths import short_socket_dirs, socket_dir
from dlmon.collect.agent_client import AgentClient
from dlmon.collect.gpu import GpuCollector
from dlmon.collect.gpu_sweep import DEFAULT_DEADLINE_S, GpuSweep, SharedGpuSweep
from dlmon.collect.processes import WORKER_COMMS
from dlmon.collect.procfs import all_pids, exe_path, read_stat, real_uid
from dlmon.collect.sampler import Sampler
from dlmon.export.prometheus import Exporter, JobsPublished
from dlmon.model import SnapshotStep

REDISCOVER_S = 10.0


def discover_jobs(uid: int | None = None) -> set[int]:
    """The pids of this user's training jobs (see the module docstring)."""
    uid = os.getuid() if uid is None else uid
    stats: dict[int, tuple[str, int]] = {}
    for pid in all_pids():
        if (st := read_stat(pid)) is not None:
            stats[pid] = (st.comm, st.ppid)
    # A worker's parent is its trainer, which forked it from the same executable; an orphaned
    # worker's parent is init or a subreaper (no training job, and sampling it walks their trees).
    candidates = {
        ppid
        for pid, (comm, ppid) in stats.items()
        if comm in WORKER_COMMS and ppid > 1 and exe_path(ppid) == exe_path(pid) is not None
    }
    sockets: list[str] = []
    for d in dict.fromkeys((socket_dir(), *short_socket_dirs())):  # agents of a long TMPDIR serve short
        try:
            sockets += os.listdir(d)
        except OSError:
            continue
    for entry in sockets:
        pid_text = entry.removesuffix(".sock")
        known = entry.endswith(".sock") and pid_text.isdigit() and int(pid_text) in stats
        if known and AgentClient.find_socket(int(pid_text)) is not None:
            candidates.add(int(pid_text))
    return {
        pid
        for pid in candidates
        if pid in stats and stats[pid][0] not in WORKER_COMMS and real_uid(pid) == uid
    }


class JobsExporter:
    """Samples every job on one thread; ``latest`` is what scrapes render (replaced whole)."""

    def __init__(
        self,
        analyzer: Callable[[], SnapshotStep],
        open_sampler: Callable[[int, SharedGpuSweep], Sampler],
        discover: Callable[[], set[int]] = discover_jobs,
        rediscover_s: float = REDISCOVER_S,
        gpu: GpuCollector | None = None,
        *,
        pid_labels: bool = False,
    ) -> None:
        """``open_sampler(pid, gpu)`` opens a job's Sampler reading ``gpu``, the sweep shared by
        all jobs (of ``gpu``, a collector of its own when None)."""
        collector = gpu if gpu is not None else GpuCollector(slow_device_s=DEFAULT_DEADLINE_S)
        self.gpu = SharedGpuSweep(GpuSweep(collector))
        self._pid_labels = pid_labels
        self._new_analyzer = analyzer
        self._open = open_sampler
        self._discover = discover
        self._rediscover_s = rediscover_s
        self._jobs: dict[int, tuple[Sampler, SnapshotStep, Exporter]] = {}
        self._next_discovery = 0.0
        self.latest: JobsPublished = ()

    def _rediscover(self) -> None:
        found = self._discover()
        for pid in [p for p in self._jobs if p not in found]:
            self._drop(pid)
        for pid in sorted(found - self._jobs.keys()):
            try:
                sampler = self._open(pid, self.gpu)
            except Exception:  # gone or unreadable since discovery: found again next time
                continue
            self._jobs[pid] = (sampler, self._new_analyzer(), Exporter(pid_labels=self._pid_labels))

    def _drop(self, pid: int) -> None:
        sampler, _, _ = self._jobs.pop(pid)
        with contextlib.suppress(Exception):  # closing a gone job's readers must not end the export
            sampler.close()

    def tick(self) -> None:
        self.gpu.next_tick()
        now = time.monotonic()
        if now >= self._next_discovery:
            self._rediscover()
            self._next_discovery = now + self._rediscover_s
        for pid in list(self._jobs):
            sampler, analyze, exporter = self._jobs[pid]
            try:
                snapshot = sampler.sample()
            except Exception:  # the job exited between ticks
                self._drop(pid)
                continue
            if not snapshot.target.alive:
                self._drop(pid)
                continue
            exporter(analyze(snapshot))
        self.latest = tuple(
            (str(pid), published)
            for pid, (_, _, exporter) in sorted(self._jobs.items())
            if (published := exporter.latest) is not None
        )

    def run(self, interval: float, stop: threading.Event) -> None:
        while not stop.is_set():
            self.tick()
            stop.wait(interval)
        for pid in list(self._jobs):
            self._drop(pid)
        self.gpu.close_shared()
