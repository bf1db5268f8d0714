"""Run one configuration: the user's command, unchanged, under the agent with ``DLMON_TUNE`` set;
wait out the warm-up, measure a steady window, stop it with SIGINT (its KeyboardInterrupt: the
script's own clean-up runs), and tell what happened.

Safe by design: every tick projects the job's memory over what is left of the window from its
measured growth; a configuration projected to pass 90% of the real limit (the cgroup's, else
MemAvailable at its start) is stopped before the OOM killer acts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from dlmon.agent._tune import ENV_CONFIG, ENV_STATUS
from dlmon.collect.agent_client import AgentClient, AgentReading
from dlmon.collect.sampler import NoSuchProcess, Sampler
from dlmon.collect.system import read_meminfo
from dlmon.launch.runner import Training, launch
from dlmon.launch.session import describe_left_behind, left_behind
from dlmon.model import LoaderSample, Snapshot
from dlmon.tune.model import (
    CRASHED,
    CUDA_OOM,
    GIB,
    HOST_OOM,
    OK,
    SHM,
    TIMED_OUT,
    WOULD_OOM,
    OomWatch,
    Result,
)
from dlmon.tune.plan import Config

# Process groups of the trainings running now: a second Ctrl-C kills them at once, so no third
# Ctrl-C during a slow clean-up (a checkpoint on KeyboardInterrupt) can leave one running.
LIVE: set[int] = set()


def kill_live_trainings() -> None:
    for pid in list(LIVE):
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


# What configurations left running after their training was stopped (daemons that left its
# session): named after each configuration, and all together at the end of the sweep.
LEFT_RUNNING: dict[int, str] = {}


def _note_left_running(training: Training, say: Callable[[str], None]) -> None:
    with contextlib.suppress(Exception):  # naming them must never cost the sweep
        left = left_behind(training.pid, None, training.job_token)
        if left:
            LEFT_RUNNING.update(left)
            say(f"this configuration {describe_left_behind(left)}")


def still_left_running() -> list[tuple[int, str]]:
    """The processes configurations left behind that still run now."""
    return sorted((pid, cmd) for pid, cmd in LEFT_RUNNING.items() if os.path.exists(f"/proc/{pid}"))


INTERRUPTED = "interrupted"  # Ctrl-C in dlmon: not a result, the configuration runs again on --resume
WARM_BATCHES = 3  # batches of the tuned loader before the window opens
WARM_SECONDS = 1.0  # and seconds after its first batch
GROWTH_WINDOW_S = 1.0  # memory readings the growth rate is fitted over (tune/model.py OomWatch)
LOG_TAIL_LINES = 5


class _KeepingClient(AgentClient):
    """The agent client that keeps its last reading (the per-loader start-up time is in it)."""

    last: AgentReading | None = None

    def poll(self, pids: int | Iterable[int]) -> AgentReading | None:
        reading = super().poll(pids)
        if reading is not None:
            self.last = reading
        return reading


def _agent_startup(client: _KeepingClient, loader: LoaderSample) -> float | None:
    """Seconds the agent counted building the loader's iterator and waiting for its first batch."""
    figure = getattr(loader, "startup_s", None)  # a LoaderSample field, where the agent reports one
    if isinstance(figure, (int, float)):
        return float(figure)
    reading = client.last
    for detail in reading.details if reading is not None else ():
        if detail.id == loader.id and detail.pid == loader.pid:
            return detail.startup_wait_s_total
    return None


class CannotRun(Exception):
    """The command cannot be started at all (not found, not executable): one line for the user."""


@dataclass(frozen=True, slots=True)
class RunOptions:
    seconds: float | None = 10.0  # measuring window
    batches: int | None = None  # or a number of batches
    loader: str | None = None  # file:line
    loader_only: bool = False  # iterate the loader without the training step
    warmup_timeout_s: float = 60.0
    interval_s: float = 0.25
    stop_grace_s: float = 10.0


@dataclass
class _Peaks:
    pss: int | None = None
    uss: int | None = None
    worker_uss: int | None = None
    shm: int | None = None
    vram: int | None = None
    rss_anon: int | None = None
    rss_file: int | None = None

    def add(self, snap: Snapshot) -> None:
        m = snap.memory
        anon = [p.rss_anon_bytes for p in snap.processes if p.rss_anon_bytes is not None]
        files = [p.rss_file_bytes for p in snap.processes if p.rss_file_bytes is not None]
        self.rss_anon = _max(self.rss_anon, sum(anon) if anon else None)
        self.rss_file = _max(self.rss_file, sum(files) if files else None)
        self.pss = _max(self.pss, m.pss_sum_bytes)
        self.uss = _max(self.uss, m.uss_sum_bytes)
        for p in snap.workers():
            self.worker_uss = _max(self.worker_uss, p.uss_bytes)
        if snap.shm is not None:
            self.shm = _max(self.shm, snap.shm.used_bytes)
        reserved = [g.torch_reserved_bytes for g in snap.gpus if g.torch_reserved_bytes is not None]
        if reserved:
            self.vram = _max(self.vram, sum(reserved))
        else:
            used = [p.gpu_memory_bytes for p in snap.processes if p.gpu_memory_bytes is not None]
            if used:
                self.vram = _max(self.vram, sum(used))


def _max(a: int | None, b: int | None) -> int | None:
    if b is None:
        return a
    return b if a is None else max(a, b)


def read_status(path: str) -> dict[str, object]:
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def log_tail(path: str | None, lines: int = LOG_TAIL_LINES) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    kept = [line.rstrip() for line in text.splitlines() if line.strip()]
    return " | ".join(kept[-lines:])


def _target_loaders(snap: Snapshot, name: object) -> list[LoaderSample]:
    """The tuned loader in every process that built it (one per rank under torchrun), live first."""
    if not isinstance(name, str):
        return []
    want_file, _, want_line = name.rpartition(":")
    found = []
    for ls in snap.loaders:
        file, _, line = ls.name.rpartition(":")
        if line == want_line and os.path.basename(file) == os.path.basename(want_file):
            found.append(ls)
    return sorted(found, key=lambda ls: not ls.alive)


def _sum(values: list[int | None]) -> int | None:
    return None if any(v is None for v in values) else sum(v or 0 for v in values)


def _memory_limit(first: Snapshot | None) -> tuple[int | None, str | None]:
    """The limit that kills first: the cgroup's, or what the machine had available at the start
    when that is smaller (a container allowed more than the host has meets the host's OOM killer)."""
    avail = read_meminfo().available_bytes
    cgroup = first.cgroup.limit_bytes if first is not None and first.cgroup is not None else None
    if cgroup and (not avail or cgroup <= avail):
        return cgroup, "cgroup"
    return (avail, "MemAvailable") if avail else (None, None)


def classify_exit(
    code: int, status: dict[str, object], tail: str, last: Snapshot | None, oom_before: int | None
) -> tuple[str, str]:
    """(outcome, detail) of a training that ended by itself during the run."""
    if status.get("outcome") == CUDA_OOM or "CUDA out of memory" in tail or "OutOfMemoryError" in tail:
        return CUDA_OOM, str(status.get("message") or "CUDA out of memory")
    deaths = last.worker_deaths if last is not None else ()
    if any(d.signal == signal.SIGBUS for d in deaths) or "Bus error" in tail or "shared memory" in tail:
        size = last.shm.total_bytes if last is not None and last.shm is not None else None
        where = f"/dev/shm full, {size / 2**20:.0f} MiB" if size else "/dev/shm full"
        return SHM, f"a worker died of SIGBUS ({where})"
    oom_after = last.cgroup.oom_kill_count if last is not None and last.cgroup is not None else None
    if oom_before is not None and oom_after is not None and oom_after > oom_before:
        return HOST_OOM, f"the cgroup's OOM killer fired ({oom_after - oom_before} kill(s))"
    killed = [d for d in deaths if d.signal == signal.SIGKILL]
    if killed or "killed by signal: Killed" in tail:
        return HOST_OOM, f"worker pid {killed[0].pid} killed by SIGKILL" if killed else "a worker was killed"
    if code == 128 + signal.SIGKILL:
        return HOST_OOM, "the training was killed by SIGKILL (the OOM killer, most likely)"
    return CRASHED, f"exit status {code}" + (f": {tail}" if tail else "")


def run_config(
    command: list[str],
    config: Config,
    opts: RunOptions,
    interrupted: threading.Event,
    say: Callable[[str], None] = lambda line: None,
) -> Result:
    """Run and measure ``config``; raises :class:`CannotRun` when the command cannot start."""
    status_fd, status_path = tempfile.mkstemp(prefix="dlmon-tune-", suffix=".json")
    os.close(status_fd)
    os.unlink(status_path)  # the agent creates it (temp + rename)
    env = dict(os.environ)
    env[ENV_CONFIG] = config.agent_json(opts.loader, opts.loader_only)
    env[ENV_STATUS] = status_path
    started = time.monotonic()
    try:
        training = launch(command, to_log=True, env=env)
    except OSError as exc:
        raise CannotRun(f"cannot start {command[0]}: {exc.strerror or exc}") from exc
    LIVE.add(training.pid)
    try:
        result = _measure(training, config, opts, interrupted, status_path, started, say)
    finally:
        if training.exit_code() is None:
            training.stop(opts.stop_grace_s)
        LIVE.discard(training.pid)
        with contextlib.suppress(OSError):
            os.unlink(status_path)
        _note_left_running(training, say)
    if result.outcome == OK and training.log_path:
        with contextlib.suppress(OSError):
            os.unlink(training.log_path)
    return result


def _measure(
    training: Training,
    config: Config,
    opts: RunOptions,
    interrupted: threading.Event,
    status_path: str,
    started: float,
    say: Callable[[str], None],
) -> Result:
    peaks = _Peaks()
    status: dict[str, object] = {}
    client = _KeepingClient()
    startup: float | None = None
    try:
        sampler = Sampler(training.pid, unlimited_smaps=True, exit_code=training.exit_code, agent=client)
    except NoSuchProcess:
        sampler = None
    first: Snapshot | None = None
    last: Snapshot | None = None
    limit: int | None = None
    limit_source: str | None = None
    oom_before: int | None = None
    oom_watch: OomWatch | None = None  # from the first reading after the agent reported the loader
    first_batch_at: float | None = None
    window_start: tuple[float, int, int] | None = None  # snapshot time, samples, batches
    window_end: tuple[float, int, int] | None = None
    rates: list[float] = []
    waits: list[float] = []
    script_batch: int | None = None
    target: LoaderSample | None = None
    tuned: list[LoaderSample] = []

    def result(outcome: str, detail: str = "", stop_s: float | None = None) -> Result:
        sps = spread = None
        measured = batches = None
        if window_start is not None and window_end is not None and window_end[0] > window_start[0]:
            measured = window_end[0] - window_start[0]
            sps = (window_end[1] - window_start[1]) / measured
            batches = window_end[2] - window_start[2]
            spread = statistics.pstdev(rates) if len(rates) > 1 else None
        original = status.get("original")
        own = original.get("batch_size") if isinstance(original, dict) else None
        name = status.get("loader")
        not_tunable = status.get("not_tunable")
        if isinstance(not_tunable, str):
            detail = f"{detail}; {not_tunable}" if detail else not_tunable
        ran = config
        if config.batch_size is None or isinstance(not_tunable, str):  # it ran with the script's own
            ran = replace(config, batch_size=(own if isinstance(own, int) else None) or script_batch)
        return Result(
            config=ran,
            outcome=outcome,
            detail=detail,
            samples_per_s=sps,
            samples_per_s_spread=spread,
            data_wait=statistics.fmean(waits) if waits else None,
            startup_s=startup,
            first_batch_s=first_batch_at - started if first_batch_at is not None else None,
            peak_rss_anon_bytes=peaks.rss_anon,
            peak_rss_file_bytes=peaks.rss_file,
            measured_s=measured,
            batches=batches,
            peak_pss_bytes=peaks.pss,
            peak_uss_bytes=peaks.uss,
            peak_worker_uss_bytes=peaks.worker_uss,
            peak_shm_bytes=peaks.shm,
            peak_vram_bytes=peaks.vram,
            limit_bytes=limit,
            limit_source=limit_source,
            stop_s=stop_s,
            loader=name if isinstance(name, str) else None,
            script_batch_size=own if isinstance(own, int) else script_batch,
        )

    def stop(outcome: str, detail: str = "") -> Result:
        t0 = time.monotonic()
        training.stop(opts.stop_grace_s if outcome == OK else 1.0)
        return result(outcome, detail, time.monotonic() - t0)

    try:  # every way out closes the sampler: a trial left its GPU sweep thread running
        deadline = started + opts.warmup_timeout_s
        while True:
            if interrupted.is_set():
                return stop(INTERRUPTED, "interrupted")
            tick = time.monotonic()
            snap: Snapshot | None = None
            if sampler is not None:
                with contextlib.suppress(Exception):
                    snap = sampler.sample()
            if snap is not None:
                last = snap
                if first is None:
                    first = snap
                    limit, limit_source = _memory_limit(snap)
                    oom_before = snap.cgroup.oom_kill_count if snap.cgroup is not None else None
                peaks.add(snap)
            status = read_status(status_path) or status
            code = training.exit_code()
            if code is not None:
                tail = log_tail(training.log_path)
                if window_start is not None and window_end is not None and code == 0:
                    return result(OK, "the script ended by itself")
                if status.get("outcome") != CUDA_OOM and "loader" not in status:
                    why = f"the command exited with status {code} before building a DataLoader"
                    return result(CRASHED, why + (f": {tail}" if tail else ""))
                outcome, detail = classify_exit(code, status, tail, last, oom_before)
                return result(outcome, detail)
            if isinstance(status.get("error"), str):
                return stop(CRASHED, f"dlmon's agent could not apply the configuration: {status['error']}")
            if snap is not None:
                tuned = _target_loaders(snap, status.get("loader"))
                target = tuned[0] if tuned else target
                if target is not None and target.batch_size:
                    script_batch = script_batch or target.batch_size
            if "loader" in status and oom_watch is None and limit:
                oom_watch = OomWatch(limit, window_s=GROWTH_WINDOW_S)
            pss = snap.memory.pss_sum_bytes if snap is not None else None
            if oom_watch is not None and snap is not None and pss is not None:
                remaining = opts.seconds or 5.0
                if window_start is not None and opts.seconds:
                    remaining = max(0.0, opts.seconds - (snap.time - window_start[0]))
                projected = oom_watch.add(  # on the monotonic clock: a wall-clock step is no growth
                    tick, pss, snap.memory.pss_anon_sum_bytes, remaining + 2 * opts.interval_s
                )
                if projected is not None:
                    return stop(
                        WOULD_OOM,
                        f"at ~{projected / GIB:.2f} GiB (stopped at {pss / GIB:.2f} GiB, growing "
                        f"toward the {oom_watch.limit_bytes / GIB:.2f} GiB {limit_source} limit)",
                    )
            samples_total = _sum([ls.samples_total for ls in tuned]) if snap is not None and tuned else None
            if snap is not None and target is not None and samples_total is not None:
                batches_total = _sum([ls.batches_total for ls in tuned]) or 0
                if batches_total > 0 and first_batch_at is None:
                    first_batch_at = time.monotonic()
                if window_start is None:
                    warm = (
                        first_batch_at is not None
                        and batches_total >= WARM_BATCHES
                        and time.monotonic() - first_batch_at >= WARM_SECONDS
                    )
                    if warm:
                        startup = _agent_startup(client, target)
                        window_start = (snap.time, samples_total, batches_total)
                        window_end = window_start
                        deadline = time.monotonic() + 3 * (opts.seconds or 30.0) + opts.warmup_timeout_s
                else:
                    window_end = (snap.time, samples_total, batches_total)
                    tick_rates = [ls.samples_per_s for ls in tuned if ls.samples_per_s is not None]
                    if tick_rates:
                        rates.append(sum(tick_rates))  # the job's rate: all ranks together
                    tick_waits = [ls.data_wait_fraction for ls in tuned if ls.data_wait_fraction is not None]
                    if tick_waits:
                        waits.append(statistics.fmean(tick_waits))
                    done_s = opts.seconds is not None and window_end[0] - window_start[0] >= opts.seconds
                    done_b = opts.batches is not None and window_end[2] - window_start[2] >= opts.batches
                    if done_s or done_b:
                        return stop(OK)
            if time.monotonic() > deadline:
                if window_start is not None:
                    return stop(TIMED_OUT, "the measuring window did not complete in time")
                seen = status.get("seen")
                if "loader" not in status:
                    where = f" (seen: {', '.join(map(str, seen))})" if isinstance(seen, list) and seen else ""
                    wanted = f" at {opts.loader}" if opts.loader else ""
                    return stop(
                        TIMED_OUT,
                        f"no DataLoader{wanted} was created within {opts.warmup_timeout_s:.0f} s{where}",
                    )
                return stop(
                    TIMED_OUT, f"the DataLoader was not iterated within {opts.warmup_timeout_s:.0f} s"
                )
            time.sleep(max(0.0, opts.interval_s - (time.monotonic() - tick)))
    finally:
        if sampler is not None:
            sampler.close()
