"""The detectors: pure functions from a :class:`Context` (recent snapshots + digest) to candidates.

``detect(history)`` runs them all over a plain sequence of snapshots; the Analyzer keeps the
context between ticks instead of rebuilding it, and adds hysteresis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from dlmon.analysis.detectors._base import (
    DEFAULT_THRESHOLDS,
    AlertKey,
    Candidate,
    Context,
    GrowthWindow,
    Headroom,
    JobTree,
    Thresholds,
    headroom,
)
from dlmon.analysis.detectors.exceptions import detect_exception_death
from dlmon.analysis.detectors.fds import detect_fd_exhaustion
from dlmon.analysis.detectors.gpu import detect_vram_pressure
from dlmon.analysis.detectors.io import detect_io_saturation
from dlmon.analysis.detectors.loader import detect_input_bound, detect_oversubscription, detect_shm_exhaustion
from dlmon.analysis.detectors.memory import detect_memory_growth, detect_swap_activity
from dlmon.analysis.detectors.processes import (
    detect_leaked_workers,
    detect_orphan_worker,
    detect_trainer_died,
    detect_worker_died,
    detect_zombie_worker,
)
from dlmon.analysis.detectors.stall import detect_stall
from dlmon.analysis.detectors.straggler import detect_straggler
from dlmon.analysis.kinds import (
    EXCEPTION_DEATH,
    FD_EXHAUSTION,
    INPUT_BOUND,
    IO_SATURATION,
    LEAKED_WORKERS,
    MEMORY_GROWTH,
    ORPHAN_WORKER,
    OVERSUBSCRIPTION,
    SHM_EXHAUSTION,
    STALL,
    STRAGGLER,
    SWAP_ACTIVITY,
    TRAINER_DIED,
    VRAM_PRESSURE,
    WORKER_DIED,
    ZOMBIE_WORKER,
)
from dlmon.model import Snapshot

Detector = Callable[[Context], list[Candidate]]

DETECTORS: dict[str, Detector] = {
    MEMORY_GROWTH: detect_memory_growth,
    ZOMBIE_WORKER: detect_zombie_worker,
    ORPHAN_WORKER: detect_orphan_worker,
    WORKER_DIED: detect_worker_died,
    LEAKED_WORKERS: detect_leaked_workers,
    IO_SATURATION: detect_io_saturation,
    INPUT_BOUND: detect_input_bound,
    SHM_EXHAUSTION: detect_shm_exhaustion,
    OVERSUBSCRIPTION: detect_oversubscription,
    VRAM_PRESSURE: detect_vram_pressure,
    SWAP_ACTIVITY: detect_swap_activity,
    TRAINER_DIED: detect_trainer_died,
    STALL: detect_stall,
    FD_EXHAUSTION: detect_fd_exhaustion,
    EXCEPTION_DEATH: detect_exception_death,
    STRAGGLER: detect_straggler,
}


def detect(
    history: Sequence[Snapshot],
    *,
    cores: int = 2,
    config: Thresholds = DEFAULT_THRESHOLDS,
    active: Iterable[AlertKey] = (),
) -> list[Candidate]:
    """Every detector over ``history`` (oldest first), as of its last snapshot; no hysteresis."""
    ctx = Context.from_history(history, cores=cores, config=config, active=active)
    return [c for detector in DETECTORS.values() for c in detector(ctx)]


__all__ = [
    "DEFAULT_THRESHOLDS",
    "DETECTORS",
    "AlertKey",
    "Candidate",
    "Context",
    "Detector",
    "GrowthWindow",
    "Headroom",
    "JobTree",
    "Thresholds",
    "detect",
    "detect_exception_death",
    "detect_fd_exhaustion",
    "detect_input_bound",
    "detect_io_saturation",
    "detect_leaked_workers",
    "detect_memory_growth",
    "detect_orphan_worker",
    "detect_oversubscription",
    "detect_shm_exhaustion",
    "detect_stall",
    "detect_straggler",
    "detect_swap_activity",
    "detect_trainer_died",
    "detect_vram_pressure",
    "detect_worker_died",
    "detect_zombie_worker",
    "headroom",
]
