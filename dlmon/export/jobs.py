"""``dlmon export --all-jobs``: every training job of this user on one /metrics endpoint.

A job is a process of this user whose agent serves a socket in the user's dlmon runtime directory,
or one that has DataLoader workers (children named ``pt_data_worker``) without being a worker
itself. Each job is a watch of its own, built as every other one is (:mod:`dlmon.flow.watch`: its
sampler, its analyzer, its exporter as the sink), ticked in turn on one thread, all the samplers
reading one NVML sweep per tick (a :class:`SharedGpuSweep`: NVML's cost does not grow with the
jobs); jobs are found again every ``REDISCOVER_S`` seconds and a job that exited is dropped with its
series. Scrapes render the published tuple of (job pid, Published): each series gets a ``job``
label, each metric family one HELP/TYPE.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlmon.agent._paths import short_socket_dirs, socket_dir
from dlmon.collect.agent_client import AgentClient
from dlmon.collect.gpu import GpuCollector
from dlmon.collect.gpu_sweep import DEFAULT_DEADLINE_S, GpuSource, GpuSweep, SharedGpuSweep
from dlmon.collect.processes import WORKER_COMMS
from dlmon.collect.procfs import all_pids, exe_path, read_stat, real_uid
from dlmon.export.prometheus import Exporter, JobsPublished
from dlmon.flow.loop import Pipeline
from dlmon.flow.watch import Watch, WatchOptions

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


@dataclass(frozen=True, slots=True)
class Job:
    watch: Watch
    pipeline: Pipeline  # one per job, kept: its agent note says a thing once
    exporter: Exporter


def open_job(pid: int, interval: float, gpu: GpuSource, pid_labels: bool) -> Job:
    """One job's watch, its exporter the sink, its sampler reading ``gpu``; raises what
    :meth:`Watch.open_sampler` raises."""
    exporter = Exporter(pid_labels=pid_labels)
    watch = Watch(WatchOptions(interval, sinks=(exporter,)))
    watch.open_sampler(pid, gpu_source=gpu)
    return Job(watch, watch.pipeline(), exporter)


class JobsExporter:
    """Samples every job on one thread; ``latest`` is what scrapes render (replaced whole)."""

    def __init__(
        self,
        interval: float,
        discover: Callable[[], set[int]] = discover_jobs,
        rediscover_s: float = REDISCOVER_S,
        open_job: Callable[[int, float, GpuSource, bool], Job] = open_job,
        report: Callable[[str], None] | None = None,
        gpu: GpuCollector | None = None,
        *,
        pid_labels: bool = False,
    ) -> None:
        """``open_job(pid, interval, gpu, pid_labels)`` opens a job's watch reading ``gpu``, the
        sweep shared by all jobs (of ``gpu``, a collector of its own when None)."""
        collector = gpu if gpu is not None else GpuCollector(slow_device_s=DEFAULT_DEADLINE_S)
        self.gpu = SharedGpuSweep(GpuSweep(collector))
        self._pid_labels = pid_labels
        self._interval = interval
        self._report = report
        self._open = open_job
        self._discover = discover
        self._rediscover_s = rediscover_s
        self._jobs: dict[int, Job] = {}
        self._next_discovery = 0.0
        self.latest: JobsPublished = ()

    def _rediscover(self) -> None:
        found = self._discover()
        for pid in [p for p in self._jobs if p not in found]:
            self._drop(pid)
        for pid in sorted(found - self._jobs.keys()):
            try:
                self._jobs[pid] = self._open(pid, self._interval, self.gpu, self._pid_labels)
            except Exception:  # gone or unreadable since discovery: found again next time
                continue

    def _drop(self, pid: int) -> None:
        sampler = self._jobs.pop(pid).watch.sampler
        with contextlib.suppress(Exception):  # closing a gone job's readers must not end the export
            if sampler is not None:
                sampler.close()

    def tick(self) -> None:
        self.gpu.next_tick()
        now = time.monotonic()
        if now >= self._next_discovery:
            self._rediscover()
            self._next_discovery = now + self._rediscover_s
        for pid in list(self._jobs):
            job = self._jobs[pid]
            assert job.watch.sampler is not None
            try:
                snapshot = job.watch.sampler.sample()
            except Exception:  # the job exited between ticks
                self._drop(pid)
                continue
            if not snapshot.target.alive:
                self._drop(pid)
                continue
            try:
                job.pipeline(snapshot)
            except Exception as exc:  # dlmon's own failure, as in every watch: never the others'
                faults = job.watch.faults
                faults.sample_failed(exc)
                if faults.failed_samples == 1 and self._report is not None:
                    self._report(f"job {pid}: a tick failed: {faults.first_failure}; its export goes on")
        self.latest = tuple(
            (str(pid), published)
            for pid, job in sorted(self._jobs.items())
            if (published := job.exporter.latest) is not None
        )

    def failed_ticks(self, pid: int) -> int:
        """How many of job ``pid``'s ticks failed inside dlmon (0 for a job not watched)."""
        job = self._jobs.get(pid)
        return job.watch.faults.failed_samples if job is not None else 0

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.tick()
            stop.wait(self._interval)
        self.close()

    def close(self) -> None:
        """Close every job's readers."""
        for pid in list(self._jobs):
            self._drop(pid)
        self.gpu.close_shared()
