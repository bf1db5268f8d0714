"""io_saturation: a disk that cannot serve more, and whether the job is waiting for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dlmon.analysis.detectors._base import Candidate, Context, duration, size
from dlmon.analysis.severity import CRITICAL, INFO, WARNING
from dlmon.analysis.stats import mean, quantile
from dlmon.model import DiskSample, Snapshot
from dlmon.model.format import DEAD_STATES

IO_SATURATION = "io_saturation"


@dataclass(frozen=True, slots=True)
class IoNumbers:
    """io_saturation's numbers (docs/detectors.md)."""

    io_window_s: float = 10.0
    io_util_percent: float = 80.0
    io_hold_util_percent: float = 65.0
    io_pressure_percent: float = 10.0  # PSI io some avg10
    io_queue_depth: float = 16.0  # aqu-sz
    io_await_factor: float = 2.0  # await this many times the low-load baseline ...
    io_await_extra_ms: float = 2.0  # ... and at least this much above it
    io_dstate_fraction: float = 0.3  # share of ticks with a job process in D state
    io_job_read_bytes_per_s: float = 1e6  # the job reads from disk at all


@dataclass(frozen=True, slots=True)
class DiskLoad:
    """One disk over the IO window, and the witnesses that it is saturated, not merely busy."""

    name: str
    util_percent: float
    await_ms: float | None
    baseline_await_ms: float | None
    queue_depth: float | None
    read_bytes_per_s: float | None
    io_pressure: float | None
    dstate_fraction: float  # share of ticks with a job process in D state
    dstate_now: int
    witnesses: tuple[str, ...]


def _await(d: DiskSample) -> float | None:
    values = [v for v in (d.r_await_ms, d.w_await_ms) if v is not None]
    return max(values) if values else None


def _dstate(s: Snapshot) -> int:
    return sum(1 for p in s.processes if p.state == "D")


def disk_loads(ctx: Context) -> list[DiskLoad]:
    """Every disk busy above the hold threshold over the window, with its witnesses."""
    return ctx.cached("disk_loads", lambda: _disk_loads(ctx))


def _disk_loads(ctx: Context) -> list[DiskLoad]:
    cfg = ctx.numbers(IoNumbers)
    window = ctx.window(cfg.io_window_s)
    s = ctx.latest
    out: list[DiskLoad] = []
    if window[-1].time - window[0].time >= 0.3 * cfg.io_window_s or len(window) >= 3:
        for disk in s.disks:
            load = _disk_load(ctx, disk.name, window)
            if load is not None:
                out.append(load)
    return out


def _disk_load(ctx: Context, name: str, window: Sequence[Snapshot]) -> DiskLoad | None:
    cfg = ctx.numbers(IoNumbers)
    samples = [d for s in window for d in s.disks if d.name == name]
    utils = [d.util_percent for d in samples if d.util_percent is not None]
    if len(utils) < 2:
        return None
    util = mean(utils)
    if util < cfg.io_hold_util_percent:
        return None
    awaits = [a for a in (_await(d) for d in samples) if a is not None]
    queues = [d.queue_depth for d in samples if d.queue_depth is not None]
    reads = [d.read_bytes_per_s for d in samples if d.read_bytes_per_s is not None]
    low_load = [
        a
        for s in ctx.recent
        for d in s.disks
        if d.name == name and d.util_percent is not None and d.util_percent < 50.0
        for a in (_await(d),)
        if a is not None
    ]
    baseline = quantile(low_load, 0.2) if len(low_load) >= 5 else None
    now_await = mean(awaits) if awaits else None
    queue = mean(queues) if queues else None
    pressure = ctx.latest.pressure.io_some_avg10 if ctx.latest.pressure is not None else None
    dstate_ticks = sum(1 for s in window if _dstate(s) > 0)
    dstate_fraction = dstate_ticks / len(window)
    witnesses: list[str] = []
    if pressure is not None and pressure >= cfg.io_pressure_percent:
        witnesses.append("pressure")
    if queue is not None and queue >= cfg.io_queue_depth:
        witnesses.append("queue")
    if (
        now_await is not None
        and baseline is not None
        and now_await >= cfg.io_await_factor * baseline
        and now_await >= baseline + cfg.io_await_extra_ms
    ):
        witnesses.append("await")
    if dstate_fraction >= cfg.io_dstate_fraction:
        witnesses.append("dstate")
    return DiskLoad(
        name=name,
        util_percent=util,
        await_ms=now_await,
        baseline_await_ms=baseline,
        queue_depth=queue,
        read_bytes_per_s=mean(reads) if reads else None,
        io_pressure=pressure,
        dstate_fraction=dstate_fraction,
        dstate_now=_dstate(ctx.latest),
        witnesses=tuple(witnesses),
    )


DISK_LIMITS_THE_INPUT = (
    "The disk is the limit, so more workers will not help: keep the data in RAM or on "
    "faster local storage, pack small files into large shards read sequentially "
    "(WebDataset, LMDB, tar), store pre-decoded or smaller samples, and keep other "
    "jobs off this disk."
)


def disk_busy_elsewhere(job_writes: float) -> str:
    """Advice for a saturated disk the job hardly reads: its input is not what waits on it."""
    own = (
        f"The job writes {size(job_writes)}/s itself (checkpoints, logs, caches): spread those "
        "writes out or send them to another disk. "
        if job_writes >= 1e6
        else ""
    )
    return (
        f"{own}The job reads little from this disk, so its input does not wait on it and more or "
        "fewer workers change nothing here; see what keeps it busy (iotop -o, pidstat -d 1) and "
        "keep other jobs off it if its own files live there."
    )


def saturated_disks(ctx: Context, held: frozenset[str] = frozenset()) -> list[DiskLoad]:
    """Disks that are saturated now: busy near 100% with at least one witness of queueing."""
    cfg = ctx.numbers(IoNumbers)
    out = []
    for load in disk_loads(ctx):
        threshold = cfg.io_hold_util_percent if load.name in held else cfg.io_util_percent
        if load.util_percent >= threshold and load.witnesses:
            out.append(load)
    return out


def detect_io_saturation(ctx: Context) -> list[Candidate]:
    cfg = ctx.numbers(IoNumbers)
    s = ctx.latest
    held = frozenset(key[5:] for kind, key in ctx.active if kind == IO_SATURATION and key.startswith("disk:"))
    loads = saturated_disks(ctx, held)
    if not loads:
        return []
    job_reads = sum(
        p.read_bytes_per_s
        for p in s.processes
        if p.state not in DEAD_STATES and p.read_bytes_per_s is not None
    )
    job_writes = sum(
        p.write_bytes_per_s
        for p in s.processes
        if p.state not in DEAD_STATES and p.write_bytes_per_s is not None
    )
    from dlmon.analysis.detectors.loader import LoaderNumbers  # loader.py imports this module

    input_bound = ctx.numbers(LoaderNumbers)
    waits = [
        (loader, loader.data_wait_fraction)
        for loader in s.loaders
        if loader.data_wait_fraction is not None
        and loader.data_wait_fraction >= input_bound.input_wait_fraction
    ]
    out: list[Candidate] = []
    for load in loads:
        details = [f"{load.util_percent:.0f}% busy over {duration(cfg.io_window_s)}"]
        if load.queue_depth is not None:
            details.append(f"{load.queue_depth:.1f} requests queued")
        if load.await_ms is not None:
            base = (
                "" if load.baseline_await_ms is None else f" (vs {load.baseline_await_ms:.1f} ms at low load)"
            )
            details.append(f"{load.await_ms:.1f} ms await{base}")
        if load.io_pressure is not None:
            details.append(f"IO pressure {load.io_pressure:.0f}%")
        message = f"Disk {load.name} is saturated: " + ", ".join(details)
        if load.dstate_now:
            message += f"; {load.dstate_now} job processes wait on IO (D state)"
        reads_it = job_reads >= cfg.io_job_read_bytes_per_s or load.dstate_fraction > 0
        advice = DISK_LIMITS_THE_INPUT
        if waits and reads_it:
            loader, frac = waits[0]
            message += (
                f"; loader {loader.label} waits for data {frac:.0%} of the time, so training is input-bound"
            )
            severity = CRITICAL
        elif reads_it:
            severity = WARNING
        else:
            # busy with writes (checkpoints, logs) or other processes: the job's input is not
            # waiting on it, whatever its loader waits for
            severity = INFO
            message += "; the job itself reads little from disk"
            advice = disk_busy_elsewhere(job_writes)
        message += f" (job reads {size(job_reads)}/s, writes {size(job_writes)}/s)."
        out.append(
            Candidate(
                IO_SATURATION,
                f"disk:{load.name}",
                severity,
                f"disk {load.name}",
                message,
                advice,
                {
                    "util_percent": round(load.util_percent, 1),
                    "await_ms": None if load.await_ms is None else round(load.await_ms, 2),
                    "baseline_await_ms": None
                    if load.baseline_await_ms is None
                    else round(load.baseline_await_ms, 2),
                    "queue_depth": None if load.queue_depth is None else round(load.queue_depth, 2),
                    "io_pressure_some_avg10": load.io_pressure,
                    "dstate_fraction": round(load.dstate_fraction, 2),
                    "dstate_processes": load.dstate_now,
                    "disk_read_bytes_per_s": None
                    if load.read_bytes_per_s is None
                    else round(load.read_bytes_per_s),
                    "job_read_bytes_per_s": round(job_reads),
                    "witnesses": ",".join(load.witnesses),
                    "data_wait_fraction": None if not waits else waits[0][1],
                },
            )
        )
    return out
