"""Every alert kind in one place: its detector, its hold and the special cases others ask it about.

The analyzer, the exit verdict and the report's diff read :data:`SPECS` (or a mapping derived
from it); none of them names a kind. A new kind is its detector module (its name, its detector,
its numbers) and one :class:`KindSpec` line here; ``dlmon.analysis.kinds.KINDS`` is this order
(tests/unit/analysis/test_kind_specs.py checks that every detector and every numbers class of the package is
in a line here, and that every kind has a section in docs/detectors.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dlmon.analysis.detectors._base import Candidate, Context, Evidence, States
from dlmon.analysis.detectors.cuda_worker import CUDA_IN_WORKER, detect_cuda_in_worker
from dlmon.analysis.detectors.exceptions import EXCEPTION_DEATH, detect_exception_death
from dlmon.analysis.detectors.fds import FD_EXHAUSTION, FdNumbers, detect_fd_exhaustion
from dlmon.analysis.detectors.gpu import VRAM_PRESSURE, GpuNumbers, detect_vram_pressure
from dlmon.analysis.detectors.io import IO_SATURATION, IoNumbers, detect_io_saturation
from dlmon.analysis.detectors.loader import (
    INPUT_BOUND,
    OVERSUBSCRIPTION,
    SHM_EXHAUSTION,
    LoaderNumbers,
    detect_input_bound,
    detect_oversubscription,
    detect_shm_exhaustion,
)
from dlmon.analysis.detectors.memory import (
    MEMORY_GROWTH,
    SWAP_ACTIVITY,
    MemoryNumbers,
    MemoryState,
    detect_memory_growth,
    detect_swap_activity,
)
from dlmon.analysis.detectors.processes import (
    LEAKED_WORKERS,
    ORPHAN_WORKER,
    TRAINER_DIED,
    WORKER_DIED,
    ZOMBIE_WORKER,
    ProcessNumbers,
    ProcessState,
    detect_leaked_workers,
    detect_orphan_worker,
    detect_trainer_died,
    detect_worker_died,
    detect_zombie_worker,
)
from dlmon.analysis.detectors.stall import (
    STALL,
    StallNumbers,
    StallState,
    detect_stall,
    quiet_input_bound,
    stall_resumed,
)
from dlmon.analysis.detectors.straggler import STRAGGLER, detect_straggler

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
    """A raised alert whose condition is provably over (``over(states, evidence, absent_since)``,
    reading its detector's state) clears after ``clear_after_s`` instead of its hold's, and is not
    kept at the exit."""

    over: Callable[[States, Evidence, float], bool]
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
    # the frozen dataclass of numbers its detector reads (``ctx.numbers(...)``), defaults included;
    # kinds of one module may share one
    numbers: type | None = None
    # the class of its detector's memory across ticks (``ctx.state(...)``), made empty by the
    # Analyzer when a watch starts; kinds of one module may share one
    state: type | None = None


SPECS: tuple[KindSpec, ...] = (
    # the detector's windows already demand a sustained trend
    KindSpec(MEMORY_GROWTH, detect_memory_growth, Hold(0.0, 60.0), numbers=MemoryNumbers, state=MemoryState),
    # A worker being shut down at an epoch's end is a zombie until torch joins it, which takes
    # seconds on a loaded machine (the soak saw 2-5 s at load 15; torch waits up to 5 s per
    # worker): past that it is not being reaped.
    KindSpec(ZOMBIE_WORKER, detect_zombie_worker, Hold(6.0, 3.0), numbers=ProcessNumbers),
    # unambiguous; and a live source stops right after the exit
    KindSpec(ORPHAN_WORKER, detect_orphan_worker, Hold(0.0, 3.0), cause=5, numbers=ProcessNumbers),
    # an event: the detector keeps it for death_window_s
    KindSpec(
        WORKER_DIED,
        detect_worker_died,
        Hold(0.0, 0.0),
        cause=1,
        ending=True,
        numbers=ProcessNumbers,
        state=ProcessState,
    ),
    # epoch boundaries overlap old and new workers briefly
    KindSpec(LEAKED_WORKERS, detect_leaked_workers, Hold(20.0, 30.0), numbers=ProcessNumbers),
    KindSpec(IO_SATURATION, detect_io_saturation, Hold(5.0, 15.0), numbers=IoNumbers),
    KindSpec(INPUT_BOUND, detect_input_bound, Hold(5.0, 15.0), numbers=LoaderNumbers),
    # the next step is a Bus error: say it at once
    KindSpec(SHM_EXHAUSTION, detect_shm_exhaustion, Hold(0.0, 10.0), numbers=LoaderNumbers),
    KindSpec(OVERSUBSCRIPTION, detect_oversubscription, Hold(5.0, 20.0), numbers=LoaderNumbers),
    KindSpec(VRAM_PRESSURE, detect_vram_pressure, Hold(3.0, 15.0), numbers=GpuNumbers),
    KindSpec(SWAP_ACTIVITY, detect_swap_activity, Hold(0.0, 60.0), numbers=MemoryNumbers),
    # the last snapshots of a run: say it at once; a signal's death is the first cause (the
    # exception torch raises for a killed worker is its echo)
    KindSpec(
        TRAINER_DIED,
        detect_trainer_died,
        Hold(0.0, 0.0),
        cause=0,
        ending=True,
        numbers=ProcessNumbers,
        state=ProcessState,
    ),
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
        numbers=StallNumbers,
        state=StallState,
    ),
    # the detector demands a steady rise or a high share
    KindSpec(
        FD_EXHAUSTION, detect_fd_exhaustion, Hold(0.0, 15.0), cause=4, last_words=True, numbers=FdNumbers
    ),
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
# every detector's numbers class, once (what ``Thresholds`` holds)
NUMBERS: tuple[type, ...] = tuple(dict.fromkeys(s.numbers for s in SPECS if s.numbers is not None))
# every stateful detector's state class, once (what ``States`` holds)
STATES: tuple[type, ...] = tuple(dict.fromkeys(s.state for s in SPECS if s.state is not None))
