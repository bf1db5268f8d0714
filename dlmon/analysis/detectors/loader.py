"""The DataLoader against the machine: input_bound, shm_exhaustion, oversubscription."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from dlmon.analysis.detectors._base import MIB, Candidate, Context, duration, size
from dlmon.analysis.detectors.io import DiskLoad, IoNumbers, disk_loads, saturated_disks
from dlmon.analysis.job_gpus import process_gpu_busy
from dlmon.analysis.severity import CRITICAL, WARNING
from dlmon.analysis.stats import mean, median
from dlmon.analysis.wait import by_process, combine_shares, own_share, snapshot_shares
from dlmon.model import LoaderSample, Snapshot
from dlmon.model.format import DEAD_STATES

INPUT_BOUND = "input_bound"
SHM_EXHAUSTION = "shm_exhaustion"
OVERSUBSCRIPTION = "oversubscription"


@dataclass(frozen=True, slots=True)
class LoaderNumbers:
    """input_bound's, shm_exhaustion's and oversubscription's numbers (docs/detectors.md)."""

    input_window_s: float = 10.0
    input_wait_fraction: float = 0.2
    input_hold_wait_fraction: float = 0.15
    input_critical_wait_fraction: float = 0.5
    busy_cpu_percent: float = 85.0  # a worker near one core
    idle_cpu_percent: float = 60.0
    main_busy_cpu_percent: float = 90.0
    # the process's own GPUs this busy over the window: the data wait is hidden behind GPU work
    input_gpu_busy_percent: float = 90.0
    shm_free_fraction: float = 0.10
    shm_free_bytes: float = 64.0 * MIB
    shm_critical_free_fraction: float = 0.02
    shm_hold_factor: float = 1.25  # a raised alert clears only above 1.25x the threshold
    default_prefetch_factor: int = 2
    shm_min_batch_bytes: float = 256 * 1024  # smaller worker RssShmem is no batch-size estimate
    oversub_window_s: float = 10.0
    oversub_thread_factor: float = 2.0  # workers x threads >= 2x cores is "well above"
    oversub_nvcsw_per_s: float = 100.0  # median involuntary switches per worker per second
    oversub_cpu_pressure_percent: float = 40.0  # PSI cpu some avg10, an alternative witness
    oversub_busy_fraction: float = 0.5  # workers use at least half of the cores


NO_WORKERS = "no_workers"
IO = "io"
MAIN = "main_process"
CPU = "cpu"
LATENCY = "too_few_workers"
UNCLEAR = "unclear"


@dataclass(frozen=True, slots=True)
class WorkerStats:
    cpu: float | None  # mean over ticks of the median worker CPU %
    dstate: float  # share of worker-ticks in D state
    count: int  # workers now
    read_bytes_per_s: float | None  # mean over ticks of the workers' summed disk reads


_WorkerTick = tuple[float | None, float | None, int, int]  # median CPU, reads, workers, in D state


def _worker_tick(s: Snapshot, pids: frozenset[int] | None) -> _WorkerTick:
    tick: list[float] = []
    read: float | None = None
    count = in_d = 0
    for p in s.processes:
        if p.role != "worker" or p.state in DEAD_STATES or (pids is not None and p.pid not in pids):
            continue
        count += 1
        if p.state == "D":
            in_d += 1
        if p.cpu_percent is not None:
            tick.append(p.cpu_percent)
        if p.read_bytes_per_s is not None:
            read = (read or 0.0) + p.read_bytes_per_s
    return (median(tick) if tick else None), read, count, in_d


def _combine_workers(ticks: Sequence[_WorkerTick]) -> WorkerStats:
    cpus = [c for c, _, _, _ in ticks if c is not None]
    reads = [r for _, r, _, _ in ticks if r is not None]
    total = sum(n for _, _, n, _ in ticks)
    in_d = sum(d for _, _, _, d in ticks)
    return WorkerStats(
        mean(cpus) if cpus else None,
        in_d / total if total else 0.0,
        ticks[-1][2] if ticks else 0,  # workers now
        mean(reads) if reads else None,
    )


def _worker_stats(window: Sequence[Snapshot], pids: set[int] | None) -> WorkerStats:
    frozen = None if pids is None else frozenset(pids)
    return _combine_workers([_worker_tick(s, frozen) for s in window])


def _window_worker_stats(ctx: Context, seconds: float, pids: set[int] | None) -> WorkerStats:
    """``_worker_stats(ctx.window(seconds), pids)``, each tick's part computed once per snapshot."""
    frozen = None if pids is None else frozenset(pids)
    ticks = ctx.per_snapshot(seconds, ("worker_tick", frozen), partial(_worker_tick, pids=frozen))
    return _combine_workers(ticks)


def _read_disk(ctx: Context, workers: WorkerStats) -> DiskLoad | None:
    """The disk the workers wait on, named only with a witness on that device: the workers read
    from disk and sleep in D state, while a disk is ≥ 80% busy with requests queueing on it
    (aqu-sz, await above its baseline) or, without those, while the workers are in D state ≥ 30%
    of the time. Which disk a worker reads is not mapped (no cheap /proc view of it): the busiest
    one that qualifies. The machine's IO pressure and other processes' D states are no proof."""
    cfg = ctx.numbers(IoNumbers)
    if not workers.read_bytes_per_s or workers.dstate <= 0:
        return None
    candidates = []
    for load in disk_loads(ctx):
        if load.util_percent < cfg.io_util_percent:
            continue
        on_device = any(w in ("queue", "await") for w in load.witnesses)
        if on_device or workers.dstate >= cfg.io_dstate_fraction:
            candidates.append(load)
    return max(candidates, key=lambda d: d.util_percent, default=None)


def _cpu_of(s: Snapshot, pid: int) -> tuple[float, ...]:
    return tuple(p.cpu_percent for p in s.processes if p.pid == pid and p.cpu_percent is not None)


def _main_cpu(ctx: Context, seconds: float, pid: int) -> float | None:
    ticks = ctx.per_snapshot(seconds, ("cpu_of", pid), partial(_cpu_of, pid=pid))
    values = [v for tick in ticks for v in tick]
    return mean(values) if values else None


def detect_input_bound(ctx: Context) -> list[Candidate]:
    """Judged per training process on its share of wall time spent waiting for data, summed over
    its loaders, and named after the loader(s) that cost it. A loader iterated a small share of
    the time (validation bursts) waits a high share of its own time without costing the job
    much: it is never the verdict then, and its own figure is given beside the job's."""
    cfg = ctx.numbers(LoaderNumbers)
    s = ctx.latest
    if not s.loaders:
        return []
    window = ctx.window(cfg.input_window_s)
    out: list[Candidate] = []
    for pid, live in by_process(x for x in s.loaders if x.alive).items():
        shares = ctx.per_snapshot(cfg.input_window_s, ("wall_shares", pid), partial(snapshot_shares, pid=pid))
        job, per, n = combine_shares(shares)
        if job is None:
            continue
        held = [x for x in live if ctx.is_active(INPUT_BOUND, f"loader:{x.id}")]
        if job < (cfg.input_hold_wait_fraction if held else cfg.input_wait_fraction):
            continue
        ranked = sorted(live, key=lambda x: -per.get(x.id, 0.0))
        culprits = [x for x in ranked if per.get(x.id, 0.0) >= CULPRIT_SHARE * job] or ranked[:1]
        top = next((x for x in held if x in culprits), culprits[0])  # a held verdict keeps its key
        culprits = [top, *(x for x in culprits if x is not top)]
        out.append(_input_bound(ctx, top, job, n, window, _Shares(culprits, live, per)))
    return out


CULPRIT_SHARE = 0.25  # a loader that costs at least this part of the job's wait is named


@dataclass(frozen=True, slots=True)
class GpuBusy:
    """How busy the training process's own GPUs were over the window (NVML's utilisation: the
    share of time a kernel ran), where NVML lists the process on them."""

    keys: tuple[str, ...]  # device keys, e.g. ("0",) or ("3", "4")
    busy_percent: float  # mean over the window of each tick's busiest device
    own: bool  # the process's own kernels (NVML's per-process figure), not the whole device's


def _gpu_busy(ctx: Context, seconds: float, pid: int) -> GpuBusy | None:
    """Each tick's busiest of the process's GPUs, over the window: a rank listed on a second GPU
    only by a stray context (every rank touching cuda:0) runs none of its kernels there, and a
    mean would halve its own GPU's figure."""
    ticks = ctx.per_snapshot(seconds, ("gpu_busy", pid), partial(process_gpu_busy, pid=pid))
    own = any(mine for tick in ticks for _, _, mine in tick)
    busiest = [max(((u, k) for k, u, mine in tick if mine == own), default=None) for tick in ticks]
    values = [b for b in busiest if b is not None]
    if not values or len(values) < max(2, len(ticks) // 2):
        return None  # too few ticks with a reading to say what the GPU did over the window
    keys = tuple(dict.fromkeys(k for _, k in values))
    return GpuBusy(keys, mean([u for u, _ in values]), own)


def _gpu_sentence(busy: GpuBusy, hidden: bool) -> str:
    which = f"GPU {busy.keys[0]}" if len(busy.keys) == 1 else f"GPUs {', '.join(busy.keys)}"
    was = "was" if len(busy.keys) == 1 else "were"
    if busy.own:
        only = "" if hidden else "only "
        did = f"its kernels kept {which} busy {only}{busy.busy_percent:.0f}% of that time"
    elif hidden:
        did = f"its {which} {was} busy {busy.busy_percent:.0f}% of that time"
    else:
        did = f"its {which} {was} idle {100.0 - busy.busy_percent:.0f}% of that time"
    if hidden:
        hidden_note = "the wait is hidden behind GPU work, so faster input may not speed the training up"
        return f"; yet {did}: {hidden_note}"
    return f"; {did}"


@dataclass(frozen=True, slots=True)
class _Shares:
    culprits: list[LoaderSample]  # the loaders that cost the job its wait, the verdict's first
    live: list[LoaderSample]  # all of the process's loaders
    per: dict[str, float]  # loader id -> its mean share of wall time


def _role_note(loader: LoaderSample) -> str:
    known = [x for x in (f"{loader.role} loader" if loader.role else None, loader.framework) if x]
    return f" ({', '.join(known)})" if known else ""


def _what(ctx: Context, wait: float, window: Sequence[Snapshot], shares: _Shares) -> tuple[str, float | None]:
    """The sentence naming the loader(s) that cost the job its wait, with each other loader that
    waits much of its own time but costs the job little; and the first one's own share."""
    cfg = ctx.numbers(LoaderNumbers)
    over = f"(mean over {duration(cfg.input_window_s)})"
    named = shares.culprits
    if len(named) == 1:
        what = f"Loader {named[0].label}{_role_note(named[0])} waits for data {wait:.0%} of the time {over}"
    else:
        each = ", ".join(f"{x.label}{_role_note(x)} {shares.per.get(x.id, 0.0):.0%}" for x in named)
        what = f"The trainer waits for data {wait:.0%} of the time {over}, on loaders {each}"
    asides: list[str] = []
    for x in shares.live:
        if x in named:
            continue
        own = own_share(window, x.id)
        wall = shares.per.get(x.id)
        if own is not None and own >= cfg.input_wait_fraction and wall is not None:
            who = f"{x.role} loader {x.label}" if x.role else f"loader {x.label}"
            asides.append(f"{who} waits {own:.0%} of its own time, {wall:.0%} of the job's")
    if asides:
        what += " (" + "; ".join(asides) + ")"
    return what, own_share(window, named[0].id)


def _input_bound(
    ctx: Context, loader: LoaderSample, wait: float, n: int, window: Sequence[Snapshot], shares: _Shares
) -> Candidate:
    cfg = ctx.numbers(LoaderNumbers)
    cores = ctx.cores
    with_workers = [x for x in ctx.latest.loaders if (x.num_workers or 0) > 0]
    pids: set[int] | None = set(loader.worker_pids) if loader.worker_pids else None
    if pids is None and len(with_workers) > 1:
        pids = set()  # several loaders and no pid lists: cannot tell whose workers are whose
    stats = _window_worker_stats(ctx, cfg.input_window_s, pids)
    worker_cpu, dstate = stats.cpu, stats.dstate
    main_cpu = _main_cpu(ctx, cfg.input_window_s, loader.pid)
    nw = loader.num_workers if loader.num_workers is not None else stats.count
    read_disk = _read_disk(ctx, stats)
    busy_disks = saturated_disks(ctx)  # context only: someone else's IO is no cause
    pressure = ctx.latest.pressure.io_some_avg10 if ctx.latest.pressure is not None else None
    # DDP / torchrun: every rank on the node iterates its own loader, and its workers share the
    # cores with the other ranks' (a rank without workers yet counts: it is the one told to add some)
    ranks = len({x.pid for x in ctx.latest.loaders if x.alive}) or 1
    rank_cores = max(1, cores // ranks)
    suggested = max(1, rank_cores - 1)
    on_cores = f"{cores} cores" if ranks == 1 else f"{rank_cores} of {cores} cores per rank, {ranks} ranks"
    what, own = _what(ctx, wait, window, shares)
    if nw == 0:
        cause = NO_WORKERS
        why = "with num_workers=0 the main process loads every batch itself"
        advice = f"Set num_workers (start at {min(8, suggested)}: {on_cores})."
    elif read_disk is not None:
        cause = IO
        on_disk = [f"{read_disk.util_percent:.0f}% busy"]
        if read_disk.queue_depth is not None:
            on_disk.append(f"{read_disk.queue_depth:.1f} requests queued")
        if read_disk.await_ms is not None:
            on_disk.append(f"{read_disk.await_ms:.1f} ms await")
        why = (
            f"it is input-bound because of IO: disk {read_disk.name} is saturated ({', '.join(on_disk)}) "
            f"while its workers read {size(stats.read_bytes_per_s)}/s and wait on IO (D state) "
            f"{dstate:.0%} of the time"
        )
        if pressure is not None:
            why += f", IO pressure {pressure:.0f}%"
        advice = (
            "More workers will not help a saturated disk: cache the data in RAM or on faster "
            "storage, read large sequential shards instead of many small files, store smaller "
            "or pre-decoded samples."
        )
    elif main_cpu is not None and main_cpu >= cfg.main_busy_cpu_percent:
        cause = MAIN
        why = f"the main process is at {main_cpu:.0f}% CPU (collate, the pin_memory thread, the GIL)"
        advice = (
            "The trainer's own Python is the bottleneck: do per-sample work in the workers' "
            "__getitem__, keep collate_fn cheap, use pin_memory only with CUDA, and profile the "
            "training step for Python overhead."
        )
    elif worker_cpu is not None and worker_cpu >= cfg.busy_cpu_percent:
        cause = CPU
        why = f"its {nw} workers are CPU-bound at {worker_cpu:.0f}% each"
        if nw >= suggested:
            advice = (
                f"Every core is busy ({on_cores}): the transforms are CPU-bound; make them cheaper, "
                "decode or augment on the GPU (DALI, torchvision.io.decode_jpeg on CUDA), or cache "
                "pre-processed samples."
            )
        else:
            advice = f"Cores are free: raise num_workers from {nw} to {suggested} (cores - 1, {on_cores})."
    elif worker_cpu is not None and worker_cpu < cfg.idle_cpu_percent:
        cause = LATENCY
        why = (
            f"its {nw} workers are mostly idle ({worker_cpu:.0f}% CPU each) and wait on no saturated "
            "disk: too few workers to hide per-sample latency"
        )
        # idle workers waiting on latency cost no CPU: they may outnumber the cores
        more = max(suggested, 2 * nw)
        advice = (
            f"Raise num_workers from {nw} to {more} ({on_cores}; idle workers waiting on latency "
            "may outnumber the cores) or prefetch_factor (now "
            f"{loader.prefetch_factor if loader.prefetch_factor is not None else 'default 2'}) so more "
            "reads overlap; for remote storage, batch the reads."
        )
    else:
        cause = UNCLEAR
        cpu_text = "unknown" if worker_cpu is None else f"{worker_cpu:.0f}%"
        why = f"its workers run at {cpu_text} CPU and wait on no saturated disk"
        advice = "Profile a worker's __getitem__ (py-spy dump --pid) to see where the time goes."
    # The GPU confirms the verdict (idle while the loader is waited on) or says the wait costs
    # little (busy all along: CUDA's queue hides it): then never critical.
    gpu = _gpu_busy(ctx, cfg.input_window_s, loader.pid)
    hidden = gpu is not None and gpu.busy_percent >= cfg.input_gpu_busy_percent
    if gpu is not None:
        why += _gpu_sentence(gpu, hidden)
    critical = wait >= cfg.input_critical_wait_fraction and not hidden
    return Candidate(
        INPUT_BOUND,
        f"loader:{loader.id}",
        CRITICAL if critical else WARNING,
        f"loader {loader.label}",
        f"{what}: {why}.",
        advice,
        {
            "data_wait_fraction": round(wait, 3),
            "samples": n,
            "cause": cause,
            "num_workers": nw,
            "worker_cpu_percent": None if worker_cpu is None else round(worker_cpu, 1),
            "main_cpu_percent": None if main_cpu is None else round(main_cpu, 1),
            "worker_dstate_fraction": round(dstate, 2),
            "saturated_disk": read_disk.name if read_disk is not None else None,
            "busy_disk_not_read": None
            if read_disk is not None or not busy_disks
            else busy_disks[0].name,  # saturated by someone else, or not the workers' disk
            "worker_read_bytes_per_s": None
            if stats.read_bytes_per_s is None
            else round(stats.read_bytes_per_s),
            "io_pressure_some_avg10": pressure,
            "cores": cores,
            "ranks": ranks,
            "batch_size": loader.batch_size,
            "prefetch_factor": loader.prefetch_factor,
            "role": loader.role,
            "job_wall_wait_fraction": round(wait, 3),  # = data_wait_fraction: the job's share of wall time
            "own_wait_fraction": None if own is None else round(own, 3),  # within the loader's own iteration
            "loaders_named": ", ".join(x.name for x in shares.culprits),
            "gpus": None if gpu is None else ", ".join(gpu.keys),  # the process's own, NVML's list
            "gpu_busy_percent": None if gpu is None else round(gpu.busy_percent, 1),
            "gpu_busy_own": None if gpu is None else gpu.own,  # the process's own kernels' share
        },
    )


# -- shm_exhaustion --------------------------------------------------------------------------


def detect_shm_exhaustion(ctx: Context) -> list[Candidate]:
    cfg = ctx.numbers(LoaderNumbers)
    s = ctx.latest
    shm = s.shm
    if shm is None or shm.available_bytes is None or not shm.total_bytes:
        return []
    workers = ctx.tree().workers()
    loaders = [x for x in s.loaders if x.alive and (x.num_workers or 0) > 0]
    if not workers and not loaders:
        return []  # nothing passes batches through shared memory
    held = ctx.is_active(SHM_EXHAUSTION, "shm")
    factor = cfg.shm_hold_factor if held else 1.0
    if loaders:
        in_flight = sum(
            (x.num_workers or 0) * (x.prefetch_factor or cfg.default_prefetch_factor) for x in loaders
        )
        how = " + ".join(
            f"{x.num_workers} workers x prefetch {x.prefetch_factor or cfg.default_prefetch_factor}"
            for x in loaders
        )
    else:
        in_flight = len(workers) * cfg.default_prefetch_factor
        how = f"{len(workers)} workers x prefetch {cfg.default_prefetch_factor} (assumed)"
    floor = max(cfg.shm_free_fraction * shm.total_bytes, cfg.shm_free_bytes)
    free = shm.available_bytes
    batch = max((w.shmem_bytes or 0 for w in workers), default=0)
    if batch and free < 4 * in_flight * batch:  # close enough to matter: the 30 s maximum
        pids = {w.pid for w in workers}
        batch = max(
            (p.shmem_bytes or 0 for snap in ctx.window(30.0) for p in snap.processes if p.pid in pids),
            default=batch,
        )
    if batch < cfg.shm_min_batch_bytes:
        batch = 0  # a worker's resident shared memory this small is not a batch: estimate unknown
    need = in_flight * batch if batch > 0 else None
    short = need is not None and free < need * factor
    low = free < floor * factor
    if not (short or low):
        return []
    severity = CRITICAL if short or free < cfg.shm_critical_free_fraction * shm.total_bytes else WARNING
    message = f"/dev/shm has {size(free)} free of {size(shm.total_bytes)}"
    if need is not None:
        message += (
            f" while {how} batches of ~{size(batch)} (the workers' resident shared memory) "
            f"need ~{size(need)} in flight"
        )
    else:
        message += f" (under {size(floor)}) for {how} in-flight batches"
    message += "; the next step is a worker dying of 'Bus error' (SIGBUS)."
    return [
        Candidate(
            SHM_EXHAUSTION,
            "shm",
            severity,
            f"/dev/shm of pid {s.target.pid}",
            message,
            "Give the job more shared memory (docker run --shm-size=8g, a bigger tmpfs on /dev/shm, "
            "or emptyDir medium: Memory in Kubernetes), or lower num_workers, prefetch_factor or "
            "the batch size.",
            {
                "shm_path": shm.path,
                "shm_total_bytes": shm.total_bytes,
                "shm_available_bytes": free,
                "in_flight_batches": in_flight,
                "batch_bytes_estimate": batch or None,
                "batch_bytes_source": "largest worker RssShmem over 30 s" if batch else None,
                "need_bytes": need,
                "floor_bytes": round(floor),
            },
        )
    ]


# -- oversubscription ------------------------------------------------------------------------


def detect_oversubscription(ctx: Context) -> list[Candidate]:
    cfg = ctx.numbers(LoaderNumbers)
    cores = ctx.cores
    workers = ctx.tree().workers()
    nw = len(workers)
    if nw < 2:
        return []
    threads_known = [w.num_threads for w in workers if w.num_threads is not None]
    threads = median([float(t) for t in threads_known]) if threads_known else 1.0
    too_many = nw > cores
    too_threaded = nw * threads >= cfg.oversub_thread_factor * cores
    if not (too_many or too_threaded):
        return []
    held = ctx.is_active(OVERSUBSCRIPTION, "job")
    relax = 0.5 if held else 1.0
    pressure = ctx.latest.pressure.cpu_some_avg10 if ctx.latest.pressure is not None else None
    # a cheap look at the latest tick first: the window is only read when it may matter
    busy_now = sum(w.cpu_percent or 0.0 for w in workers)
    switching_now = [w.nonvoluntary_ctxt_switches_per_s or 0.0 for w in workers]
    if busy_now < 0.5 * cfg.oversub_busy_fraction * relax * cores * 100.0:
        return []
    if median(switching_now) < 0.5 * cfg.oversub_nvcsw_per_s * relax and (
        pressure is None or pressure < cfg.oversub_cpu_pressure_percent * relax
    ):
        return []
    pids = {w.pid for w in workers}
    nvcsw: dict[int, list[float]] = {}
    cpu_ticks: list[float] = []
    for snap in ctx.window(cfg.oversub_window_s):
        tick = 0.0
        for p in snap.processes:
            if p.pid in pids:
                if p.nonvoluntary_ctxt_switches_per_s is not None:
                    nvcsw.setdefault(p.pid, []).append(p.nonvoluntary_ctxt_switches_per_s)
                if p.cpu_percent is not None:
                    tick += p.cpu_percent
        cpu_ticks.append(tick)
    switches = median([mean(v) for v in nvcsw.values()]) if nvcsw else None
    busy = mean(cpu_ticks) if cpu_ticks else 0.0
    contended = (switches is not None and switches >= cfg.oversub_nvcsw_per_s * relax) or (
        pressure is not None and pressure >= cfg.oversub_cpu_pressure_percent * relax
    )
    if not contended or busy < cfg.oversub_busy_fraction * relax * cores * 100.0:
        return []
    suggested = max(1, cores - 1)
    parts = [f"{nw} DataLoader workers"]
    if threads > 1:
        parts.append(f"with {threads:.0f} threads each")
    message = " ".join(parts) + f" share {cores} cores (using {busy / 100:.1f} of them)"
    if switches is not None:
        message += f"; each is switched out involuntarily {switches:.0f} times/s"
    if pressure is not None:
        message += f", CPU pressure {pressure:.0f}%"
    message += "."
    return [
        Candidate(
            OVERSUBSCRIPTION,
            "job",
            WARNING,
            f"workers of pid {ctx.latest.target.pid}",
            message,
            f"Use at most {suggested} workers (cores - 1) and one thread per worker: in "
            "worker_init_fn call torch.set_num_threads(1) and cv2.setNumThreads(0), or set "
            "OMP_NUM_THREADS=1; past the physical cores more workers only add scheduling overhead.",
            {
                "workers": nw,
                "threads_per_worker": threads,
                "cores": cores,
                "nonvoluntary_switches_per_s": None if switches is None else round(switches, 1),
                "workers_cpu_percent": round(busy, 1),
                "cpu_pressure_some_avg10": pressure,
                "suggested_num_workers": suggested,
            },
        )
    ]
