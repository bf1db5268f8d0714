"""Small robust statistics over irregular time series: no numpy, no I/O.

A series is a sequence of ``(time, value)`` points, oldest first, with strictly increasing times.
Everything here is O(n) or O(n^2) for n kept small (callers subsample to ``MAX_POINTS``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

Point = tuple[float, float]

MAX_POINTS = 24  # Theil-Sen over 24 points is 276 slopes: ~50 us in pure Python


def median(values: Sequence[float]) -> float:
    """The median; raises ValueError on an empty sequence."""
    if not values:
        raise ValueError("median of nothing")
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile, ``q`` in [0, 1]; raises ValueError on an empty sequence."""
    if not values:
        raise ValueError("quantile of nothing")
    ordered = sorted(values)
    pos = min(max(q, 0.0), 1.0) * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("mean of nothing")
    return sum(values) / len(values)


def subsample(points: Sequence[Point], limit: int = MAX_POINTS) -> list[Point]:
    """At most ``limit`` points spread evenly by index, always keeping the first and the last."""
    n = len(points)
    if n <= limit:
        return list(points)
    if limit < 2:
        return [points[-1]]
    step = (n - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def theil_sen(points: Sequence[Point]) -> float | None:
    """The median of the slopes between every pair of points (value units per time unit).

    Robust to up to ~29% outliers; None with fewer than two points of distinct times.
    """
    slopes: list[float] = []
    n = len(points)
    for i in range(n - 1):
        ti, vi = points[i]
        for j in range(i + 1, n):
            tj, vj = points[j]
            dt = tj - ti
            if dt > 0:
                slopes.append((vj - vi) / dt)
    return median(slopes) if slopes else None


def trend_score(points: Sequence[Point], tolerance: float) -> float:
    """Mann-Kendall S normalised to [-1, 1]: (rising pairs - falling pairs) / all pairs.

    Pairs whose values differ by no more than ``tolerance`` count as ties. A steady rise scores
    near 1, a staircase high, a sawtooth or noise around a level near 0, a single step at most 0.5.
    """
    n = len(points)
    if n < 2:
        return 0.0
    score = 0
    for i in range(n - 1):
        vi = points[i][1]
        for j in range(i + 1, n):
            d = points[j][1] - vi
            if d > tolerance:
                score += 1
            elif d < -tolerance:
                score -= 1
    return score / (n * (n - 1) / 2)


@dataclass(frozen=True, slots=True)
class Steps:
    """How a series moved: runs of consecutive rises (or falls) bigger than the noise.

    A run that completes within ``step_span_s`` is a *step*; a longer run is steady growth.
    ``largest_jump`` is the biggest rise within any ``step_span_s``: when it makes up most of the
    net rise, the whole rise was one jump.
    """

    ups: int  # rising runs
    downs: int  # falling runs
    steady: bool  # some rising run lasted longer than step_span_s
    up_total: float
    down_total: float
    largest_jump: float


def steps(points: Sequence[Point], threshold: float, step_span_s: float) -> Steps:
    ups = downs = 0
    up_total = down_total = 0.0
    steady = False
    run_dir = 0
    run_start = last_move = 0.0
    for (ta, a), (tb, b) in pairwise(points):
        d = b - a
        move = 1 if d > threshold else -1 if d < -threshold else 0
        if move == 0:
            continue  # a pause; a pause longer than step_span_s ends the run (below)
        if move > 0:
            up_total += d
        else:
            down_total -= d
        if move != run_dir or ta - last_move > step_span_s:
            if move > 0:
                ups += 1
            else:
                downs += 1
            run_dir = move
            run_start = ta
        last_move = tb
        if move > 0 and tb - run_start > 2 * step_span_s:
            steady = True
    largest = 0.0
    n = len(points)
    for i in range(n - 1):
        ti, vi = points[i]
        for j in range(i + 1, n):
            tj, vj = points[j]
            if tj - ti > step_span_s:
                break
            largest = max(largest, vj - vi)
    return Steps(ups, downs, steady, up_total, down_total, largest)


def noise(points: Sequence[Point], slope: float = 0.0) -> float:
    """A robust scale of point-to-point jitter: 1.4826 x MAD of the consecutive differences left
    once the trend ``slope`` is taken out (so uneven spacing of a steady rise is not noise, and the
    few big jumps of a staircase do not inflate it)."""
    if len(points) < 3:
        return 0.0
    diffs = [(b - a) - slope * (tb - ta) for (ta, a), (tb, b) in pairwise(points)]
    m = median(diffs)
    return 1.4826 * median([abs(d - m) for d in diffs])


@dataclass(frozen=True, slots=True)
class Trend:
    """What a window of a series says about growth. Slopes are value units per second."""

    points: int
    span_s: float
    slope: float  # Theil-Sen over the window
    first_half_slope: float | None
    second_half_slope: float | None
    last_quarter_slope: float | None
    score: float  # trend_score
    start_level: float  # median of the first quarter of the points
    end_level: float  # median of the last quarter
    steps: Steps
    tolerance: float

    @property
    def rise(self) -> float:
        return self.end_level - self.start_level

    @property
    def single_step(self) -> bool:
        """Most of the rise came in one jump (a one-off allocation, an epoch-start step)."""
        rise = self.rise
        return rise > 0 and self.steps.largest_jump >= 0.7 * rise

    @property
    def sawtooth(self) -> bool:
        """Drops give back at least half of what the jumps added (GC cycles, epoch churn)."""
        return self.steps.downs > 0 and self.steps.down_total >= 0.5 * self.steps.up_total

    def levelling(self, last_quarter: bool = True) -> float | None:
        """The smaller of the second-half and (with ``last_quarter``) last-quarter slopes over
        the whole window's slope: near 0 when growth is levelling off (a warm-up reaching its
        plateau), about 1 for a steady leak, above 1 when it accelerates."""
        if self.slope <= 0:
            return None
        recent = (self.second_half_slope, self.last_quarter_slope if last_quarter else None)
        parts = [s for s in recent if s is not None]
        return min(parts) / self.slope if parts else None


def trend(
    points: Sequence[Point],
    tolerance_floor: float,
    tolerance_fraction: float = 0.002,
    step_span_s: float = 15.0,
) -> Trend | None:
    """A :class:`Trend` of ``points`` (already cut to the window); None with fewer than 3 points.

    The tie tolerance is the larger of ``tolerance_floor``, ``tolerance_fraction`` of the level
    and 3x the point-to-point jitter, so noise around a level never counts as a rise.
    """
    pts = subsample(points)
    n = len(pts)
    if n < 3:
        return None
    slope = theil_sen(pts)
    if slope is None:
        return None
    values = [v for _, v in pts]
    level = median(values)
    jitter = noise(pts, slope)
    tolerance = max(tolerance_floor, tolerance_fraction * abs(level), 3.0 * jitter)
    t0, t1 = pts[0][0], pts[-1][0]
    mid = 0.5 * (t0 + t1)
    span = max(step_span_s, 1.5 * (t1 - t0) / (n - 1))  # no finer than the points allow
    first = [p for p in pts if p[0] <= mid]
    second = [p for p in pts if p[0] >= mid]
    last = [p for p in pts if p[0] >= t1 - 0.25 * (t1 - t0)]
    quarter = max(1, n // 4)
    return Trend(
        points=n,
        span_s=t1 - t0,
        slope=slope,
        first_half_slope=theil_sen(first) if len(first) >= 2 else None,
        second_half_slope=theil_sen(second) if len(second) >= 2 else None,
        last_quarter_slope=theil_sen(last) if len(last) >= 2 else None,
        score=trend_score(pts, tolerance),
        start_level=median(values[:quarter]),
        end_level=median(values[-quarter:]),
        steps=steps(pts, tolerance, span),
        tolerance=tolerance,
    )


def saturation_rest(points: Sequence[Point], min_points: int = 6) -> float | None:
    """What is left to come of a rise that slows geometrically (y = L - R·exp(-t/τ)), from the
    last reading: with the medians m0, m1, m2 of three equal spans of time, each span adds
    q = (m1 - m0) / (m2 - m1) times less than the one before, so what follows the last span is
    (m2 - m1) / (q - 1), counted from its middle. None when the rise does not slow (q ≤ 1.05:
    a steady or accelerating rise has no level in sight) or there are too few points."""
    if len(points) < min_points:
        return None
    t0, t3 = points[0][0], points[-1][0]
    span = (t3 - t0) / 3.0
    if span <= 0:
        return None
    thirds: list[list[float]] = [[], [], []]
    for t, v in points:
        thirds[min(2, int((t - t0) / span))].append(v)
    if any(len(part) < 2 for part in thirds):
        return None
    m0, m1, m2 = (median(part) for part in thirds)
    d1, d2 = m1 - m0, m2 - m1
    if d1 <= 0:
        return None
    if d2 <= 0:
        return max(0.0, m2 - points[-1][1])  # it has levelled off already
    q = d1 / d2
    if q <= 1.05:
        return None
    return max(0.0, m2 + d2 / (q - 1.0) - points[-1][1])
