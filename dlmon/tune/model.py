"""Pure functions of the sweep: memory projection, the per-worker memory model, the knee, the
skip rules and the recommendation. No I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dlmon.tune.plan import Config

GIB = 1024**3
SAFETY = 0.9  # stop or skip a configuration expected to pass 90% of the memory limit
KNEE_FRACTION = 0.95  # the knee: the fewest workers that reach 95% of the best speed
KNEE_GAIN = 0.03  # beyond the knee: two steps in a row that each added less than 3%
DEFAULT_PREFETCH = 2

OK = "ok"
WOULD_OOM = "would_oom"
HOST_OOM = "host_oom"
CUDA_OOM = "cuda_oom"
SHM = "shm_exhausted"
TIMED_OUT = "timed_out"
CRASHED = "crashed"
SKIPPED = "skipped"
OUTCOME_TEXT = {
    OK: "ok",
    WOULD_OOM: "would OOM",
    HOST_OOM: "host OOM",
    CUDA_OOM: "CUDA OOM",
    SHM: "shm exhausted",
    TIMED_OUT: "timed out",
    CRASHED: "crashed",
    SKIPPED: "skipped",
}
MEMORY_FAILURES = (WOULD_OOM, HOST_OOM, SHM)  # more workers or a larger batch need at least as much


def outcome_text(outcome: str, detail: str) -> str:
    """``would OOM at ~1.20 GiB (...)``, ``crashed: exit status 1 | ...``, ``ok``."""
    text = OUTCOME_TEXT.get(outcome, outcome)
    if not detail:
        return text
    return f"{text} {detail}" if detail.startswith("at ") else f"{text}: {detail}"


@dataclass(frozen=True, slots=True)
class Result:
    """One configuration, measured (or skipped, with the reason in ``detail``)."""

    config: Config
    outcome: str
    detail: str = ""
    samples_per_s: float | None = None
    samples_per_s_spread: float | None = None  # standard deviation of the per-tick rates
    data_wait: float | None = None  # share of the training's time spent waiting for batches
    startup_s: float | None = None  # worker start-up: building the iterator and its first batch (agent)
    measured_s: float | None = None
    batches: int | None = None
    peak_pss_bytes: int | None = None  # the job: trainer + workers
    peak_uss_bytes: int | None = None  # sum of USS over the job
    peak_worker_uss_bytes: int | None = None  # the largest single worker
    peak_shm_bytes: int | None = None  # /dev/shm used
    peak_vram_bytes: int | None = None  # torch reserved, else NVML per process
    limit_bytes: int | None = None  # the memory limit it was measured against
    limit_source: str | None = None  # "cgroup" | "MemAvailable"
    stop_s: float | None = None  # SIGINT to exit
    loader: str | None = None  # the tuned DataLoader's site, file:line
    script_batch_size: int | None = None  # the script's own batch size
    first_batch_s: float | None = None  # launch to the tuned loader's first batch (imports included)
    # RssAnon and RssFile summed over the job (pages shared by forked workers count in each)
    peak_rss_anon_bytes: int | None = None
    peak_rss_file_bytes: int | None = None


def projected_peak(times: Sequence[float], values: Sequence[int], horizon_s: float) -> float | None:
    """The memory expected ``horizon_s`` from the last reading: last value plus the growth rate
    (least-squares slope over the readings given, never negative) times the horizon."""
    if not values:
        return None
    if len(values) < 3 or times[-1] - times[0] <= 0:
        return float(values[-1])
    n = len(values)
    mt = sum(times) / n
    mv = sum(values) / n
    var = sum((t - mt) ** 2 for t in times)
    slope = sum((t - mt) * (v - mv) for t, v in zip(times, values, strict=True)) / var if var > 0 else 0.0
    return values[-1] + max(0.0, slope) * horizon_s


MIN_FIT_READINGS = 3  # projected_peak's least for a slope
# A rise of anonymous memory between two readings by more than this share of the limit is a jump
# (readings that jump in a row are one jump: an allocation split by a tick). One jump alone (a
# buffer allocated once) is no growth: its slope counts only while it goes on (a ramp), once a
# second jump follows within STAIR_S (a staircase: a batch at a time, even seconds apart), or if
# readings after it still rise.
JUMP_FRACTION = 0.04
STAIR_S = 30.0  # not 3 s: a staircase of a step every few seconds crossed the cap unstopped


@dataclass(slots=True)
class OomWatch:
    """Whether a running configuration is on its way past ``SAFETY`` x the memory limit.

    Readings from the moment the loader exists (the import of torch before it is no trend) within
    the last ``window_s`` (a second: fitted over 3 s, a ramp after a flat warm-up was seen at a
    quarter of its rate and stopped at 625 MiB of a 640 MiB cap). The growth rate is fitted on
    the anonymous part (file pages are reclaimable: their swings under a cgroup's reclaim are not
    growth) and added to the total.
    It stops a configuration that would pass the line within ``act_s`` (the next few ticks:
    the kernel's OOM killer comes at the limit itself) on ``confirm`` readings in a row, or at
    once when the next reading (a tick on) would be past the line. Projected over the rest of the
    configuration's window instead, one worker's fork and copy-on-write burst stopped a healthy
    1 worker x batch 8 at 0.2 GiB of a 0.62 GiB cap (CI); that longer projection is what ``add``
    returns, for the message."""

    limit_bytes: int
    window_s: float = 1.0
    act_s: float = 1.0
    confirm: int = 2
    times: list[float] = field(default_factory=list)
    totals: list[int] = field(default_factory=list)
    anon: list[int] = field(default_factory=list)
    over: int = 0
    # jumps begun within the last STAIR_S: [first jumping reading's time, first flat one's or None]
    jumps: list[list[float | None]] = field(default_factory=list)

    def add(self, t: float, total: int, anon: int | None, horizon_s: float) -> float | None:
        """Take a reading; the peak projected ``horizon_s`` ahead when it says stop, else None."""
        if self.times and t < self.times[-1]:  # the wall clock stepped back: the fit starts over
            self.times.clear()
            self.totals.clear()
            self.anon.clear()
            self.jumps.clear()
        reading = total if anon is None else anon
        going = bool(self.jumps) and self.jumps[-1][1] is None
        if self.anon and reading - self.anon[-1] > JUMP_FRACTION * self.limit_bytes:
            if not going:
                self.jumps.append([t, None])
        elif going:
            self.jumps[-1][1] = t
        self.jumps = [j for j in self.jumps if j[1] is None or t - (j[0] or 0.0) <= STAIR_S]
        self.times.append(t)
        self.totals.append(total)
        self.anon.append(total if anon is None else anon)
        # at least MIN_FIT_READINGS: ticks slower than the window's half (a long smaps read under
        # load) would leave two readings, which projected_peak fits no slope to (a ramp unseen)
        while len(self.times) > MIN_FIT_READINGS and self.times[-1] - self.times[0] > self.window_s:
            del self.times[0], self.totals[0], self.anon[0]
        times, anons = self.times, self.anon
        if len(self.jumps) == 1:  # one jump: a ramp while it goes on, else only what came after it
            began, ended = self.jumps[0]
            # going on: from the reading before it; over: from the first flat reading after it
            first = max(0, _first_at(times, began or 0.0) - 1) if ended is None else _first_at(times, ended)
            times, anons = times[first:], anons[first:]
        soon = projected_peak(times, anons, self.act_s)
        rate_s = 0.0 if soon is None else (soon - anons[-1]) / self.act_s
        line = SAFETY * self.limit_bytes
        self.over = self.over + 1 if total + rate_s * self.act_s > line else 0
        # past the line by the next reading: no time left to confirm (the kernel kills at the
        # limit, within a tick of the line at a batch-256 ramp's 85 MiB a tick)
        tick_s = self.times[-1] - self.times[-2] if len(self.times) > 1 else 0.0
        if total > line or total + rate_s * tick_s > line or self.over >= self.confirm:
            return total + rate_s * max(horizon_s, self.act_s)
        return None


def _first_at(times: Sequence[float], t: float) -> int:
    """The index of the first reading at ``t`` or later (the last one when none is)."""
    return next((i for i, x in enumerate(times) if x >= t), len(times) - 1)


def _features(c: Config) -> tuple[float, float, float]:
    """peak ~ base + workers x per_worker + batches in flight x batch x per_sample; in flight:
    one per worker x prefetch, plus the trainer's own (the write-up's (workers + 1) x batch)."""
    b = float(c.batch_size or 0)
    pf = c.prefetch_factor or DEFAULT_PREFETCH
    return 1.0, float(c.workers), (c.workers * pf + 1) * b


@dataclass(frozen=True, slots=True)
class MemoryModel:
    base_bytes: float
    per_worker_bytes: float
    per_sample_bytes: float
    points: int

    def predict(self, c: Config) -> float:
        _, w, samples = _features(c)
        return self.base_bytes + w * self.per_worker_bytes + samples * self.per_sample_bytes

    def describe(self) -> str:
        return (
            f"peak ≈ {self.base_bytes / GIB:.2f} GiB + {self.per_worker_bytes / 2**20:.0f} MiB per worker"
            f" + {self.per_sample_bytes / 2**10:.0f} KiB per sample in flight ({self.points} points)"
        )


def _solve(a: list[list[float]], y: list[float]) -> list[float] | None:
    n = len(y)
    m = [[*row, y[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-9:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * p for x, p in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_memory(results: Sequence[Result]) -> MemoryModel | None:
    """Least squares over the measured peaks (3 points at least, varied enough); the per-worker
    and per-sample terms are kept non-negative (a negative one would promise free memory)."""
    pts = [(r.config, r.peak_pss_bytes) for r in results if r.outcome == OK and r.peak_pss_bytes]
    if len(pts) < 3:
        return None
    xs = [_features(c) for c, _ in pts]
    ys = [float(p or 0) for _, p in pts]
    ata = [[sum(x[i] * x[j] for x in xs) for j in range(3)] for i in range(3)]
    aty = [sum(x[i] * y for x, y in zip(xs, ys, strict=True)) for i in range(3)]
    coef = _solve(ata, aty)
    if coef is None:
        return None
    base, per_worker, per_sample = coef
    return MemoryModel(base, max(0.0, per_worker), max(0.0, per_sample), len(pts))


def knee(points: Sequence[tuple[int, float]], fraction: float = KNEE_FRACTION) -> int | None:
    """The fewest workers whose speed reaches ``fraction`` of the best; points: (workers, samples/s)."""
    good = [(w, s) for w, s in points if s > 0]
    if not good:
        return None
    best = max(s for _, s in good)
    return min(w for w, s in good if s >= fraction * best)


def _same_shape(a: Config, b: Config) -> bool:
    return a.pin_memory == b.pin_memory and (a.prefetch_factor or 0) <= (b.prefetch_factor or 0)


def skip_reason(
    c: Config,
    done: Sequence[Result],
    limit_bytes: int | None,
    model: MemoryModel | None,
    force: bool,
) -> str | None:
    """Why ``c`` need not run, from what was measured; None: run it."""
    if force:
        return None
    for r in done:
        o = r.config
        smaller = o.workers <= c.workers and (o.batch_size or 0) <= (c.batch_size or 0)
        if r.outcome in MEMORY_FAILURES and _same_shape(o, c) and smaller:
            return f"needs at least the memory of {o.label()}, which ran out ({OUTCOME_TEXT[r.outcome]})"
        if r.outcome == CUDA_OOM and (o.batch_size or 0) <= (c.batch_size or 0) and o.batch_size:
            return f"batch {o.batch_size} already ran out of GPU memory"
    if model is not None and limit_bytes:
        predicted = model.predict(c)
        if predicted > SAFETY * limit_bytes:
            return (
                f"cannot fit by the memory model: ~{predicted / GIB:.2f} GiB > {SAFETY:.0%} of the "
                f"{limit_bytes / GIB:.2f} GiB limit ({model.describe()})"
            )
    same = sorted(
        (r.config.workers, r.samples_per_s or 0.0)
        for r in done
        if r.outcome == OK
        and r.config.batch_size == c.batch_size
        and r.config.pin_memory == c.pin_memory
        and r.config.prefetch_factor in (c.prefetch_factor, None)
        and r.config.workers < c.workers
    )
    if len(same) >= 3:
        (w0, s0), (w1, s1), (w2, s2) = same[-3:]
        if s0 > 0 and s1 > 0 and s1 < s0 * (1 + KNEE_GAIN) and s2 < s1 * (1 + KNEE_GAIN):
            return (
                f"past the knee: {w0}→{w1} workers added {s1 / s0 - 1:+.0%} and {w1}→{w2} {s2 / s1 - 1:+.0%}"
            )
    return None


@dataclass(frozen=True, slots=True)
class Recommendation:
    choice: Result
    best: Result
    reason: str


def recommend(results: Sequence[Result], fraction: float = KNEE_FRACTION) -> Recommendation | None:
    """The cheapest configuration (peak memory, then fewer workers) within ``fraction`` of the
    best measured speed, with the reason in one line."""
    ok = [r for r in results if r.outcome == OK and r.samples_per_s]
    if not ok:
        return None
    best = max(ok, key=lambda r: r.samples_per_s or 0.0)
    top = best.samples_per_s or 0.0
    near = [r for r in ok if (r.samples_per_s or 0.0) >= fraction * top]
    choice = min(near, key=lambda r: (r.peak_pss_bytes or 0, r.config.workers, -(r.config.batch_size or 0)))
    share = (choice.samples_per_s or 0.0) / top if top else 0.0
    parts = [f"{choice.config.label()}: {share:.0%} of the best speed"]
    if choice.limit_bytes and choice.peak_pss_bytes:
        headroom = 1 - choice.peak_pss_bytes / choice.limit_bytes
        parts.append(f"{headroom:.0%} memory headroom")
    reason = ", ".join(parts)
    if best is not choice:
        gain = top / (choice.samples_per_s or top) - 1
        extra = ((best.peak_pss_bytes or 0) - (choice.peak_pss_bytes or 0)) / GIB
        reason += f"; {best.config.label()} adds {gain:.0%} for {extra:+.2f} GiB"
    return Recommendation(choice, best, reason)
