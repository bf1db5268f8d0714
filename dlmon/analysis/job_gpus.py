"""The GPUs a job uses: a figure or a piece of advice about "the job's GPUs" must not count a
colleague's card, or an idle one, on a shared GPU machine."""

from __future__ import annotations

from dlmon.model import GpuDevice, Snapshot
from dlmon.model.format import DEAD_STATES


def job_gpus(s: Snapshot) -> list[GpuDevice]:
    """The devices where NVML lists one of the job's live processes, or where the job's torch
    holds memory (the agent's figures, matched by UUID: they tell even where NVML's pids are a
    container's host pids). A card in MIG mode is never one: its MIG devices are."""
    pids = {p.pid for p in s.processes if p.state not in DEAD_STATES}
    return [
        g
        for g in s.gpus
        if not g.is_mig_parent
        and (
            any(gp.pid in pids for gp in g.processes)
            or bool(g.torch_reserved_bytes)
            or bool(g.torch_allocated_bytes)
        )
    ]


def job_vram_bytes(s: Snapshot) -> int | None:
    """The VRAM the job holds: NVML's figures for its processes, summed; where NVML gives none
    (a container's pids), torch's reserved memory on its GPUs (without the CUDA contexts); None
    when neither is known. Never the whole device's use, which counts every process on it."""
    known = [p.gpu_memory_bytes for p in s.processes if p.gpu_memory_bytes is not None]
    if known:
        return sum(known)
    reserved = [g.torch_reserved_bytes for g in job_gpus(s) if g.torch_reserved_bytes is not None]
    return sum(reserved) if reserved else None


def job_tensor_gpus(s: Snapshot) -> list[GpuDevice]:
    """The GPUs that hold the job's tensors. Where the agent gives torch's figures, those where
    torch holds memory, and those where NVML lists one of the job's processes without an agent
    (a worker, a non-Python child: torch's figures do not cover it). A process with an agent
    that NVML lists where torch holds nothing has only a CUDA context there, such as the one
    DataLoader's pinning thread makes on the current device of a CPU-only job (cudaHostAlloc
    needs a context). A card in MIG mode counts when torch's UUID named the card rather than a
    slice: it still says the job uses CUDA. Without torch's figures, :func:`job_gpus`."""
    if not any(g.torch_reserved_bytes is not None or g.torch_allocated_bytes is not None for g in s.gpus):
        return job_gpus(s)
    unaccounted = {p.pid for p in s.processes if p.state not in DEAD_STATES and p.torch_threads is None}
    return [
        g
        for g in s.gpus
        if g.torch_reserved_bytes
        or g.torch_allocated_bytes
        or (not g.is_mig_parent and any(gp.pid in unaccounted for gp in g.processes))
    ]


def process_gpu_busy(s: Snapshot, pid: int) -> tuple[tuple[str, float, bool], ...]:
    """(device key, busy %, whether it is the process's own) of each GPU where NVML lists
    process ``pid``, read this tick (a stale reading is no figure for this tick): the process's
    own SM utilisation where NVML gives it (a colleague's kernels on the same GPU do not count),
    never above the device's (NVML samples only the periods in which some process ran a kernel:
    a trainer alone on its GPU, running in bursts between waits, reads busy in its samples); else
    the device's, only where the process is alone on it (another process's kernels would read
    as its own). A card in MIG mode reports no utilisation."""
    out: list[tuple[str, float, bool]] = []
    for g in s.gpus:
        if g.stale_age_s is not None or g.is_mig_parent:
            continue
        mine = next((gp for gp in g.processes if gp.pid == pid), None)
        if mine is None:
            continue
        device = g.utilization_percent
        if mine.sm_percent is not None:
            own = mine.sm_percent if device is None else min(mine.sm_percent, device)
            out.append((g.key, own, True))
        elif device is not None and all(gp.pid == pid for gp in g.processes):
            out.append((g.key, device, False))
    return tuple(out)
