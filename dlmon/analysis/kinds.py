"""Alert kinds and severities, exactly as they appear in JSON (``Alert.kind``, ``Alert.severity``)."""

from __future__ import annotations

MEMORY_GROWTH = "memory_growth"
ZOMBIE_WORKER = "zombie_worker"
ORPHAN_WORKER = "orphan_worker"
WORKER_DIED = "worker_died"
LEAKED_WORKERS = "leaked_workers"
IO_SATURATION = "io_saturation"
INPUT_BOUND = "input_bound"
SHM_EXHAUSTION = "shm_exhaustion"
OVERSUBSCRIPTION = "oversubscription"
VRAM_PRESSURE = "vram_pressure"
SWAP_ACTIVITY = "swap_activity"
TRAINER_DIED = "trainer_died"
STALL = "stall"
FD_EXHAUSTION = "fd_exhaustion"
EXCEPTION_DEATH = "exception_death"
STRAGGLER = "straggler"
CUDA_IN_WORKER = "cuda_in_worker"

KINDS: tuple[str, ...] = (
    MEMORY_GROWTH,
    ZOMBIE_WORKER,
    ORPHAN_WORKER,
    WORKER_DIED,
    LEAKED_WORKERS,
    IO_SATURATION,
    INPUT_BOUND,
    SHM_EXHAUSTION,
    OVERSUBSCRIPTION,
    VRAM_PRESSURE,
    SWAP_ACTIVITY,
    TRAINER_DIED,
    STALL,
    FD_EXHAUSTION,
    EXCEPTION_DEATH,
    STRAGGLER,
    CUDA_IN_WORKER,
)

INFO = "info"
WARNING = "warning"
CRITICAL = "critical"
SEVERITIES: tuple[str, ...] = (INFO, WARNING, CRITICAL)
SEVERITY_RANK: dict[str, int] = {INFO: 0, WARNING: 1, CRITICAL: 2}
