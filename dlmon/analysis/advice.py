"""``advise(history)``: the write-up's rules of thumb, fed with what was measured.

Every line of advice names the measured number it rests on. The seed's memory formula,
peak ~= (num_workers + 1) x batch_size x memory per sample, is shown next to the measured peak
(the largest PSS total seen), so its error is visible rather than trusted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dlmon.analysis.analyzer import default_cores, target_cores
from dlmon.analysis.detectors import Candidate, detect, headroom
from dlmon.analysis.detectors._base import JobTree, duration, per_min, size
from dlmon.analysis.digest import Digest, DigestLimits
from dlmon.analysis.job_gpus import job_tensor_gpus
from dlmon.analysis.startup import startup_of
from dlmon.analysis.stats import median, theil_sen
from dlmon.model import LoaderSample, ProcessSample, Snapshot

RESERVE = 0.2  # the seed's 20% of headroom kept free
DEFAULT_PREFETCH = 2


@dataclass(frozen=True, slots=True)
class AdviceLine:
    topic: str  # num_workers, memory, pin_memory, persistent_workers, prefetch_factor, ...
    text: str  # what to change (or keep)
    because: str  # the measurement it rests on


@dataclass(frozen=True, slots=True)
class PeakEstimate:
    """The seed's formula against the measured peak."""

    num_workers: int
    batch_size: int
    sample_bytes: float
    sample_bytes_method: str
    predicted_peak_bytes: float
    measured_peak_bytes: int | None
    error_fraction: float | None  # predicted / measured - 1


@dataclass(frozen=True, slots=True)
class Advice:
    pid: int
    cmdline: str
    duration_s: float
    snapshots: int
    cores: int
    has_agent: bool
    loader: str | None  # the loader advised on (file:line)
    num_workers: int | None
    batch_size: int | None
    prefetch_factor: int | None
    pin_memory: bool | None
    persistent_workers: bool | None
    data_wait_fraction: float | None
    workers_alive: int
    worker_uss_median_bytes: int | None
    worker_uss_max_bytes: int | None
    pss_total_bytes: int | None
    measured_peak_bytes: int | None
    headroom_bytes: int | None
    headroom_source: str | None  # "cgroup" or "machine"
    limit_bytes: int | None
    estimate: PeakEstimate | None
    max_workers_by_memory: int | None
    recommended_num_workers: int | None
    lines: tuple[AdviceLine, ...]
    findings: tuple[str, ...]  # what the detectors see in this history (no hysteresis)
    notes: tuple[str, ...]
    ranks: int = 1  # DDP / torchrun: processes on the node iterating a loader; cores and memory per rank


def _rank_workers(loader: LoaderSample | None, workers: Sequence[ProcessSample], ranks: int) -> int:
    """The live workers of the advised loader (its worker_pids), else an even share of all."""
    if loader is not None and loader.worker_pids:
        listed = set(loader.worker_pids)
        return sum(1 for w in workers if w.pid in listed)
    return len(workers) // ranks if ranks > 1 else len(workers)


def _pick_loader(s: Snapshot) -> LoaderSample | None:
    if not s.loaders:
        return None
    return max(s.loaders, key=lambda x: ((x.num_workers or 0), x.batches_per_s or 0.0))


def _latest_uss(history: Sequence[Snapshot], workers: Sequence[ProcessSample]) -> list[int]:
    """Each live worker's newest known USS (looking back when the latest tick has none)."""
    wanted = {(w.pid, w.start_time) for w in workers}
    found: dict[tuple[int, int], int] = {}
    for s in reversed(history):
        for p in s.processes:
            key = (p.pid, p.start_time)
            if key in wanted and key not in found and p.uss_bytes is not None:
                found[key] = p.uss_bytes
        if len(found) == len(wanted):
            break
    return list(found.values())


def _worker_cpu(history: Sequence[Snapshot], workers: Sequence[ProcessSample]) -> float | None:
    """Median over the live workers of each one's mean CPU over the history."""
    pids = {w.pid for w in workers}
    seen: dict[int, list[float]] = {}
    for s in history:
        for p in s.processes:
            if p.pid in pids and p.cpu_percent is not None:
                seen.setdefault(p.pid, []).append(p.cpu_percent)
    return median([sum(v) / len(v) for v in seen.values()]) if seen else None


def _worker_growth(digest: Digest) -> float | None:
    """Median USS slope (bytes/s) over the live workers with 3+ readings."""
    slopes = []
    for track in digest.live():
        if track.role != "worker" or len(track.uss) < 3:
            continue
        slope = theil_sen(track.uss.points)
        if slope is not None:
            slopes.append(slope)
    return median(slopes) if slopes else None


def advise(history: Sequence[Snapshot], *, cores: int | None = None) -> Advice:
    """Advice from a short history of one target (a few seconds is enough; longer is better)."""
    if not history:
        raise ValueError("advise needs at least one snapshot")
    s = history[-1]
    n_cores = cores if cores is not None else target_cores(s, default_cores())
    tree = JobTree.of(s)
    workers = tree.workers()
    loader = _pick_loader(s)
    has_agent = bool(s.loaders)
    digest = Digest.from_history(history, DigestLimits(min_gap_s=0.2))  # a few seconds: keep them all
    uss = _latest_uss(history, workers)
    uss_median = round(median([float(u) for u in uss])) if uss else None
    uss_max = max(uss) if uss else None
    peaks = [x.memory.pss_sum_bytes for x in history if x.memory.pss_sum_bytes is not None]
    measured_peak = max(peaks) if peaks else None
    room = headroom(s)
    nw = loader.num_workers if loader and loader.num_workers is not None else len(workers)
    batch = loader.batch_size if loader else None
    prefetch = loader.prefetch_factor if loader and loader.prefetch_factor else None
    wait = loader.data_wait_fraction if loader else None
    lines: list[AdviceLine] = []
    notes: list[str] = []

    # -- the seed's formula vs the measured peak --------------------------------------------
    estimate: PeakEstimate | None = None
    if batch and uss_median is not None and nw > 0:
        pf = prefetch or DEFAULT_PREFETCH
        sample = uss_median / (pf * batch)
        predicted = (nw + 1) * batch * sample
        error = None if not measured_peak else predicted / measured_peak - 1.0
        estimate = PeakEstimate(
            nw,
            batch,
            sample,
            f"median worker USS {size(uss_median)} / (prefetch_factor {pf} x batch_size {batch})",
            predicted,
            measured_peak,
            error,
        )
        because = f"predicted ({nw} + 1) x {batch} x {size(sample)} = {size(predicted)}"
        if measured_peak:
            because += (
                f"; measured peak PSS {size(measured_peak)} ({error:+.0%})" if error is not None else ""
            )
        lines.append(
            AdviceLine(
                "memory",
                "The write-up's rule peak = (num_workers + 1) x batch_size x sample memory "
                + ("under-estimates" if error is not None and error < 0 else "over-estimates")
                + " this job: trust the measured peak, not the formula.",
                because,
            )
        )

    # -- num_workers -------------------------------------------------------------------------
    # DDP / torchrun: each rank on the node sizes its own loader, so it gets its share of the
    # node's cores and free memory (as input_bound does), not all of them
    ranks = len({x.pid for x in s.loaders if x.alive}) or 1
    rank_cores = max(1, n_cores // ranks)
    rank_workers = _rank_workers(loader, workers, ranks)
    by_memory: int | None = None
    recommended: int | None = None
    cpu_cap = max(0, rank_cores - 1)
    cap_text = f"cores - 1 = {cpu_cap}" if ranks == 1 else f"{n_cores} cores / {ranks} ranks - 1 = {cpu_cap}"
    if uss_max is not None and room is not None and uss_max > 0:
        room_share = room.bytes / ranks
        usable = (1.0 - RESERVE) * (room_share + rank_workers * uss_max)
        by_memory = max(0, int(usable // uss_max))
        recommended = min(by_memory, cpu_cap)
        free = (
            f"{size(room.bytes)} free under the {room.source} limit"
            if ranks == 1
            else f"{size(room_share)} per rank of {size(room.bytes)} free under the {room.source} limit"
        )
        because = (
            f"{1 - RESERVE:.0%} of ({free} + {rank_workers} workers x {size(uss_max)}) / "
            f"{size(uss_max)} per worker = {by_memory}; {cap_text}"
        )
        busy_median = _worker_cpu(history, workers)
        if by_memory < nw:
            text = f"Lower num_workers from {nw} to {recommended}: memory does not hold {nw} workers."
        elif recommended < nw and busy_median is not None and busy_median < 50:
            text = (
                f"num_workers={nw} is above the write-up's cap of {cap_text}, but the workers "
                f"are mostly idle ({busy_median:.0f}% CPU each): keep them while loading waits on IO, "
                f"lower to {recommended} if they become busy."
            )
            because += f"; median worker CPU {busy_median:.0f}%"
        elif recommended < nw:
            text = (
                f"Lower num_workers from {nw} to {recommended}: more workers than cores only add switching."
            )
            if busy_median is not None:
                because += f"; median worker CPU {busy_median:.0f}%"
        elif wait is not None and wait >= 0.2 and recommended > nw:
            text = f"Raise num_workers from {nw} to {recommended}: the loader waits {wait:.0%} of the time."
        elif recommended > nw:
            text = (
                f"num_workers={nw} is safe; up to {recommended} would fit if loading becomes the bottleneck."
            )
        else:
            text = f"num_workers={nw} is at the limit of this machine; keep it."
        lines.append(AdviceLine("num_workers", text, because))
    elif nw == 0 and loader is not None:
        lines.append(
            AdviceLine(
                "num_workers",
                f"Start with num_workers={min(8, cpu_cap) or 1} and re-run advise to size it from "
                "measured worker memory.",
                "num_workers=0: the main process loads every batch; no worker memory to measure yet",
            )
        )
    growth = _worker_growth(digest)
    if growth is not None and growth > 16 * 1024:
        lines.append(
            AdviceLine(
                "memory",
                "Worker memory is still growing, so the per-worker figure above will grow too: if "
                "the Dataset holds Python objects, move them to numpy arrays or tensors (copy-on-read).",
                f"median worker USS slope {per_min(growth)}",
            )
        )

    # -- pin_memory --------------------------------------------------------------------------
    # Not every GPU on the box, nor one where the job has only the CUDA context its pinning
    # made: a CPU-only job on a GPU machine pins for nothing.
    gpus = job_tensor_gpus(s)
    pinned = s.pinned.bytes if s.pinned is not None else None
    if loader is not None and loader.pin_memory is not None:
        if loader.pin_memory and not gpus:
            lines.append(
                AdviceLine(
                    "pin_memory",
                    "Set pin_memory=False: the job uses no CUDA device, so pinning only costs a "
                    "thread and page-locked memory.",
                    (
                        f"no GPU seen ({s.gpu.reason or 'NVML'})"
                        if not s.gpus
                        else f"torch holds no memory on any GPU ({len(s.gpus)} seen)"
                        if any(g.torch_reserved_bytes is not None for g in s.gpus)
                        else f"none of the {len(s.gpus)} GPU(s) lists the job's processes or torch memory"
                    )
                    + f"; pinned now {size(pinned)}",
                )
            )
        elif not loader.pin_memory and gpus:
            lines.append(
                AdviceLine(
                    "pin_memory",
                    "Set pin_memory=True: host-to-GPU copies become asynchronous (about 10% faster in the "
                    "write-up); pinned memory cannot be swapped, so keep it well inside the headroom.",
                    f"data wait {wait:.0%}" if wait is not None else f"{len(gpus)} GPU(s) in use",
                )
            )
        elif loader.pin_memory and pinned is not None and room is not None:
            lines.append(
                AdviceLine(
                    "pin_memory",
                    "Keep pin_memory=True"
                    + (
                        " but watch it: page-locked memory is a large share of the headroom."
                        if pinned > 0.25 * room.bytes
                        else "."
                    ),
                    f"pinned {size(pinned)} vs {size(room.bytes)} headroom",
                )
            )

    # -- persistent_workers ------------------------------------------------------------------
    worker_ids = {(t.pid, t.start_time) for t in digest.processes.values() if t.role == "worker"}
    restarts = max(0, len(worker_ids) - len(workers))
    span = history[-1].time - history[0].time
    startup = startup_of(s, loader) if loader is not None else None
    if loader is not None and loader.persistent_workers is False and nw > 0 and startup is not None:
        if startup.large:
            lines.append(
                AdviceLine(
                    "persistent_workers",
                    f"Set persistent_workers=True: worker start-up takes {startup.describe()}; "
                    "persistent workers start once.",
                    f"worker start-up {startup.seconds_total:.1f} s in all (building the iterator "
                    "and the first batch of each epoch)",
                )
            )
        else:
            lines.append(
                AdviceLine(
                    "persistent_workers",
                    f"Worker start-up is small here ({startup.describe()}): persistent_workers=True "
                    "would save little.",
                    f"worker start-up {startup.seconds_total:.1f} s in all",
                )
            )
    elif loader is not None and loader.persistent_workers is False and nw > 0:
        if restarts:
            lines.append(
                AdviceLine(
                    "persistent_workers",
                    "Set persistent_workers=True: workers are re-created every epoch (fork, copy of the "
                    "Dataset, worker_init_fn).",
                    f"{restarts} worker exits/starts in {duration(span)}",
                )
            )
        else:
            lines.append(
                AdviceLine(
                    "persistent_workers",
                    "persistent_workers=True would save the per-epoch worker start-up; no restart was "
                    "seen in this sample, so its effect here is unmeasured.",
                    f"0 worker restarts in {duration(span)}",
                )
            )
    elif loader is not None and loader.persistent_workers and growth is not None and growth > 16 * 1024:
        lines.append(
            AdviceLine(
                "persistent_workers",
                "Persistent workers keep their copy-on-read growth for the whole run: fix the Dataset's "
                "storage, or let workers restart each epoch (persistent_workers=False).",
                f"median worker USS slope {per_min(growth)}",
            )
        )

    # -- prefetch_factor ---------------------------------------------------------------------
    worker_cpu = [w.cpu_percent for w in workers if w.cpu_percent is not None]
    cpu_med = median(worker_cpu) if worker_cpu else None
    shm = s.shm
    if loader is not None and nw > 0:
        pf = prefetch or DEFAULT_PREFETCH
        batch_shm = max((w.shmem_bytes or 0) for w in workers) if workers else 0
        in_flight = nw * pf * batch_shm
        if (
            shm is not None
            and shm.available_bytes is not None
            and batch_shm
            and shm.available_bytes < 2 * in_flight
        ):
            lines.append(
                AdviceLine(
                    "prefetch_factor",
                    f"Lower prefetch_factor (now {pf}) or give /dev/shm more room: in-flight batches "
                    "nearly fill it.",
                    f"/dev/shm free {size(shm.available_bytes)} vs {nw} x {pf} x ~{size(batch_shm)} "
                    "in flight",
                )
            )
        elif wait is not None and wait >= 0.1 and cpu_med is not None and cpu_med < 60:
            lines.append(
                AdviceLine(
                    "prefetch_factor",
                    f"Raise prefetch_factor from {pf} to {pf * 2}: workers have spare time while the "
                    "trainer waits.",
                    f"data wait {wait:.0%}, median worker CPU {cpu_med:.0f}%",
                )
            )

    # -- threads per worker --------------------------------------------------------------------
    # A DataLoader worker has ~3 OS threads even at torch.set_num_threads(1) (its main thread and
    # multiprocessing's queue feeder): only threads that run compete, so ask for that evidence.
    threads = [float(w.num_threads) for w in workers if w.num_threads is not None]
    per_worker = median(threads) if threads else 1.0
    worker_cpu = [w.cpu_percent for w in workers if w.cpu_percent is not None]
    switches = [
        w.nonvoluntary_ctxt_switches_per_s for w in workers if w.nonvoluntary_ctxt_switches_per_s is not None
    ]
    cpu_med = median(worker_cpu) if worker_cpu else None
    switches_med = median(switches) if switches else None
    several_busy = cpu_med is not None and cpu_med > 110.0  # more than one core: several threads run
    preempted = switches_med is not None and switches_med >= 100.0
    if per_worker > 2 and len(workers) * per_worker > 2 * n_cores and (several_busy or preempted):
        evidence = (
            f"median worker CPU {cpu_med:.0f}%"
            if several_busy
            else f"{switches_med:.0f} involuntary switches/s"
        )
        lines.append(
            AdviceLine(
                "threads",
                "Give each worker one thread: torch.set_num_threads(1) and cv2.setNumThreads(0) in "
                "worker_init_fn, or OMP_NUM_THREADS=1.",
                f"{len(workers)} workers x {per_worker:.0f} threads on {n_cores} cores; "
                f"{evidence} per worker",
            )
        )

    # -- VRAM: gradient accumulation ---------------------------------------------------------
    for g in gpus:
        if g.memory_used_bytes is None or not g.memory_total_bytes or g.is_mig_parent:
            continue  # a MIG card's memory is its slices', not the job's
        frac = g.memory_used_bytes / g.memory_total_bytes
        if frac >= 0.9:
            half = f" ({batch} -> {batch // 2} x 2 steps)" if batch and batch >= 2 else ""
            lines.append(
                AdviceLine(
                    "gradient_accumulation",
                    f"Use gradient accumulation{half}: activations scale with the batch, so halving it "
                    "frees most of their memory for the same effective batch (the write-up: ResNet50 "
                    "18 -> 5 GB at 4 steps, ~15% slower).",
                    f"GPU {g.key} {frac:.0%} full ({size(g.memory_used_bytes)} of "
                    f"{size(g.memory_total_bytes)})",
                )
            )
    if not s.gpu.available:
        reason = (s.gpu.reason or "NVML not available").rstrip(".")
        notes.append(f"No GPU figures ({reason}): no VRAM advice.")

    if not has_agent:
        pss_total = s.memory.pss_sum_bytes
        notes.append(
            "No DataLoader information (the in-process agent is not attached): from the process tree "
            f"alone there are {len(workers)} workers (pt_data_worker), median worker USS "
            f"{size(uss_median)}, job PSS {size(pss_total)}, headroom {size(room.bytes if room else None)} "
            f"({room.source if room else 'unknown'}), {n_cores} cores. Batch size, prefetch_factor, "
            "pin_memory and the data-wait fraction need the agent: start the training with "
            "`dlmon run -- python train.py ...`."
        )
    if s.memory.pss_missing:
        notes.append(f"{s.memory.pss_missing} processes had no PSS reading yet: the totals are low.")
    if not workers and nw:
        notes.append("No worker is alive right now: per-worker memory could not be measured.")

    findings = tuple(_finding(c) for c in _safe_detect(history, n_cores))
    return Advice(
        pid=s.target.pid,
        cmdline=s.target.cmdline,
        duration_s=round(span, 2),
        snapshots=len(history),
        cores=n_cores,
        has_agent=has_agent,
        loader=loader.name if loader else None,
        num_workers=nw if (loader is not None or workers) else None,
        batch_size=batch,
        prefetch_factor=prefetch,
        pin_memory=loader.pin_memory if loader else None,
        persistent_workers=loader.persistent_workers if loader else None,
        data_wait_fraction=wait,
        workers_alive=len(workers),
        worker_uss_median_bytes=uss_median,
        worker_uss_max_bytes=uss_max,
        pss_total_bytes=s.memory.pss_sum_bytes,
        measured_peak_bytes=measured_peak,
        headroom_bytes=room.bytes if room else None,
        headroom_source=room.source if room else None,
        limit_bytes=room.limit_bytes if room else None,
        estimate=estimate,
        max_workers_by_memory=by_memory,
        recommended_num_workers=recommended,
        lines=tuple(lines),
        findings=findings,
        notes=tuple(notes),
        ranks=ranks,
    )


def _safe_detect(history: Sequence[Snapshot], cores: int) -> list[Candidate]:
    return detect(history, cores=cores)


def _finding(c: Candidate) -> str:
    return f"{c.severity} {c.kind} {c.subject}: {c.message}"


def advice_to_dict(advice: Advice) -> dict[str, Any]:
    """A JSON-able dict (``json.dumps`` works on it as is)."""
    return dataclasses.asdict(advice)


def format_advice(advice: Advice) -> str:
    """Plain text, one fact or piece of advice per line."""
    out = [f"dlmon advise: pid {advice.pid} ({advice.cmdline})"]
    out.append(f"  sampled {advice.snapshots} times over {duration(advice.duration_s)}; {advice.cores} cores")
    if advice.loader:
        out.append(
            f"  loader {advice.loader}: num_workers={advice.num_workers} batch_size={advice.batch_size} "
            f"prefetch_factor={advice.prefetch_factor} pin_memory={advice.pin_memory} "
            f"persistent_workers={advice.persistent_workers}"
            + ("" if advice.data_wait_fraction is None else f", data wait {advice.data_wait_fraction:.0%}")
        )
    out.append(
        f"  memory: job PSS {size(advice.pss_total_bytes)} (peak {size(advice.measured_peak_bytes)}), "
        f"{advice.workers_alive} workers at {size(advice.worker_uss_median_bytes)} USS each (max "
        f"{size(advice.worker_uss_max_bytes)}), headroom {size(advice.headroom_bytes)}"
        + (f" under the {advice.headroom_source} limit" if advice.headroom_source else "")
    )
    if advice.estimate is not None:
        e = advice.estimate
        err = "" if e.error_fraction is None else f" ({e.error_fraction:+.0%})"
        out.append(
            f"  peak estimate: ({e.num_workers} + 1) x {e.batch_size} x {size(e.sample_bytes)} = "
            f"{size(e.predicted_peak_bytes)} predicted vs {size(e.measured_peak_bytes)} measured{err}"
        )
        out.append(f"    sample memory = {e.sample_bytes_method}")
    if advice.recommended_num_workers is not None:
        out.append(
            f"  largest safe num_workers: {advice.recommended_num_workers} "
            f"(memory allows {advice.max_workers_by_memory}, "
            + (
                f"cores - 1 = {max(0, advice.cores - 1)})"
                if advice.ranks == 1
                else f"{advice.cores} cores / {advice.ranks} ranks - 1 = "
                f"{max(0, advice.cores // advice.ranks - 1)} per rank)"
            )
        )
    if advice.lines:
        out.append("advice:")
        for line in advice.lines:
            out.append(f"  - [{line.topic}] {line.text}")
            out.append(f"      because: {line.because}")
    if advice.findings:
        out.append("findings:")
        out.extend(f"  - {f}" for f in advice.findings)
    if advice.notes:
        out.append("notes:")
        out.extend(f"  - {n}" for n in advice.notes)
    return "\n".join(out)
