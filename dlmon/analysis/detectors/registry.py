"""Every alert kind in one place: its detector, its hold and the special cases others ask it about.

The analyzer, the exit verdict and the report's diff read :data:`SPECS` (or a mapping derived
from it); none of them names a kind. A new kind is its detector module, its name in
``dlmon.analysis.kinds`` and one :class:`KindSpec` line here (tests/test_kind_specs.py checks that
every kind has one, with a callable detector, and a section in docs/detectors.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dlmon.analysis.detectors._base import Candidate, Context, Evidence
from dlmon.analysis.detectors.cuda_worker import detect_cuda_in_worker
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
from dlmon.analysis.detectors.stall import detect_stall, quiet_input_bound, stall_resumed
from dlmon.analysis.detectors.straggler import detect_straggler
from dlmon.analysis.digest import Digest
from dlmon.analysis.kinds import (
    CUDA_IN_WORKER,
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

Detector = Callable[[Context], list[Candidate]]


@dataclass(frozen=True, slots=True)
class Hold:
    """How long a condition must last before it is raised, and be gone before it is cleared."""

    raise_after_s: float
    clear_after_s: float


@dataclass(frozen=True, slots=True)
class Silences:
    """Candidates of another kind this kind's reading of the tick drops (a hang is no "too few
    workers"): ``keys(ctx)`` are their keys, computed before any detector runs."""

    kind: str
    keys: Callable[[Context], frozenset[str]]


@dataclass(frozen=True, slots=True)
class Resumption:
    """A raised alert whose condition is provably over (``over(digest, evidence, absent_since)``)
    clears after ``clear_after_s`` instead of its hold's, and is not kept at the exit."""

    over: Callable[[Digest, Evidence, float], bool]
    clear_after_s: float


@dataclass(frozen=True, slots=True)
class KindSpec:
    """One alert kind: what finds it and how the analyzer, the verdict and the diff treat it."""

    name: str
    detector: Detector
    hold: Hold
    # its place among the causes the exit verdict names (0 first); None: never a cause
    cause: int | None = None
    # raised while the target lived, its detector goes quiet once the target is gone: kept to the end
    last_words: bool = False
    # says how the training ended: in a diff, a new cause of it counts as a new kind
    ending: bool = False
    silences: Silences | None = None
    resumption: Resumption | None = None


SPECS: tuple[KindSpec, ...] = (
    # the detector's windows already demand a sustained trend
    KindSpec(MEMORY_GROWTH, detect_memory_growth, Hold(0.0, 60.0)),
    # A worker being shut down at an epoch's end is a zombie until torch joins it, which takes
    # seconds on a loaded machine (the soak saw 2-5 s at load 15; torch waits up to 5 s per
    # worker): past that it is not being reaped.
    KindSpec(ZOMBIE_WORKER, detect_zombie_worker, Hold(6.0, 3.0)),
    # unambiguous; and a live source stops right after the exit
    KindSpec(ORPHAN_WORKER, detect_orphan_worker, Hold(0.0, 3.0), cause=5),
    # an event: the detector keeps it for death_window_s
    KindSpec(WORKER_DIED, detect_worker_died, Hold(0.0, 0.0), cause=1, ending=True),
    # epoch boundaries overlap old and new workers briefly
    KindSpec(LEAKED_WORKERS, detect_leaked_workers, Hold(20.0, 30.0)),
    KindSpec(IO_SATURATION, detect_io_saturation, Hold(5.0, 15.0)),
    KindSpec(INPUT_BOUND, detect_input_bound, Hold(5.0, 15.0)),
    # the next step is a Bus error: say it at once
    KindSpec(SHM_EXHAUSTION, detect_shm_exhaustion, Hold(0.0, 10.0)),
    KindSpec(OVERSUBSCRIPTION, detect_oversubscription, Hold(5.0, 20.0)),
    KindSpec(VRAM_PRESSURE, detect_vram_pressure, Hold(3.0, 15.0)),
    KindSpec(SWAP_ACTIVITY, detect_swap_activity, Hold(0.0, 60.0)),
    # the last snapshots of a run: say it at once; a signal's death is the first cause (the
    # exception torch raises for a killed worker is its echo)
    KindSpec(TRAINER_DIED, detect_trainer_died, Hold(0.0, 0.0), cause=0, ending=True),
    # raised: the detector already waited 20 usual intervals (10 s at least); cleared: a hang
    # ended with Ctrl-C leaves the loader at once but exits seconds later (torch waits 5 s for a
    # hung worker), and the exit verdict must still name the hang. One its loader (or its worker)
    # delivered again after is over, not a hang cut short by Ctrl-C: not kept for the long clear
    # hold (a stale "no batch for 30 s" on screen) nor at the exit.
    KindSpec(
        STALL,
        detect_stall,
        Hold(0.0, 15.0),
        cause=2,
        last_words=True,
        silences=Silences(INPUT_BOUND, quiet_input_bound),
        resumption=Resumption(stall_resumed, 3.0),
    ),
    # the detector demands a steady rise or a high share
    KindSpec(FD_EXHAUSTION, detect_fd_exhaustion, Hold(0.0, 15.0), cause=4, last_words=True),
    # judged on the ended training only: say it at once
    KindSpec(EXCEPTION_DEATH, detect_exception_death, Hold(0.0, 0.0), cause=3, ending=True),
    # as input_bound: the detector already averages over 10 s
    KindSpec(STRAGGLER, detect_straggler, Hold(5.0, 15.0)),
    # a context stays until the worker exits: a few seconds spare a worker caught mid-start
    KindSpec(CUDA_IN_WORKER, detect_cuda_in_worker, Hold(3.0, 15.0)),
)

SPEC_BY_KIND: Mapping[str, KindSpec] = MappingProxyType({s.name: s for s in SPECS})
DETECTORS: Mapping[str, Detector] = MappingProxyType({s.name: s.detector for s in SPECS})
DEFAULT_HOLDS: Mapping[str, Hold] = MappingProxyType({s.name: s.hold for s in SPECS})
# the exit verdict's causes, first first
CAUSE_ORDER: tuple[str, ...] = tuple(
    s.name for s in sorted((s for s in SPECS if s.cause is not None), key=lambda s: s.cause or 0)
)
ENDINGS: frozenset[str] = frozenset(s.name for s in SPECS if s.ending)
