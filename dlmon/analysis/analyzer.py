"""The Analyzer: runs the detectors every tick and turns their candidates into stable alerts.

Hysteresis lives here and only here. A candidate becomes an alert once it has been present
continuously for its kind's ``raise_after_s``; a raised alert clears once its candidate has been
absent continuously for ``clear_after_s``. Detectors add a second gap of their own: they keep a
raised alert on a looser threshold than they raise it with (``Context.active``). ``since`` is the
time the alert was raised and survives message and severity changes.

It never raises: a failing detector contributes nothing that tick and ``errors`` counts it
(``strict=True`` re-raises instead, for tests). Memory stays bounded: full snapshots for
``recent_s`` seconds, and compact thinned series (``Digest``) for the long windows.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dlmon.analysis.detectors import DETECTORS, Candidate, Context, Detector, Thresholds
from dlmon.analysis.detectors._base import DEFAULT_THRESHOLDS, AlertKey
from dlmon.analysis.detectors.stall import quiet_input_bound
from dlmon.analysis.digest import Digest, DigestLimits
from dlmon.analysis.kinds import (
    EXCEPTION_DEATH,
    FD_EXHAUSTION,
    INPUT_BOUND,
    IO_SATURATION,
    LEAKED_WORKERS,
    MEMORY_GROWTH,
    ORPHAN_WORKER,
    OVERSUBSCRIPTION,
    SEVERITY_RANK,
    SHM_EXHAUSTION,
    STALL,
    STRAGGLER,
    SWAP_ACTIVITY,
    TRAINER_DIED,
    VRAM_PRESSURE,
    WORKER_DIED,
    ZOMBIE_WORKER,
)
from dlmon.model import Alert, Snapshot


@dataclass(frozen=True, slots=True)
class Hold:
    """How long a condition must last before it is raised, and be gone before it is cleared."""

    raise_after_s: float
    clear_after_s: float


DEFAULT_HOLDS: Mapping[str, Hold] = MappingProxyType(
    {
        MEMORY_GROWTH: Hold(0.0, 60.0),  # the detector's windows already demand a sustained trend
        # A worker being shut down at an epoch's end is a zombie until torch joins it, which takes
        # seconds on a loaded machine (the soak saw 2-5 s at load 15; torch waits up to 5 s per
        # worker): past that it is not being reaped.
        ZOMBIE_WORKER: Hold(6.0, 3.0),
        ORPHAN_WORKER: Hold(0.0, 3.0),  # unambiguous; and a live source stops right after the exit
        WORKER_DIED: Hold(0.0, 0.0),  # an event: the detector keeps it for death_window_s
        LEAKED_WORKERS: Hold(20.0, 30.0),  # epoch boundaries overlap old and new workers briefly
        IO_SATURATION: Hold(5.0, 15.0),
        INPUT_BOUND: Hold(5.0, 15.0),
        SHM_EXHAUSTION: Hold(0.0, 10.0),  # the next step is a Bus error: say it at once
        OVERSUBSCRIPTION: Hold(5.0, 20.0),
        VRAM_PRESSURE: Hold(3.0, 15.0),
        SWAP_ACTIVITY: Hold(0.0, 60.0),
        TRAINER_DIED: Hold(0.0, 0.0),  # the last snapshots of a run: say it at once
        # raised: the detector already waited 20 usual intervals (10 s at least); cleared: a hang
        # ended with Ctrl-C leaves the loader at once but exits seconds later (torch waits 5 s
        # for a hung worker), and the exit verdict must still name the hang
        STALL: Hold(0.0, 15.0),
        FD_EXHAUSTION: Hold(0.0, 15.0),  # the detector demands a steady rise or a high share
        EXCEPTION_DEATH: Hold(0.0, 0.0),  # judged on the ended training only: say it at once
        STRAGGLER: Hold(5.0, 15.0),  # as input_bound: the detector already averages over 10 s
    }
)
_DEFAULT_HOLD = Hold(3.0, 15.0)
# raised while the target lived, their detectors go quiet once it is gone (no process to read, no
# loader to wait on): kept to the end, they say why it ended (a hang killed, fds run out)
_LAST_WORDS = frozenset({STALL, FD_EXHAUSTION})
# a stall its loader (or its worker) delivered again after: over, not a hang cut short by Ctrl-C,
# so not kept for STALL's long clear hold (a stale "no batch for 30 s" on screen) nor at the exit
RESUMED_STALL_CLEAR_S = 3.0


@dataclass(slots=True)
class _Track:
    candidate: Candidate
    present_since: float
    subject: str  # the first candidate's: events() knows an alert by kind and subject
    raised_at: float | None = None
    absent_since: float | None = None


def _finite(value: float | int | str | None) -> float | int | str | None:
    """Evidence goes into JSON records, which allow no NaN or infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def default_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def target_cores(s: Snapshot, default: int) -> int:
    """The cores the target may use as the snapshot says (its affinity and CPU quota: a
    container's or a replayed machine's, not dlmon's), at least one; ``default`` without it."""
    return max(1, int(s.target_cores)) if s.target_cores else default


class Analyzer:
    """``Analyzer()(snapshot)`` returns the snapshot with ``alerts`` set. One per target."""

    def __init__(
        self,
        cores: int | None = None,
        *,
        thresholds: Thresholds = DEFAULT_THRESHOLDS,
        holds: Mapping[str, Hold] = DEFAULT_HOLDS,
        detectors: Mapping[str, Detector] = DETECTORS,
        recent_s: float = 120.0,
        max_recent: int = 1200,
        digest_limits: DigestLimits | None = None,
        strict: bool = False,
    ) -> None:
        self.cores = cores if cores is not None else default_cores()
        self._cores_given = cores is not None
        self.thresholds = thresholds
        self.holds = holds
        self.detectors = detectors
        self.recent_s = recent_s
        self.strict = strict
        self.errors = 0  # exceptions swallowed so far (a detector bug), never raised to the caller
        self.last_error: str | None = None
        self.ticks = 0
        self.cpu_s = 0.0  # thread CPU spent in __call__, for the cost figures
        self._limits = digest_limits or DigestLimits()
        self._max_recent = max_recent
        self._reset()

    def _reset(self) -> None:
        self._recent: deque[Snapshot] = deque(maxlen=self._max_recent)
        self.digest = Digest(self._limits)
        self._tracks: dict[AlertKey, _Track] = {}
        self._target: tuple[int, int | None] | None = None
        self._last_time: float | None = None
        self.alerts: tuple[Alert, ...] = ()

    # -- public --------------------------------------------------------------------------------

    def __call__(self, snapshot: Snapshot) -> Snapshot:
        start = time.thread_time()
        try:
            alerts = self._tick(snapshot)
        except Exception as exc:
            if self.strict:
                raise
            self._swallowed(exc)
            alerts = ()
        self.alerts = alerts
        self.ticks += 1
        self.cpu_s += time.thread_time() - start
        if self.errors:  # said in the record and on screen: alerts from a failing detector may be missing
            return dataclasses.replace(
                snapshot, alerts=alerts, analysis_errors=self.errors, analysis_error=self.last_error
            )
        return dataclasses.replace(snapshot, alerts=alerts)

    def history(self) -> list[Snapshot]:
        """The recent snapshots kept at full rate (the last ``recent_s`` seconds), oldest first."""
        return list(self._recent)

    # -- one tick ------------------------------------------------------------------------------

    def _swallowed(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"

    def _tick(self, s: Snapshot) -> tuple[Alert, ...]:
        target = (s.target.pid, s.target.start_time)
        if self._target != target or (self._last_time is not None and s.time < self._last_time - 1.0):
            self._reset()  # another target, or a replay started over
            self._target = target
        self._last_time = s.time
        self._recent.append(s)
        while self._recent and self._recent[0].time < s.time - self.recent_s:
            self._recent.popleft()
        self.digest.ingest(s)
        active = [key for key, track in self._tracks.items() if track.raised_at is not None]
        # the target's own cores (affinity, CPU quota) when the snapshot knows them: a container's
        # or a replayed machine's, not dlmon's
        cores = self.cores if self._cores_given else target_cores(s, self.cores)
        ctx = Context(tuple(self._recent), self.digest, cores, self.thresholds, active)
        seen: set[AlertKey] = set()
        try:
            hung = quiet_input_bound(ctx)  # a hang is a stall, never "too few workers"
        except Exception as exc:
            self._swallowed(exc)
            hung = frozenset()
        for detector in self.detectors.values():
            try:
                candidates = detector(ctx)
            except Exception as exc:
                if self.strict:
                    raise
                self._swallowed(exc)
                continue
            for c in candidates:
                if c.kind == INPUT_BOUND and c.key in hung:
                    continue
                key = (c.kind, c.key)
                seen.add(key)
                track = self._tracks.get(key)
                if track is None:
                    self._tracks[key] = _Track(c, s.time, c.subject)
                else:
                    track.candidate = c
                    track.absent_since = None
        return self._update(s.time, seen, ended=not s.target.alive)

    def _update(self, now: float, seen: set[AlertKey], ended: bool = False) -> tuple[Alert, ...]:
        """``ended``: the target has exited. A source stops at most a few ticks later, so waiting
        out a clear hold would leave the last frame and record line with a condition that is over
        (an orphan_worker whose orphans have all exited): what is gone is cleared at once."""
        alerts: list[Alert] = []
        for key, track in list(self._tracks.items()):
            hold = self.holds.get(key[0], _DEFAULT_HOLD)
            if key not in seen:
                if track.raised_at is None:
                    del self._tracks[key]  # it must last without a break to be raised
                    continue
                if track.absent_since is None:
                    track.absent_since = now
                clear_after_s = hold.clear_after_s
                resumed = key[0] == STALL and self._resumed(track)
                if resumed:
                    clear_after_s = min(clear_after_s, RESUMED_STALL_CLEAR_S)
                if ended and key[0] in _LAST_WORDS and not resumed:
                    pass  # what the job was doing when it ended: the exit verdict's cause
                elif ended or now - track.absent_since >= clear_after_s:
                    del self._tracks[key]
                    continue
            elif track.raised_at is None and now - track.present_since >= hold.raise_after_s:
                track.raised_at = now
            if track.raised_at is not None:
                c = track.candidate
                alerts.append(
                    Alert(
                        kind=c.kind,
                        severity=c.severity,
                        subject=track.subject,
                        message=c.message,
                        advice=c.advice,
                        since=track.raised_at,
                        evidence=MappingProxyType({k: _finite(v) for k, v in c.evidence.items()}),
                    )
                )
        alerts.sort(key=lambda a: (-SEVERITY_RANK.get(a.severity, 0), a.since, a.kind, a.subject))
        return tuple(alerts)

    def _resumed(self, track: _Track) -> bool:
        """Whether the stalled loader (or, for one stuck worker, that worker) has delivered a batch
        since the stall was last seen."""
        evidence = track.candidate.evidence
        memory = self.digest.loader_progress.get(str(evidence.get("loader_id")))
        if memory is None or track.absent_since is None:
            return False
        if evidence.get("where") == "worker":
            wid, pid = evidence.get("worker_id"), evidence.get("pid")
            seen = memory.workers.get((wid, pid)) if isinstance(wid, int) and isinstance(pid, int) else None
            return seen is not None and seen[1] >= track.absent_since
        return memory.moved_at >= track.absent_since
