"""cuda_in_worker: DataLoader workers that hold VRAM, a CUDA context each.

A worker has no business with CUDA: the trainer moves each batch to the GPU. A worker forked after
the trainer started CUDA dies if it touches CUDA ("Cannot re-initialize CUDA in forked subprocess":
exception_death names it); a spawn or forkserver worker that does (or one forked before the trainer
started CUDA) starts CUDA for itself and holds a context of hundreds of MiB, on GPU 0 unless it
chose a device, whatever GPU the trainer uses. NVML lists such a worker among a GPU's processes
(``ProcessSample.gpu_memory_bytes``, summed over the GPUs listing it).

Only live workers attached to the trainer are judged (an orphan holding VRAM is orphan_worker's);
one alert per trainer, naming each worker with its VRAM. The trainer's own VRAM, and a worker
that NVML does not list, say nothing.
"""

from __future__ import annotations

from dlmon.analysis.detectors._base import Candidate, Context, pid_list, size
from dlmon.analysis.severity import WARNING
from dlmon.model import ProcessSample, Snapshot

CUDA_IN_WORKER = "cuda_in_worker"

SHOWN_WORKERS = 4  # named one by one in the message; the rest are counted


def _gpus_of(s: Snapshot, pid: int) -> list[str]:
    """The GPUs whose current list has ``pid`` (a stale one's old list is left out, as it is of
    the worker's VRAM figure)."""
    return [g.key for g in s.gpus if g.stale_age_s is None and any(p.pid == pid for p in g.processes)]


def _name(p: ProcessSample) -> str:
    return f"worker {p.worker_id} (pid {p.pid})" if p.worker_id is not None else f"worker (pid {p.pid})"


def detect_cuda_in_worker(ctx: Context) -> list[Candidate]:
    s = ctx.latest
    holding = [p for p in ctx.tree().workers() if p.gpu_memory_bytes]
    if not holding:
        return []
    by_trainer: dict[int | None, list[ProcessSample]] = {}
    for p in holding:
        by_trainer.setdefault(p.ppid, []).append(p)
    out: list[Candidate] = []
    for ppid, workers in by_trainer.items():
        workers.sort(key=lambda p: (p.worker_id is None, p.worker_id or 0, p.pid))
        total = sum(p.gpu_memory_bytes or 0 for p in workers)
        gpus = sorted({key for p in workers for key in _gpus_of(s, p.pid)})
        parts = [
            f"{_name(p)} {size(p.gpu_memory_bytes)} on GPU {', '.join(_gpus_of(s, p.pid)) or '?'}"
            for p in workers[:SHOWN_WORKERS]
        ]
        if len(workers) > SHOWN_WORKERS:
            parts.append(f"{len(workers) - SHOWN_WORKERS} more")
        count = f"{len(workers)} DataLoader worker{'s' if len(workers) != 1 else ''}"
        of = f" of the trainer (pid {ppid})" if ppid is not None else ""
        message = (
            f"{count}{of} hold{'s' if len(workers) == 1 else ''} VRAM, {size(total)} in all: "
            + "; ".join(parts)
            + ". A worker that touches CUDA (in the Dataset, collate_fn or worker_init_fn) starts a CUDA "
            "context of its own."
        )
        advice = (
            "Keep CUDA out of the Dataset, collate_fn and worker_init_fn: return CPU tensors and move the "
            "batch to the GPU in the training loop (pin_memory=True and .to(device, non_blocking=True) keep "
            "the copy fast). Each worker's context costs hundreds of MiB, on GPU 0 unless it picks a "
            "device; if a worker must use CUDA, have it call torch.cuda.set_device(...) for the trainer's "
            "GPU first."
        )
        evidence: dict[str, float | int | str | None] = {
            "workers": len(workers),
            "vram_bytes": total,
            "gpus": ",".join(gpus),
            "pids": pid_list([p.pid for p in workers]),
            "trainer_pid": ppid,
        }
        subject = f"workers of pid {ppid}" if ppid is not None else "workers"
        out.append(
            Candidate(CUDA_IN_WORKER, f"cuda_in_worker:{ppid}", WARNING, subject, message, advice, evidence)
        )
    return out
