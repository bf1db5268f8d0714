"""Alert kinds and severities, exactly as they appear in JSON (``Alert.kind``, ``Alert.severity``).

A kind's name lives in its detector module and its place in ``detectors/registry.py``; ``KINDS``
is the registry's order. The names below are re-exported for the code that names a kind (the
UI's stall column, the detail screen): a new kind needs no line here.
"""

from __future__ import annotations

from dlmon.analysis.detectors.exceptions import EXCEPTION_DEATH
from dlmon.analysis.detectors.fds import FD_EXHAUSTION
from dlmon.analysis.detectors.gpu import VRAM_PRESSURE
from dlmon.analysis.detectors.io import IO_SATURATION
from dlmon.analysis.detectors.loader import INPUT_BOUND, OVERSUBSCRIPTION, SHM_EXHAUSTION
from dlmon.analysis.detectors.memory import MEMORY_GROWTH, SWAP_ACTIVITY
from dlmon.analysis.detectors.processes import (
    LEAKED_WORKERS,
    ORPHAN_WORKER,
    TRAINER_DIED,
    WORKER_DIED,
    ZOMBIE_WORKER,
)
from dlmon.analysis.detectors.registry import SPECS
from dlmon.analysis.detectors.stall import STALL
from dlmon.analysis.detectors.straggler import STRAGGLER
from dlmon.analysis.severity import CRITICAL, INFO, SEVERITIES, SEVERITY_RANK, WARNING

KINDS: tuple[str, ...] = tuple(s.name for s in SPECS)

__all__ = [
    "CRITICAL",
    "EXCEPTION_DEATH",
    "FD_EXHAUSTION",
    "INFO",
    "INPUT_BOUND",
    "IO_SATURATION",
    "KINDS",
    "LEAKED_WORKERS",
    "MEMORY_GROWTH",
    "ORPHAN_WORKER",
    "OVERSUBSCRIPTION",
    "SEVERITIES",
    "SEVERITY_RANK",
    "SHM_EXHAUSTION",
    "STALL",
    "STRAGGLER",
    "SWAP_ACTIVITY",
    "TRAINER_DIED",
    "VRAM_PRESSURE",
    "WARNING",
    "WORKER_DIED",
    "ZOMBIE_WORKER",
]
