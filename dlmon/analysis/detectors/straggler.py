"""straggler: one rank of a distributed job waits for its data far longer than the others, which
wait for it in the collective, outside their loaders; and why, from what dlmon measured on it.

The ranks of a synchronous job (DDP, FSDP) move in lockstep: every step ends in a collective, so
all run at the slowest rank's pace. When that rank is slow because of its input, its time goes
into its loader's ``__next__`` and the others' into the collective, which the agent counts as
time outside the loader (not data wait): one rank's data wait far above the others' at the same
batch rate is the straggler's signature. Ranks are compared at the same loader site only, and only
ranks the agent named (RANK / SLURM_PROCID), on this machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dlmon.analysis.detectors._base import Candidate, Context, duration, size
from dlmon.analysis.detectors.loader import LoaderNumbers, WorkerStats, _read_disk, _worker_stats
from dlmon.analysis.severity import CRITICAL, INFO, WARNING
from dlmon.analysis.stats import mean
from dlmon.model import LoaderSample, RankInfo, Snapshot

STRAGGLER = "straggler"

WINDOW_S = 10.0
MIN_SAMPLES = 4  # readings of every rank's loader in the window
WAIT_FRACTION = 0.3  # the slow rank waits for data at least this share of its loader time ...
HOLD_WAIT_FRACTION = 0.2  # ... (while raised)
WAIT_GAP = 0.25  # ... this much more than the most any other rank waits ...
HOLD_WAIT_GAP = 0.15
WAIT_RATIO = 3.0  # ... and this many times as much
CRITICAL_WAIT_FRACTION = 0.5
LOCKSTEP_RATE_RATIO = 0.8  # slowest / fastest batch rate: the ranks move together
GPU_BUSIER_PERCENT = 20.0
CPU_GAP_PERCENT = 25.0  # its workers' CPU this far above every other rank's
SWAP_BYTES = 64 * 1024 * 1024
SWAP_FAULTS_PER_S = 25.0  # pages read back in (100 KiB/s): swap held but never touched slows nothing

IO = "io"
CPU = "cpu"
FEWER_WORKERS = "fewer_workers"
SWAP = "swap"
GPU = "gpu"
LATENCY = "latency"
NOT_MEASURED = "not_measured"


@dataclass(frozen=True, slots=True)
class _RankLoad:
    loader: LoaderSample
    wait: float
    rate: float
    samples: int


def _rank_of(loader: LoaderSample) -> RankInfo:
    assert loader.rank is not None
    return RankInfo(loader.rank, loader.local_rank, loader.node_rank, loader.world_size)


def _load(window: Sequence[Snapshot], loader: LoaderSample) -> _RankLoad | None:
    waits: list[float] = []
    rates: list[float] = []
    for snap in window:
        for other in snap.loaders:
            if other.id == loader.id and other.data_wait_fraction is not None and other.batches_per_s:
                waits.append(other.data_wait_fraction)
                rates.append(other.batches_per_s)
    if len(waits) < MIN_SAMPLES:
        return None
    return _RankLoad(loader, mean(waits), mean(rates), len(waits))


def _by_site(s: Snapshot) -> dict[str, dict[int, LoaderSample]]:
    """site -> rank -> the loader of that rank built there (the busiest, if it built several)."""
    sites: dict[str, dict[int, LoaderSample]] = {}
    for ls in s.loaders:
        if not ls.alive or ls.rank is None:
            continue
        ranks = sites.setdefault(ls.name, {})
        seen = ranks.get(ls.rank)
        if seen is None or (ls.batches_total or 0) > (seen.batches_total or 0):
            ranks[ls.rank] = ls
    return sites


def paces_the_job(wait: float, others_max_wait: float, rates: Sequence[float], held: bool) -> bool:
    """The straggler rule, here and across nodes (dlmon.cluster.view): the slowest rank's loader
    ``wait`` stands out from every other rank's (at most ``others_max_wait``) while all move in
    lockstep (``rates``, every rank's batches/s). ``held``: the same rank was named last time, and
    is kept at the lower hold thresholds while it stays the slowest (no flicker at the edge)."""
    return not (
        wait < (HOLD_WAIT_FRACTION if held else WAIT_FRACTION)
        or wait - others_max_wait < (HOLD_WAIT_GAP if held else WAIT_GAP)
        or wait < WAIT_RATIO * others_max_wait
        or min(rates) < LOCKSTEP_RATE_RATIO * max(rates)
    )


def severity_of(wait: float, measured: bool) -> str:
    """A warning (critical past CRITICAL_WAIT_FRACTION) only for a difference measured on the slow
    rank; without one, info (see _unproven)."""
    if not measured:
        return INFO
    return CRITICAL if wait >= CRITICAL_WAIT_FRACTION else WARNING


def detect_straggler(ctx: Context) -> list[Candidate]:
    s = ctx.latest
    if sum(1 for ls in s.loaders if ls.rank is not None) < 2:
        return []
    window = ctx.window(WINDOW_S)
    out: list[Candidate] = []
    for site, ranks in _by_site(s).items():
        if len(ranks) < 2:
            continue
        loads = [_load(window, ls) for ls in ranks.values()]
        known = [x for x in loads if x is not None]
        if len(known) != len(loads):
            continue  # a rank without enough readings: no comparison yet
        slow = max(known, key=lambda x: x.wait)
        others = [x for x in known if x is not slow]
        most_other = max(x.wait for x in others)
        key = f"straggler:{site}:rank:{slow.loader.rank}"
        held = ctx.is_active(STRAGGLER, key)
        rates = [x.rate for x in known]
        if not paces_the_job(slow.wait, most_other, rates, held):
            continue
        out.append(_straggler(ctx, key, site, slow, others, window))
    return out


def _pids_of(loader: LoaderSample) -> set[int]:
    return {loader.pid, *loader.worker_pids}


def _swap(s: Snapshot, pids: set[int]) -> int | None:
    values = [p.swap_bytes for p in s.processes if p.pid in pids and p.swap_bytes is not None]
    return sum(values) if values else None


def _major_faults(window: Sequence[Snapshot], pids: set[int]) -> float | None:
    """The processes' pages read back in per second (swap or mapped files), over the window."""
    per_tick = [
        sum(values)
        for s in window
        if (
            values := [
                p.major_faults_per_s
                for p in s.processes
                if p.pid in pids and p.major_faults_per_s is not None
            ]
        )
    ]
    return sum(per_tick) / len(per_tick) if per_tick else None


def _gpu_util(s: Snapshot, pid: int) -> tuple[int, float] | None:
    for gpu in s.gpus:
        fresh = gpu.stale_age_s is None  # a device NVML has not answered for: its old figure proves nothing
        if fresh and gpu.utilization_percent is not None and any(p.pid == pid for p in gpu.processes):
            return gpu.index, gpu.utilization_percent
    return None


def _causes(
    ctx: Context, slow: _RankLoad, others: Sequence[_RankLoad], window: Sequence[Snapshot]
) -> list[tuple[str, str, str]]:
    """(cause, why, advice) for each thing measured on the slow rank, and not on the others, that
    explains it, strongest first."""
    cfg = ctx.numbers(LoaderNumbers)
    s = ctx.latest
    loader = slow.loader
    stats: WorkerStats = _worker_stats(window, set(loader.worker_pids))
    found: list[tuple[str, str, str]] = []
    nw = loader.num_workers
    other_nw = [x.loader.num_workers for x in others if x.loader.num_workers is not None]
    if nw is not None and other_nw and nw < min(other_nw):
        found.append(
            (
                FEWER_WORKERS,
                f"it has {nw} DataLoader worker{'' if nw == 1 else 's'}, "
                f"the other ranks {min(other_nw)} or more",
                "Give every rank the same num_workers (a rank-dependent setting, or a rank that fell "
                "back to fewer).",
            )
        )
    other_stats = [_worker_stats(window, set(x.loader.worker_pids)) for x in others]
    disk = _read_disk(ctx, stats)
    # one disk serves every rank on the machine: it is this rank's cause only if the others do not wait on it
    if disk is not None and all(o.dstate <= stats.dstate / 2 for o in other_stats):
        found.append(
            (
                IO,
                f"its workers read {size(stats.read_bytes_per_s)}/s and wait on IO (D state) "
                f"{stats.dstate:.0%} of the time while disk {disk.name} is {disk.util_percent:.0f}% busy",
                "Its data comes from a saturated disk: stage this rank's shard on faster or local storage, "
                "or cache it in RAM.",
            )
        )
    other_cpu = [o.cpu for o in other_stats if o.cpu is not None]
    if (
        stats.cpu is not None
        and stats.cpu >= cfg.busy_cpu_percent
        and other_cpu
        and max(other_cpu) <= stats.cpu - CPU_GAP_PERCENT
    ):
        also = f" (the other ranks' at most {max(other_cpu):.0f}%)"
        found.append(
            (
                CPU,
                f"its {stats.count} workers are CPU-bound at {stats.cpu:.0f}% each{also}",
                "Its samples cost more CPU than the others' (larger images, a costlier shard) or its cores "
                "are shared: balance the shards, make the transforms cheaper, or pin the ranks to their "
                "own cores.",
            )
        )
    pids = _pids_of(loader)
    swapped = _swap(s, pids)
    other_swap = [v for v in (_swap(s, _pids_of(x.loader)) for x in others) if v is not None]
    faults = _major_faults(window, pids)
    other_faults = [v for v in (_major_faults(window, _pids_of(x.loader)) for x in others) if v is not None]
    if (
        swapped is not None
        and swapped >= SWAP_BYTES
        and swapped >= 2 * max(other_swap, default=0)
        and faults is not None
        and faults >= SWAP_FAULTS_PER_S
        and faults >= 2 * max(other_faults, default=0.0)
    ):
        found.append(
            (
                SWAP,
                f"its processes hold {size(swapped)} in swap and read {faults:.0f} pages/s back in"
                + (f" (the other ranks at most {size(max(other_swap))})" if other_swap else ""),
                "Its memory is swapping: reduce this rank's memory (workers, prefetch, cached data) or the "
                "job's on this node.",
            )
        )
    gpu = _gpu_util(s, loader.pid)
    other_gpu = [g[1] for g in (_gpu_util(s, x.loader.pid) for x in others) if g is not None]
    if gpu is not None and other_gpu and gpu[1] >= max(other_gpu) + GPU_BUSIER_PERCENT:
        found.append(
            (
                GPU,
                f"its GPU {gpu[0]} is {gpu[1]:.0f}% busy, the other ranks' at most {max(other_gpu):.0f}%",
                "Its GPU is busier: another process on it, or a throttled device "
                "(nvidia-smi -q -d PERFORMANCE).",
            )
        )
    return found


def _unproven(ctx: Context, slow: _RankLoad, window: Sequence[Snapshot]) -> tuple[str, str, str]:
    """No difference measured between the slow rank and the others: with loaders equally near their
    limit, the slowest by a hair paces the job and takes all the waiting (the others' prefetch
    queues stay full), which looks the same from outside. Said as a possibility, not a verdict."""
    cfg = ctx.numbers(LoaderNumbers)
    stats = _worker_stats(window, set(slow.loader.worker_pids))
    if stats.cpu is not None and stats.cpu < cfg.idle_cpu_percent:
        return (
            LATENCY,
            f"its {stats.count} workers are mostly idle ({stats.cpu:.0f}% CPU each) and wait on no saturated "
            "disk: its samples take long to arrive (its storage's or its dataset's latency); nothing "
            "dlmon measured differs from the other ranks, so every rank's loader may be as slow, the "
            "slowest by a hair pacing the job",
            "If its dataset does something the others' do not (another shard, another storage, a remote "
            "read), fix that; if every rank's loader is this slow, it is input_bound's case: more workers "
            "or a larger prefetch_factor on every rank.",
        )
    return (
        NOT_MEASURED,
        "cause not measured: nothing dlmon reads differs from the other ranks (every rank's loader may "
        "be as slow, the slowest by a hair pacing the job)",
        f"Dump its stack (py-spy dump --pid {slow.loader.pid}) and its workers' to see where its batches "
        "wait; if every rank's loader is this slow, see input_bound.",
    )


def _straggler(
    ctx: Context,
    key: str,
    site: str,
    slow: _RankLoad,
    others: Sequence[_RankLoad],
    window: Sequence[Snapshot],
) -> Candidate:
    rank = _rank_of(slow.loader)
    causes = _causes(ctx, slow, others, window)
    other_ranks = sorted(others, key=lambda x: x.loader.rank or 0)
    names = ", ".join(str(x.loader.rank) for x in other_ranks)
    most_other = max(x.wait for x in others)
    noun = "rank" if len(others) == 1 else "ranks"
    verb = "waits" if len(others) == 1 else "wait at most"
    what = (
        f"Rank {rank.rank} is the straggler: its loader {site} waits for data {slow.wait:.0%} of the time, "
        f"{noun} {names} {verb} {most_other:.0%} (mean over {duration(WINDOW_S)}, all at "
        f"{slow.rate:.1f} batches/s): the other ranks wait for it in the collective, outside their loaders"
    )
    severity = severity_of(slow.wait, measured=bool(causes))
    if not causes:  # no measured difference: info, never the job's warning (see _unproven)
        causes = [_unproven(ctx, slow, window)]
    why = "; ".join(c[1] for c in causes)
    advice = " ".join(c[2] for c in causes)
    return Candidate(
        STRAGGLER,
        key,
        severity,
        rank.label(),
        f"{what}. Why: {why}.",
        advice,
        {
            "rank": rank.rank,
            "local_rank": rank.local_rank,
            "node_rank": rank.node_rank,
            "loader": site,
            "loader_id": slow.loader.id,
            "pid": slow.loader.pid,
            "data_wait_fraction": round(slow.wait, 3),
            "others_max_data_wait_fraction": round(most_other, 3),
            "batches_per_s": round(slow.rate, 2),
            "ranks_compared": len(others) + 1,
            "cause": causes[0][0],
            "causes": ",".join(c[0] for c in causes),
            "measured_difference": severity != INFO,
        },
    )
