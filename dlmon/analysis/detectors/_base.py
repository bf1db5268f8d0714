"""What every detector shares: the candidate it returns, the thresholds, the context it reads.

A detector is a pure function ``Context -> list[Candidate]``: the same context gives the same
candidates. It says what holds *now*; raising only after a condition has lasted, and clearing
only after it has been gone a while, is the Analyzer's job. ``Context.active`` tells a detector
which of its alerts are raised, so it can hold them with a looser threshold than it raises them
with (a gap between the two thresholds is what stops flapping around one).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

from dlmon.analysis.digest import Digest
from dlmon.analysis.recent import RecentIndex
from dlmon.model import ProcessSample, Snapshot
from dlmon.model.format import DEAD_STATES, human_bytes

Evidence = Mapping[str, float | int | str | None]
AlertKey = tuple[str, str]  # (kind, key)

MIB = 1024 * 1024
GIB = 1024 * MIB
_EMPTY: Evidence = MappingProxyType({})
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A detector's verdict for this tick. ``key`` identifies the condition within its kind
    (``"job"``, ``"disk:vda"``, ``"pid:1234:5678"``); the subject must be as stable as the key."""

    kind: str
    key: str
    severity: str
    subject: str
    message: str
    advice: str
    evidence: Evidence = field(default_factory=lambda: _EMPTY)


class Thresholds:
    """Every number the detectors decide with (documented in docs/detectors.md).

    Each detector module keeps its own numbers in a frozen dataclass with their defaults
    (``StallNumbers`` in stall.py, ...), named by its kinds' ``KindSpec(numbers=...)``; a detector
    reads them with ``ctx.numbers(StallNumbers)``, so mypy knows every field it reads. A
    Thresholds holds the ones a run sets otherwise: ``Thresholds(StallNumbers(stall_critical_s=60))``;
    the others are their class's defaults. Reading a number by its name alone
    (``DEFAULT_THRESHOLDS.stall_rule``) still works, outside the type checker's sight.
    """

    __slots__ = ("_given",)

    def __init__(self, *numbers: object) -> None:
        for n in numbers:
            _declared(type(n))
        self._given: Mapping[type, object] = MappingProxyType({type(n): n for n in numbers})

    def of(self, numbers: type[T]) -> T:
        """The numbers of this class: the ones given, else its defaults."""
        given = self._given.get(numbers)
        return given if isinstance(given, numbers) else _defaults(numbers)

    def replace(self, *numbers: object) -> Thresholds:
        """These numbers instead of the ones of their class given so far."""
        return Thresholds(*self._given.values(), *numbers)

    def _numbers(self) -> tuple[object, ...]:
        """Every kind's numbers as this run decides with them: what equality and hash compare."""
        return tuple(self.of(numbers) for numbers in _declared_numbers())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Thresholds) and self._numbers() == other._numbers()

    def __hash__(self) -> int:
        return hash(self._numbers())

    def __reduce__(self) -> tuple[type[Thresholds], tuple[object, ...]]:
        return Thresholds, tuple(self._given.values())  # pickle and copy: the mapping proxy cannot

    def __repr__(self) -> str:
        return f"Thresholds({', '.join(repr(n) for n in self._given.values())})"

    if not TYPE_CHECKING:  # code reads ctx.numbers(X).field, which mypy checks; this is for people

        def __getattr__(self, name: str) -> object:
            if not name.startswith("_"):
                for numbers in _declared_numbers():
                    if name in {f.name for f in fields(numbers)}:
                        return getattr(self.of(numbers), name)
            raise AttributeError(f"no detector has a number called {name!r}")


class States:
    """Each stateful detector's memory across ticks: one object of each class a registry line names
    (``KindSpec(state=...)``), empty when the watch starts. The Analyzer owns one ``States`` (a new
    target or a replay started over gets a new one); a detector reaches its own object with
    ``ctx.state(StallState)``, typed, and nothing else of the analysis writes there."""

    __slots__ = ("_by_type",)

    def __init__(self) -> None:
        self._by_type: dict[type, object] = {cls: cls() for cls in _declared_states()}

    def of(self, state: type[T]) -> T:
        found = self._by_type.get(state)
        if not isinstance(found, state):
            raise LookupError(
                f"{state.__qualname__} is no kind's state: name it in its registry line (KindSpec(state=...))"
            )
        return found


def _declared_states() -> tuple[type, ...]:
    from dlmon.analysis.detectors.registry import STATES  # the registry imports every detector

    return STATES


_DEFAULTS: dict[type, object] = {}


def _declared_numbers() -> tuple[type, ...]:
    from dlmon.analysis.detectors.registry import NUMBERS  # the registry imports every detector

    return NUMBERS


def _declared(numbers: type) -> None:
    if numbers not in _declared_numbers():
        raise LookupError(
            f"{numbers.__qualname__} are no kind's numbers: "
            "name them in its registry line (KindSpec(numbers=...))"
        )


def _defaults(numbers: type[T]) -> T:
    found = _DEFAULTS.get(numbers)
    if isinstance(found, numbers):
        return found
    _declared(numbers)
    made = numbers()
    _DEFAULTS[numbers] = made
    return made


DEFAULT_THRESHOLDS = Thresholds()


class Context:
    """What a detector reads: the recent snapshots at full rate, the long digest, the machine.

    ``recent`` is oldest first and never empty; ``recent[-1]`` is now. Derived views of the
    latest snapshot (the job's tree) are computed once per context and shared by detectors.
    ``index``: the Analyzer's incremental views of exactly these snapshots (``RecentIndex``);
    without it (a context built from a list) the detectors scan ``recent``, with the same result.
    """

    __slots__ = ("_memo", "_times", "active", "config", "cores", "digest", "index", "recent", "states")

    def __init__(
        self,
        recent: Sequence[Snapshot],
        digest: Digest,
        cores: int,
        config: Thresholds = DEFAULT_THRESHOLDS,
        active: Iterable[AlertKey] = (),
        index: RecentIndex | None = None,
        states: States | None = None,
    ) -> None:
        if not recent:
            raise ValueError("a context needs at least one snapshot")
        if index is not None and len(index) != len(recent):
            raise ValueError("the index is of other snapshots")
        self.recent = recent
        self.index = index
        self.digest = digest
        self.cores = max(1, cores)
        self.config = config
        self.active = frozenset(active)
        # the detectors' memory across ticks (the Analyzer's); a context of its own starts empty
        self.states = states if states is not None else States()
        self._times: list[float] | None = None
        self._memo: dict[str, object] = {}

    @classmethod
    def from_history(
        cls,
        history: Sequence[Snapshot],
        *,
        cores: int = 2,
        config: Thresholds = DEFAULT_THRESHOLDS,
        active: Iterable[AlertKey] = (),
        recent_s: float = 120.0,
    ) -> Context:
        """A context over a whole history, as the Analyzer would have built it at its end."""
        if not history:
            raise ValueError("empty history")
        end = history[-1].time
        recent = [s for s in history if s.time >= end - recent_s]
        return cls(recent, Digest.from_history(history), cores, config, active)

    @property
    def latest(self) -> Snapshot:
        return self.recent[-1]

    @property
    def now(self) -> float:
        return self.recent[-1].time

    def window(self, seconds: float) -> Sequence[Snapshot]:
        """The recent snapshots no older than ``seconds`` before now (at least the latest)."""
        return self.recent[self.window_start(seconds) :]

    def window_start(self, seconds: float) -> int:
        """The index in ``recent`` at which ``window(seconds)`` starts."""
        if self.index is not None:
            start = self.index.start(self.now - seconds)
        else:
            if self._times is None:
                self._times = [s.time for s in self.recent]
            start = bisect.bisect_left(self._times, self.now - seconds)
        return min(start, len(self.recent) - 1)

    def per_snapshot(self, seconds: float, key: Hashable, compute: Callable[[Snapshot], T]) -> list[T]:
        """``[compute(s) for s in window(seconds)]``; with the index each snapshot's value is
        computed once (``key`` names what ``compute`` reads besides the snapshot), so a tick
        gathers the window's values instead of recomputing them."""
        start = self.window_start(seconds)
        if self.index is not None:
            return self.index.memoized(start, key, compute)
        return [compute(s) for s in self.recent[start:]]

    def numbers(self, numbers: type[T]) -> T:
        """A detector's numbers (its module's frozen dataclass), as this run sets them."""
        return self.config.of(numbers)

    def state(self, state: type[T]) -> T:
        """A stateful detector's own memory across ticks (its module's class, ``KindSpec(state=)``)."""
        return self.states.of(state)

    def is_active(self, kind: str, key: str) -> bool:
        return (kind, key) in self.active

    def cached(self, name: str, compute: Callable[[], T]) -> T:
        """``compute()`` once per context: views of this tick several detectors share (the job's
        tree, the disks' loads). Nothing here outlives the tick: that is ``state``."""
        if name not in self._memo:
            self._memo[name] = compute()
        return self._memo[name]  # type: ignore[return-value]

    def tree(self) -> JobTree:
        """The job's tree in the latest snapshot."""
        return self.cached("tree", lambda: JobTree.of(self.latest))


@dataclass(frozen=True, slots=True)
class JobTree:
    """The latest snapshot's processes split into attached to the trainer, orphaned, zombies."""

    main: ProcessSample | None
    attached: tuple[ProcessSample, ...]  # live and connected to the live main by ppid
    orphans: tuple[ProcessSample, ...]  # live workers (and their descendants) cut off from it
    zombies: tuple[ProcessSample, ...]

    @classmethod
    def of(cls, s: Snapshot) -> JobTree:
        main: ProcessSample | None = None
        live: list[ProcessSample] = []
        zombies: list[ProcessSample] = []
        for p in s.processes:
            if p.role == "main":
                main = p
            if p.state in DEAD_STATES:
                if p.role != "main":
                    zombies.append(p)
            else:
                live.append(p)
        attached: set[int] = set()
        if s.target.alive and main is not None and main.state not in DEAD_STATES:
            attached.add(main.pid)
            pending = [p for p in live if p.pid != main.pid]
            while pending:  # a pass per tree level: two passes for a trainer and its workers
                rest = [p for p in pending if p.ppid not in attached]
                if len(rest) == len(pending):
                    break
                attached.update(p.pid for p in pending if p.ppid in attached)
                pending = rest
        orphaned = {p.pid for p in live if p.role == "worker" and p.pid not in attached}
        if orphaned:
            pending = [p for p in live if p.pid not in attached and p.pid not in orphaned]
            while pending:  # descendants of orphaned workers are orphans too
                rest = [p for p in pending if p.ppid not in orphaned]
                if len(rest) == len(pending):
                    break
                orphaned.update(p.pid for p in pending if p.ppid in orphaned)
                pending = rest
        return cls(
            main=main,
            attached=tuple(p for p in live if p.pid in attached),
            orphans=tuple(p for p in live if p.pid in orphaned),
            zombies=tuple(zombies),
        )

    def workers(self) -> list[ProcessSample]:
        return [p for p in self.attached if p.role == "worker"]


# -- plain-text figures ----------------------------------------------------------------------


def size(value: float | None) -> str:
    return human_bytes(value, missing="unknown")


def per_min(bytes_per_s: float) -> str:
    return f"{bytes_per_s * 60 / MIB:.1f} MiB/min"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 9.95:  # a batch every 0.5 s is not "every 0 s"
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def pid_list(pids: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(p) for p in pids[:limit])
    return shown + (f" and {len(pids) - limit} more" if len(pids) > limit else "")


def sum_known(values: Iterable[int | float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(sum(known)) if known else None


@dataclass(frozen=True, slots=True)
class Headroom:
    """How much more the job can take before something kills it, and what kills it."""

    bytes: int
    source: str  # "cgroup" (limit - usage) or "machine" (MemAvailable)
    limit_bytes: int | None  # the cgroup limit, or MemTotal


def cgroup_working_set(s: Snapshot) -> int | None:
    """The cgroup's usage without its inactive page cache (what the kernel cannot just drop);
    the raw usage from records that predate the working set."""
    cg = s.cgroup
    if cg is not None:
        return cg.working_set_bytes if cg.working_set_bytes is not None else cg.current_bytes
    m = s.memory
    return m.cgroup_working_set_bytes if m.cgroup_working_set_bytes is not None else m.cgroup_current_bytes


def headroom(s: Snapshot) -> Headroom | None:
    """min(MemAvailable, cgroup limit - cgroup working set): the limit that will actually kill
    the job. Page cache is not counted: the kernel reclaims it before any OOM kill."""
    options: list[Headroom] = []
    m = s.memory
    if m.available_bytes is not None:
        options.append(Headroom(max(0, m.available_bytes), "machine", m.total_bytes))
    limit = s.cgroup.limit_bytes if s.cgroup is not None else m.cgroup_limit_bytes
    current = cgroup_working_set(s)
    if limit is not None and current is not None:
        options.append(Headroom(max(0, limit - current), "cgroup", limit))
    return min(options, key=lambda h: h.bytes) if options else None


def describe_headroom(h: Headroom) -> str:
    if h.source == "cgroup":
        return f"the cgroup limit ({size(h.limit_bytes)}, {size(h.bytes)} left)"
    return f"the machine's available memory ({size(h.bytes)} left)"
