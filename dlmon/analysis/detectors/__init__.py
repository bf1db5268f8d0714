"""The detectors: pure functions from a :class:`Context` (recent snapshots + digest) to candidates.

``detect(history)`` runs them all over a plain sequence of snapshots; the Analyzer keeps the
context between ticks instead of rebuilding it, and adds hysteresis.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dlmon.analysis.detectors._base import (
    DEFAULT_THRESHOLDS,
    AlertKey,
    Candidate,
    Context,
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
from dlmon.analysis.detectors.memory import GrowthWindow, detect_memory_growth, detect_swap_activity
from dlmon.analysis.detectors.processes import (
    detect_leaked_workers,
    detect_orphan_worker,
    detect_trainer_died,
    detect_worker_died,
    detect_zombie_worker,
)
from dlmon.analysis.detectors.registry import DEFAULT_HOLDS, DETECTORS, SPECS, Detector, Hold, KindSpec
from dlmon.analysis.detectors.stall import detect_stall
from dlmon.analysis.detectors.straggler import detect_straggler
from dlmon.model import Snapshot


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
    "DEFAULT_HOLDS",
    "DEFAULT_THRESHOLDS",
    "DETECTORS",
    "SPECS",
    "AlertKey",
    "Candidate",
    "Context",
    "Detector",
    "GrowthWindow",
    "Headroom",
    "Hold",
    "JobTree",
    "KindSpec",
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
