"""The Analyzer: runs the detectors every tick and turns their candidates into stable alerts.

Hysteresis lives here and only here. A candidate becomes an alert once it has been present
continuously for its kind's ``raise_after_s``; a raised alert clears once its candidate has been
absent continuously for ``clear_after_s``. Detectors add a second gap of their own: they keep a
raised alert on a looser threshold than they raise it with (``Context.active``). ``since`` is the
time the alert was raised and survives message and severity changes.

It never raises: a failing detector contributes nothing that tick and ``errors`` counts it
(``strict=True`` re-raises instead, for tests). Memory stays bounded: full snapshots for
``recent_s`` seconds, and compact thinned series (``Digest``) for the long windows. The recent
snapshots are indexed as they come and go (``RecentIndex``: the fd trend, the loaders' pace, the
newest stacks), so a tick does not cost more as the window fills or the rate rises.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dlmon.analysis.detectors import Candidate, Context, Thresholds
from dlmon.analysis.detectors._base import DEFAULT_THRESHOLDS, AlertKey, States
from dlmon.analysis.detectors.registry import (
    DEFAULT_HOLDS,
    DETECTORS,
    SPEC_BY_KIND,
    SPECS,
    Detector,
    Hold,
    KindSpec,
    Resumption,
)
from dlmon.analysis.digest import Digest, DigestLimits
from dlmon.analysis.recent import RecentIndex
from dlmon.analysis.severity import SEVERITY_RANK
from dlmon.model import Alert, Snapshot

_DEFAULT_HOLD = Hold(3.0, 15.0)  # a detector outside the registry's (a test's)
_SILENCES = tuple(s.silences for s in SPECS if s.silences is not None)


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
        incremental: bool = True,
    ) -> None:
        self.cores = cores if cores is not None else default_cores()
        self._cores_given = cores is not None
        self.thresholds = thresholds
        self.holds = holds
        self.detectors = detectors
        self.recent_s = recent_s
        self.strict = strict
        # the detectors read the window's incremental index (False: they rescan the window on
        # every tick, as before issue 22: the reference the tests compare the index with)
        self.incremental = incremental
        self.errors = 0  # exceptions swallowed so far (a detector bug), never raised to the caller
        self.last_error: str | None = None
        self.ticks = 0
        self.cpu_s = 0.0  # thread CPU spent in __call__, for the cost figures
        self._limits = digest_limits or DigestLimits()
        self._max_recent = max_recent
        self._reset()

    def _reset(self) -> None:
        self._recent = RecentIndex(self.recent_s, self._max_recent)
        self.digest = Digest(self._limits)
        self.states = States()  # each stateful detector's memory across ticks
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
        self._recent.add(s)  # and what has expired goes
        self.digest.ingest(s)
        active = [key for key, track in self._tracks.items() if track.raised_at is not None]
        # the target's own cores (affinity, CPU quota) when the snapshot knows them: a container's
        # or a replayed machine's, not dlmon's
        cores = self.cores if self._cores_given else target_cores(s, self.cores)
        index = self._recent if self.incremental else None
        ctx = Context(
            self._recent.snapshots(), self.digest, cores, self.thresholds, active, index, self.states
        )
        seen: set[AlertKey] = set()
        dropped: set[AlertKey] = set()
        for silences in _SILENCES:  # a hang is a stall, never "too few workers"
            try:
                dropped.update((silences.kind, k) for k in silences.keys(ctx))
            except Exception as exc:
                if self.strict:
                    raise
                self._swallowed(exc)
        for detector in self.detectors.values():
            try:
                candidates = detector(ctx)
            except Exception as exc:
                if self.strict:
                    raise
                self._swallowed(exc)
                continue
            for c in candidates:
                key = (c.kind, c.key)
                if key in dropped:
                    continue
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
            spec: KindSpec | None = SPEC_BY_KIND.get(key[0])
            if key not in seen:
                if track.raised_at is None:
                    del self._tracks[key]  # it must last without a break to be raised
                    continue
                if track.absent_since is None:
                    track.absent_since = now
                clear_after_s = hold.clear_after_s
                resumption = spec.resumption if spec is not None else None
                resumed = resumption is not None and self._resumed(track, resumption)
                if resumption is not None and resumed:
                    clear_after_s = min(clear_after_s, resumption.clear_after_s)
                if ended and spec is not None and spec.last_words and not resumed:
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

    def _resumed(self, track: _Track, resumption: Resumption) -> bool:
        """Whether the raised condition is over since it was last seen (a stall's loader delivered)."""
        if track.absent_since is None:
            return False
        return resumption.over(self.states, track.candidate.evidence, track.absent_since)
