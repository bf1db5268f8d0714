"""vram_pressure: a GPU near full, or torch's caching allocator holding far more than it uses."""

from __future__ import annotations

from dataclasses import dataclass

from dlmon.analysis.detectors._base import GIB, Candidate, Context, size
from dlmon.analysis.job_gpus import job_tensor_gpus
from dlmon.analysis.severity import CRITICAL, WARNING
from dlmon.model import GpuDevice, Snapshot

VRAM_PRESSURE = "vram_pressure"


@dataclass(frozen=True, slots=True)
class GpuNumbers:
    """vram_pressure's numbers (docs/detectors.md)."""

    vram_used_fraction: float = 0.95
    vram_hold_used_fraction: float = 0.92
    vram_critical_used_fraction: float = 0.98
    vram_fragmentation_ratio: float = 1.5  # reserved / allocated
    vram_fragmentation_bytes: float = 1.0 * GIB  # and reserved - allocated at least this


def _jobs_gpus(s: Snapshot) -> set[str]:
    """The GPUs this job uses (by ``GpuDevice.key``): NVML lists one of its processes there, or
    its torch has memory there (the agent's figures are matched to devices by UUID); where the
    agent gives torch's figures, only the GPUs where torch holds memory (a listed process with
    nothing of torch's there has only a CUDA context, such as DataLoader's pinning thread makes
    in a CPU-only job: it cannot run out of memory on that GPU). When neither
    tells (in a container NVML's pids are the host's and dlmon counts them instead; no agent),
    the GPUs are judged except those whose every listed process is certainly a colleague's (none
    of the job's processes holds the GPU's device node). A card in MIG mode is never judged: its
    MIG devices are, each against its own memory (a 1g.18gb slice full is an out-of-memory error
    whatever the card's total)."""
    used = {g.key for g in job_tensor_gpus(s) if not g.is_mig_parent}
    return used or {g.key for g in s.gpus if not g.processes and not g.is_mig_parent and not _others_only(g)}


def _others_only(g: GpuDevice) -> bool:
    """In a container: every process NVML lists on ``g`` is certainly not the job's (none of
    the job's processes holds its device node open): a colleague's GPU."""
    return bool(g.unattributed_processes) and g.other_processes == g.unattributed_processes


def detect_vram_pressure(ctx: Context) -> list[Candidate]:
    """Only GPUs this job uses: a colleague's full GPU on the same machine is not this job's
    problem (it shows on the GPU panel)."""
    cfg = ctx.numbers(GpuNumbers)
    out: list[Candidate] = []
    mine = _jobs_gpus(ctx.latest)
    for gpu in ctx.latest.gpus:
        if gpu.key not in mine or gpu.stale_age_s is not None:  # NVML did not answer: no new figure
            continue
        name = f"GPU {gpu.key}" + (f" ({gpu.name})" if gpu.name else "")
        used, total = gpu.memory_used_bytes, gpu.memory_total_bytes
        if used is not None and total:
            key = f"gpu:{gpu.key}"
            fraction = used / total
            threshold = (
                cfg.vram_hold_used_fraction if ctx.is_active(VRAM_PRESSURE, key) else cfg.vram_used_fraction
            )
            if fraction >= threshold:
                out.append(
                    Candidate(
                        VRAM_PRESSURE,
                        key,
                        CRITICAL if fraction >= cfg.vram_critical_used_fraction else WARNING,
                        f"GPU {gpu.key}",
                        f"{name} memory is {fraction:.0%} full ({size(used)} of {size(total)}); the next "
                        "larger batch or activation spike is a CUDA out-of-memory error.",
                        "Use gradient accumulation (batch 32 x 4 steps trains like batch 128; the seed "
                        "measured ResNet50 at 18 -> 5 GB for ~15% more time), mixed precision "
                        "(torch.autocast), or activation checkpointing; VRAM is parameters + "
                        "gradients + optimizer state + activations (linear in batch) + the CUDA context.",
                        {
                            "used_bytes": used,
                            "total_bytes": total,
                            "used_fraction": round(fraction, 4),
                            "torch_allocated_bytes": gpu.torch_allocated_bytes,
                            "torch_reserved_bytes": gpu.torch_reserved_bytes,
                            "torch_peak_allocated_bytes": gpu.torch_peak_allocated_bytes,
                        },
                    )
                )
        # fragmentation: reserved against the *peak* allocated (what the step really needs at its
        # high point); the allocated figure is a random point of the step, low between steps
        reserved = gpu.torch_reserved_bytes
        allocated = gpu.torch_peak_allocated_bytes or gpu.torch_allocated_bytes
        if reserved is not None and allocated is not None:
            key = f"gpu:{gpu.key}:allocator"
            held = ctx.is_active(VRAM_PRESSURE, key)
            factor = 0.8 if held else 1.0
            slack = reserved - allocated
            if (
                reserved >= cfg.vram_fragmentation_ratio * factor * max(allocated, 1)
                and slack >= cfg.vram_fragmentation_bytes * factor
            ):
                out.append(
                    Candidate(
                        VRAM_PRESSURE,
                        key,
                        WARNING,
                        f"GPU {gpu.key} allocator",
                        f"torch on {name} has reserved {size(reserved)} but uses at most {size(allocated)}: "
                        f"{size(slack)} sits in the caching allocator's free blocks (fragmentation).",
                        "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, avoid varying tensor "
                        "shapes between steps (pad or bucket batch sizes); torch.cuda.empty_cache() "
                        "only returns memory to other processes.",
                        {
                            "torch_reserved_bytes": reserved,
                            "torch_allocated_bytes": gpu.torch_allocated_bytes,
                            "torch_peak_allocated_bytes": gpu.torch_peak_allocated_bytes,
                            "slack_bytes": slack,
                            "total_bytes": total,
                        },
                    )
                )
    return out
