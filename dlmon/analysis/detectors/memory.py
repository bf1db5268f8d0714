"""memory_growth (the staircase to the OOM killer) and swap_activity."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from dlmon.analysis.detectors._base import (
    MIB,
    Candidate,
    Context,
    Headroom,
    describe_headroom,
    duration,
    headroom,
    per_min,
    size,
    sum_known,
)
from dlmon.analysis.digest import Digest, Series
from dlmon.analysis.severity import CRITICAL, INFO, WARNING
from dlmon.analysis.stats import Trend, median, saturation_rest, subsample, theil_sen, trend
from dlmon.model import ProcessSample, Snapshot
from dlmon.model.format import DEAD_STATES

MEMORY_GROWTH = "memory_growth"
SWAP_ACTIVITY = "swap_activity"


@dataclass(frozen=True, slots=True)
class GrowthWindow:
    """One window memory_growth looks through, with what must hold in it to call it growth."""

    name: str
    window_s: float
    min_span_s: float  # the fresh readings in it must cover this much time
    min_points: int
    min_slope_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class MemoryNumbers:
    """memory_growth's numbers (three views of the job: PSS total, workers' USS, RssAnon, over
    three windows) and swap_activity's; docs/detectors.md says what each does."""

    growth_windows: tuple[GrowthWindow, ...] = (
        GrowthWindow("60 s", 60.0, 35.0, 4, 1.0 * MIB),  # >= 60 MiB/min, seen within a minute
        GrowthWindow("10 min", 600.0, 240.0, 6, 5.0 * MIB / 60),  # >= 5 MiB/min
        GrowthWindow("60 min", 3600.0, 1200.0, 8, 1.0 * MIB / 60),  # >= 1 MiB/min
    )
    growth_min_score: float = 0.6  # Mann-Kendall S: share of rising minus falling pairs
    growth_hold_score: float = 0.35  # ... while already raised
    growth_hold_slope: float = 0.5  # while raised, half the window's slope keeps it
    growth_min_levelling: float = 0.5  # recent slope / slope: below this it is levelling off
    growth_hold_levelling: float = 0.2  # ... while already raised
    growth_step_span_s: float = 15.0  # a rise done within this is one step (PSS is re-read every 10 s)
    growth_lookback_factor: float = 5.0  # a new rise must pass the highest level of 5 windows back
    growth_tolerance_bytes: float = 1.0 * MIB  # changes smaller than this are ties (noise)
    growth_warmup_s: float = 120.0  # no growth is raised in the watch's first 2 minutes ...
    growth_warmup_max_eta_s: float = 300.0  # ... unless the limit is nearer than this at the rate
    growth_critical_eta_s: float = 600.0
    growth_info_eta_s: float = 6 * 3600.0
    process_growth_min_bytes_per_s: float = 2 * 1024.0  # ~0.12 MiB/min: a process "grows"
    in_step_ratio: float = 4.0  # growing workers' rates within this factor: "in step"
    swap_window_s: float = 30.0
    swap_job_rise_bytes: float = 8.0 * MIB
    swap_machine_rise_bytes: float = 32.0 * MIB
    swap_critical_memory_pressure: float = 20.0  # PSI memory some avg10


COPY_ON_READ = "copy_on_read"
MAIN_PROCESS = "main_process"
SOME_WORKERS = "some_workers"
UNATTRIBUTED = "unattributed"

_PROCESS_POINTS = 12  # per-process attribution: a cheaper Theil-Sen


def is_growth(
    t: Trend, window: GrowthWindow, cfg: MemoryNumbers, held: bool, prior_high: float | None
) -> bool:
    """The rule: a robust slope above the window's rate, mostly rising pairs, a real net rise
    that is neither one jump nor given back by drops, not levelling off, and (to raise) a new
    high above anything in the lookback before the window (a sawtooth's next tooth is not).
    ``held``: the alert is raised, so the looser hold thresholds apply."""
    min_slope = window.min_slope_bytes_per_s * (cfg.growth_hold_slope if held else 1.0)
    if t.slope < min_slope:
        return False
    if t.score < (cfg.growth_hold_score if held else cfg.growth_min_score):
        return False
    if t.rise <= t.tolerance or t.single_step or t.sawtooth:
        return False
    ratio = t.levelling(last_quarter=not held)  # a staircase's last quarter may fall between steps
    if ratio is not None and ratio < (cfg.growth_hold_levelling if held else cfg.growth_min_levelling):
        return False
    return held or prior_high is None or t.end_level > prior_high + t.tolerance


@dataclass(frozen=True, slots=True)
class ProcessGrowth:
    label: str
    role: str
    pid: int
    slope: float  # bytes/s of USS (PSS when USS is unknown, RssAnon for that signal)


CACHE_LIMIT = 1024  # trends and slopes kept; cleared when full (each can be computed again)
SlopeKey = tuple[bool, int, int, float, float, int]  # anon?, pid, start_time, window_s, end, points
TrendKey = tuple[str, float, float, int]  # signal, window_s, end, points


@dataclass(slots=True)
class MemoryState:
    """memory_growth's cache of pure results across ticks: a window ending on ``grid_end``'s grid
    changes a few dozen times per window length, so its trend (and each process's slope in it)
    is computed once, not every tick."""

    slopes: dict[SlopeKey, float] = field(default_factory=dict)
    trends: dict[TrendKey, Trend] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.slopes) + len(self.trends)

    def clear(self) -> None:
        self.slopes.clear()
        self.trends.clear()

    def keep_slope(self, key: SlopeKey, slope: float) -> None:
        if len(self) >= CACHE_LIMIT:
            self.clear()
        self.slopes[key] = slope

    def keep_trend(self, key: TrendKey, t: Trend) -> None:
        if len(self) >= CACHE_LIMIT:
            self.clear()
        self.trends[key] = t


def grid_end(t: float, window_s: float) -> float:
    """``t`` floored to a grid of 1/30 of the window (at least 2 s): a window's contents then
    change only a few dozen times per window length, so its trend is computed that often."""
    step = max(2.0, window_s / 30.0)
    return math.floor(t / step) * step


def process_slopes(
    digest: Digest, cache: MemoryState, now: float, window_s: float, anon: bool = False
) -> list[ProcessGrowth]:
    """The USS (or with ``anon`` the RssAnon) slope of every live process with at least 3
    readings in the window (or, failing that, with one in it: its last 3 within twice the window)."""
    out: list[ProcessGrowth] = []
    end = grid_end(now, window_s)
    for track in digest.live():
        series = track.anon if anon else track.uss if len(track.uss) else track.pss
        points = series.between(end - window_s, end)
        if len(points) < 3:
            # PSS is read on a budget: a large worker on a busy machine is read every 20 s or
            # more, so a short window may hold 2 of its readings. Its last 3 within twice the
            # window still give its slope; leaving it out would name only the others as growing.
            # Not with none in the window: a worker that stops growing is re-read the least (the
            # budget favours the ones that move), and its last readings are from when it grew.
            if not points:
                continue
            points = series.between(end - 2 * window_s, end)[-3:]
            if len(points) < 3:
                continue
        key = (anon, track.pid, track.start_time, window_s, end, len(points))
        slope = cache.slopes.get(key)
        if slope is None:
            slope = theil_sen(subsample(points, _PROCESS_POINTS))
            if slope is not None:
                cache.keep_slope(key, slope)
        if slope is not None:
            out.append(ProcessGrowth(track.label, track.role, track.pid, slope))
    return out


JOB_PSS = "job PSS"
WORKERS_USS = "workers' USS"
JOB_ANON = "job RssAnon"
TRAINER_ANON = "trainer RssAnon"
SIGNALS = (JOB_PSS, WORKERS_USS, JOB_ANON, TRAINER_ANON)
_WHAT = {
    JOB_PSS: "The job's memory (PSS)",
    WORKERS_USS: "The workers' private memory (USS)",
    JOB_ANON: "The job's anonymous memory (RssAnon)",
    TRAINER_ANON: "The trainer's anonymous memory (RssAnon)",
}
# the same signals without file-backed pages (smaps_rollup's Pss_File): mapped datasets are cache
_WHAT_SPLIT = {
    JOB_PSS: "The job's memory without mapped files (PSS - Pss_File)",
    WORKERS_USS: "The workers' anonymous memory (PSS - Pss_File)",
    JOB_ANON: _WHAT[JOB_ANON],
    TRAINER_ANON: _WHAT[TRAINER_ANON],
}
ANON_SIGNALS = (JOB_ANON, TRAINER_ANON)
TRAINER_LEVEL_S = 15.0  # the trainer's level seen in training before a window of its view can raise
# a window of the trainer's view in its loop's first minutes must keep this share of its rate to the end
TRAINER_EARLY_LEVELLING = 0.8


def _series(digest: Digest, name: str) -> Series:
    if name == JOB_PSS:
        return digest.job_pss
    if name == TRAINER_ANON:
        return digest.main_anon
    return digest.workers_uss if name == WORKERS_USS else digest.job_anon


def _job_trend(
    digest: Digest, cache: MemoryState, name: str, end: float, window: GrowthWindow, cfg: MemoryNumbers
) -> Trend | None:
    points = _series(digest, name).between(end - window.window_s, end)
    if len(points) < window.min_points or points[-1][0] - points[0][0] < window.min_span_s:
        return None
    # cheap pre-check: growth at the window's rate must show between the ends (most ticks stop here)
    k = min(3, len(points) // 2)
    ends_rise = median([v for _, v in points[-k:]]) - median([v for _, v in points[:k]])
    min_rise = 0.3 * window.min_slope_bytes_per_s * cfg.growth_hold_slope * (points[-1][0] - points[0][0])
    if ends_rise < min_rise:
        return None
    key = (name, window.window_s, end, len(points))
    cached = cache.trends.get(key)
    if cached is not None:
        return cached
    t = trend(points, cfg.growth_tolerance_bytes, step_span_s=cfg.growth_step_span_s)
    if t is not None:
        cache.keep_trend(key, t)
    return t


@dataclass(frozen=True, slots=True)
class Attribution:
    cause: str
    growing: tuple[ProcessGrowth, ...]
    workers: int
    phrase: str  # e.g. "in all 4 workers in step"


def attribute(
    digest: Digest,
    cache: MemoryState,
    now: float,
    window_s: float,
    job_slope: float,
    cfg: MemoryNumbers,
    anon: bool = False,
    trainer_only: bool = False,
) -> Attribution:
    """``trainer_only``: the growth was seen in the trainer's own series, so only its slope counts
    (a worker of this epoch rising through its short life is not what grew over the window)."""
    slopes = process_slopes(digest, cache, now, window_s, anon)
    if trainer_only:
        slopes = [g for g in slopes if g.role == "main"]
    label = "RssAnon" if anon else "anon PSS" if digest.split else "USS"
    n_workers = sum(1 for t in digest.live() if t.role == "worker")
    floor = max(cfg.process_growth_min_bytes_per_s, 0.2 * job_slope / max(1, len(slopes)))
    growing = tuple(sorted((g for g in slopes if g.slope >= floor), key=lambda g: -g.slope))
    growing_workers = [g for g in growing if g.role == "worker"]
    main = [g for g in growing if g.role == "main"]
    if n_workers >= 2 and len(growing_workers) >= max(2, -(-3 * n_workers // 4)):
        rates = [g.slope for g in growing_workers]
        if max(rates) <= cfg.in_step_ratio * min(rates):
            return Attribution(
                COPY_ON_READ,
                growing,
                n_workers,
                f"in {len(growing_workers)} of {n_workers} workers in step "
                f"({label} +{per_min(median(rates))} each)",
            )
    if growing_workers:
        names = ", ".join(g.label for g in growing_workers[:3])
        more = f" and {len(growing_workers) - 3} more" if len(growing_workers) > 3 else ""
        measured = {g.pid for g in slopes}
        unread = [t for t in digest.live() if t.role == "worker" and t.pid not in measured]
        # "some workers" claims the others do not grow: say when they were not read enough to tell
        others = "1 other worker" if len(unread) == 1 else f"{len(unread)} other workers"
        untold = f"; {others} not read often enough yet to tell" if unread else ""
        return Attribution(
            SOME_WORKERS,
            growing,
            n_workers,
            f"in {names}{more} ({label} +{per_min(growing_workers[0].slope)}{untold})",
        )
    if main:
        return Attribution(
            MAIN_PROCESS, growing, n_workers, f"in the {main[0].label} ({label} +{per_min(main[0].slope)})"
        )
    return Attribution(UNATTRIBUTED, growing, n_workers, "in no single process's private memory")


_ADVICE = {
    COPY_ON_READ: (
        "This is copy-on-read (pytorch#13246): every read of a Python object in the Dataset "
        "writes its refcount and copies its page into each worker, so RSS stays flat while USS "
        "and PSS climb; keep samples in numpy arrays or torch tensors (or an np.memmap) instead "
        "of Python lists/dicts of objects, or restart workers (persistent_workers=False)."
    ),
    SOME_WORKERS: (
        "A worker keeps what it reads: look for caches in the Dataset or its transforms "
        "(memoised samples, a Lambda converting to numpy, lru_cache) and bound or remove them."
    ),
    MAIN_PROCESS: (
        "The trainer keeps references across steps: accumulate loss.item() rather than loss, "
        "detach tensors you store, do not keep outputs of every batch, and check for growing caches."
    ),
    UNATTRIBUTED: (
        "The growth is in shared memory or in processes whose USS is not read yet: check "
        "/dev/shm and shared tensors; lower num_workers or batch_size if the ETA is short."
    ),
}


@dataclass(frozen=True, slots=True)
class Ceiling:
    """Where copy-on-read growth stops (docs/detectors.md, "The copy-on-read ceiling"). All in
    the job's anonymous PSS (Σ Pss_Anon): what a copied page adds to."""

    level_bytes: float  # the job's anonymous PSS once the copying is over
    rest_bytes: float  # still to come: level - now
    bound_bytes: float  # the most that can still come: every shared anonymous page copied
    worker_bytes: float  # the largest worker's ceiling: all its resident anonymous pages its own
    basis: str  # "trend" (the slowing rise levels off first) or "pages" (the bound)


def copy_ceiling(
    processes: list[ProcessSample], job_series: Series, now: float, span_s: float
) -> Ceiling | None:
    """A page shared by m processes counts once in their PSS and m times in their ``Anonymous``;
    copied by all, it counts m times in PSS too. So Σ (Anonymous - Pss_Anon) over the job is
    all the copying can still add (pages shared with the trainer that a worker never touches
    are in it: the bound), and a rise that slows geometrically says where it levels off before
    that (``saturation_rest`` over ``span_s`` of the job's anonymous PSS). None without the
    smaps_rollup split (Linux < 5.7) or when a process lacks it."""
    if not processes or any(p.pss_anon_bytes is None or p.anonymous_bytes is None for p in processes):
        return None
    anon_now = float(sum(p.pss_anon_bytes or 0 for p in processes))
    bound = float(sum(max(0, (p.anonymous_bytes or 0) - (p.pss_anon_bytes or 0)) for p in processes))
    workers = [p for p in processes if p.role == "worker"]
    worker = float(max((p.anonymous_bytes or 0 for p in workers), default=0))
    rest = saturation_rest(job_series.between(now - span_s, now))
    if rest is not None and rest < bound:
        return Ceiling(anon_now + rest, rest, bound, worker, "trend")
    return Ceiling(anon_now + bound, bound, bound, worker, "pages")


@dataclass(frozen=True, slots=True)
class Generations:
    """Workers restarted at every epoch (persistent_workers=False, validation passes): what each
    generation of them did to the job's memory."""

    epoch_s: float  # the median time between restarts
    since_s: float  # since the newest restart
    peaks: tuple[float, ...]  # the signal's highest reading in each complete generation, oldest first
    starts: tuple[float, ...]  # its lowest in each: the level each generation started from


def generations(digest: Digest, series: Series, now: float) -> Generations | None:
    """None until two restarts are known (the epoch's length between them)."""
    restarts = digest.restarts
    if len(restarts) < 2:
        return None
    gaps = [b - a for a, b in itertools.pairwise(restarts)]
    peaks: list[float] = []
    starts: list[float] = []
    begin = first_generation_start(digest, series)
    bounds = [begin, *restarts] if begin is not None and begin < restarts[0] else restarts
    for a, b in itertools.pairwise(bounds):  # the one before the first restart counts (partly seen)
        values = [v for _, v in series.between(a, b)]
        if values:
            peaks.append(max(values))
            starts.append(min(values))
    if not peaks:
        return None
    return Generations(median(gaps), now - restarts[-1], tuple(peaks), tuple(starts))


def first_generation_start(digest: Digest, series: Series) -> float | None:
    """Where the generation before the first known restart begins: when workers first appeared
    (under ``dlmon run`` the readings before are the trainer's own start-up, python and torch
    imports, the dataset build: far below any generation's start, which made a healthy sawtooth
    look like a staircase), or when the restart trimmed from the digest's list began it. With
    workers there from the first reading (an attach): the signal's first point, which a reading's
    age may place a little before that tick."""
    start = digest.generation_start
    if start is not None and digest.first_time is not None and start > digest.first_time:
        return start
    first = series.first()
    return None if first is None else first[0]


def generations_climb(g: Generations, tolerance: float) -> bool:
    """Each generation starts higher than the first did: memory kept across epochs (a staircase
    under the sawtooth), which the restarts do not give back."""
    return len(g.starts) >= 2 and g.starts[-1] > g.starts[0] + tolerance


TREND_MARGIN = 1.25  # a ceiling extrapolated from the slowing rise fits only with 25% to spare


def ceiling_fits(ceiling: Ceiling, room_bytes: float) -> bool:
    """What the copying can still add fits in the headroom: the bound as it is (it is the most),
    the trend's level with a margin (an extrapolation must not promise "no OOM" too early)."""
    margin = TREND_MARGIN if ceiling.basis == "trend" else 1.0
    return ceiling.rest_bytes * margin <= room_bytes or ceiling.bound_bytes <= room_bytes


def eta_to(room_bytes: float, rest_bytes: float, rate: float) -> float | None:
    """Seconds until the job has grown by ``room_bytes`` when the growth still to come is
    ``rest_bytes`` and slows as the untouched pages run out (each second copies the same share
    of what is left: rest·(1 - exp(-t/τ)), τ = rest / rate); None when it never gets there."""
    if rate <= 0 or room_bytes >= rest_bytes:
        return None
    tau = rest_bytes / rate
    return max(0.0, -tau * math.log(1.0 - max(0.0, room_bytes) / rest_bytes))


def growth(ctx: Context) -> tuple[GrowthWindow, str, Trend] | None:
    """The shortest window in which one of four views of the job's memory passes the growth
    rule: the PSS total (the truth, but on a shared machine it moves when unrelated processes map
    or unmap the same libraries), the sum of the workers' USS (copy-on-read, without the
    trainer's own ups and downs), the RssAnon total (fresh every tick; new allocations) and the
    trainer's own RssAnon. The last is what no worker churn moves: with persistent_workers=False
    the workers die and respawn every epoch, each new one counting the trainer's copy-on-write
    pages whole in its RssAnon and having no PSS reading yet, so the job's totals are a sawtooth
    (or have no complete reading at all) while the trainer's leak rises underneath."""
    cfg = ctx.numbers(MemoryNumbers)
    digest = ctx.digest
    held = ctx.is_active(MEMORY_GROWTH, "job")
    for window in cfg.growth_windows:
        for name in _signals(digest, window.window_s):
            series = _series(digest, name)
            last = series.last()
            if last is None:
                continue
            end = grid_end(last[0], window.window_s)
            t = _job_trend(digest, ctx.state(MemoryState), name, end, window, cfg)
            if t is None:
                continue
            start = end - window.window_s
            lookback = start - (cfg.growth_lookback_factor - 1.0) * window.window_s
            prior = [v for pt, v in series.between(lookback, start) if pt < start]  # 1e-9 is lost at 1.7e9
            if not held and name != WORKERS_USS and _warming_up(ctx, name, series, start, end, t):
                continue
            if is_growth(t, window, cfg, held, max(prior) if prior else None):
                return window, name, t
    return None


# the trainer's own view before the job's RssAnon, for windows in which workers were forked
_FORKED_ORDER = (JOB_PSS, WORKERS_USS, TRAINER_ANON, JOB_ANON)


def _signals(digest: Digest, window_s: float) -> tuple[str, ...]:
    """The views in the order they are tried over a window. With a worker forked in it (each
    epoch without persistent_workers), the new worker counts the trainer's copy-on-write pages
    whole in its RssAnon: a trainer's leak shows in the job's RssAnon (1 + workers) times over, so
    its rate and ETA would be that many times wrong, and the trainer's own view comes first."""
    forked = digest.worker_forked
    if forked is not None and digest.last_time is not None and forked >= digest.last_time - window_s:
        return _FORKED_ORDER
    return SIGNALS


def _warming_up(ctx: Context, name: str, series: Series, start: float, end: float, t: Trend) -> bool:
    """The watch is younger than ``growth_warmup_s``: a trainer loading its dataset or weights
    (GiBs in its first minute, then flat) looks exactly like a leak until it levels off, and there
    is no earlier level to compare with. Wait for the levelling unless the job would hit its
    limit soon at this rate. (Not applied to the workers' sum: copy-on-read must show within a
    minute, and a worker's own start-up is small and levels off within the 60 s window.) The
    trainer's own view waits only until the training loop runs: a window that starts
    ``TRAINER_LEVEL_S`` after the DataLoader's workers (or batches) were first seen is past the
    dataset and model loading, which come before them, and has the trainer's level in training
    to compare with (attached to a job already training, that level is the first 15 s seen). Until
    the loop has run ``growth_warmup_s`` such a window raises only a rise that keeps its rate
    (``TRAINER_EARLY_LEVELLING``): the loop's own warm-up (caching allocators reaching their size,
    lazily loaded kernels, batches of a new largest size) slows as it fills, a leak does not."""
    cfg = ctx.numbers(MemoryNumbers)
    training = ctx.digest.training_seen
    trainer = name == TRAINER_ANON and training is not None and start >= training + TRAINER_LEVEL_S
    if trainer and training is not None and end >= training + cfg.growth_warmup_s:
        return False
    first = series.first()
    if not trainer and (first is None or end - first[0] >= cfg.growth_warmup_s):
        return False
    room = headroom(ctx.latest)
    if room is not None and t.slope > 0 and room.bytes / t.slope <= cfg.growth_warmup_max_eta_s:
        return False
    if trainer:
        ratio = t.levelling()
        return ratio is None or ratio < TRAINER_EARLY_LEVELLING
    return True


def detect_memory_growth(ctx: Context) -> list[Candidate]:
    cfg = ctx.numbers(MemoryNumbers)
    digest = ctx.digest
    found = growth(ctx)
    if found is None:
        return []
    now = ctx.now
    window, signal, t = found
    rate = t.slope
    s = ctx.latest
    room = headroom(s)
    eta = None if room is None or rate <= 0 else room.bytes / rate
    trainer = signal == TRAINER_ANON
    attribution = attribute(
        digest, ctx.state(MemoryState), now, window.window_s, rate, cfg, signal in ANON_SIGNALS, trainer
    )
    ceiling = (
        copy_ceiling(list(ctx.tree().attached), digest.job_pss, now, window.window_s)
        if attribution.cause == COPY_ON_READ
        else None
    )
    fits: bool | None = None
    if ceiling is not None and room is not None:
        fits = ceiling_fits(ceiling, room.bytes)
        # the ETA on the bound's curve: the earliest the slowing growth can reach the limit
        eta = None if fits else eta_to(room.bytes, ceiling.bound_bytes, rate)
    rss = digest.job_rss.since(now - window.window_s)
    rss_change = rss[-1][1] - rss[0][1] if len(rss) >= 2 else None
    rss_flat = rss_change is not None and abs(rss_change) < 0.25 * max(t.rise, 1.0)
    gens = generations(digest, _series(digest, signal), now)
    if gens is not None and (
        gens.since_s > 1.5 * gens.epoch_s or attribution.cause not in (COPY_ON_READ, SOME_WORKERS)
    ):
        gens = None  # the restarts stopped, or what grows is not the workers' (it stays at a restart)
    climbing = gens is not None and generations_climb(gens, max(t.tolerance, 0.05 * t.end_level))
    epoch_peak: float | None = None
    if climbing:
        fits = None  # a staircase under the sawtooth: no ceiling bounds what is kept across epochs
        eta = None if room is None or rate <= 0 else room.bytes / rate
    elif gens is not None and room is not None:
        # the workers' memory goes with them at the next restart: only this epoch's peak counts
        left = max(0.0, gens.epoch_s - gens.since_s)
        still = rate * left if ceiling is None else min(rate * left, ceiling.rest_bytes)
        epoch_peak = max(t.end_level + still, max(gens.peaks))
        fits = epoch_peak - t.end_level <= room.bytes
        eta = None if fits else max(0.0, room.bytes) / rate
    if fits:
        severity = INFO  # it levels off below the limit: worth knowing, no OOM coming
    elif eta is None:
        severity = WARNING
    elif eta <= cfg.growth_critical_eta_s:
        severity = CRITICAL
    elif eta > cfg.growth_info_eta_s:
        severity = INFO
    else:
        severity = WARNING
    shape = "steadily" if t.steps.steady or not 2 <= t.steps.ups <= 6 else f"in {t.steps.ups} steps"
    what = (_WHAT_SPLIT if digest.split else _WHAT)[signal]
    message = (
        f"{what} grew {shape} from {size(t.start_level)} to {size(t.end_level)} "
        f"over the last {duration(t.span_s)} ({per_min(rate)}), {attribution.phrase}"
    )
    if rss_flat and signal not in ANON_SIGNALS:
        message += ", while RSS stayed flat"
    if gens is not None and epoch_peak is not None and room is not None:
        message += "; " + describe_epochs(gens, epoch_peak, t.end_level, room, eta) + "."
    elif gens is not None and climbing and room is not None and eta is not None:
        kept = f"{size(gens.starts[0])} → {size(gens.starts[-1])}"
        message += (
            f"; the workers restart every {duration(gens.epoch_s)} but each generation starts higher "
            f"({kept}): memory is kept across epochs; it reaches {describe_headroom(room)} in about "
            f"{duration(eta)}."
        )
    elif ceiling is not None and room is not None and room.limit_bytes is not None:
        message += "; " + describe_ceiling(ceiling, room, eta) + "."
    elif room is not None and eta is not None:
        message += f"; at this rate it reaches {describe_headroom(room)} in about {duration(eta)}."
    else:
        message += "."
    evidence: dict[str, float | int | str | None] = {
        "rate_bytes_per_s": round(rate, 1),
        "signal": signal,
        "window_s": window.window_s,
        "span_s": round(t.span_s, 1),
        "points": t.points,
        "trend_score": round(t.score, 3),
        "steps_up": t.steps.ups,
        "steps_down": t.steps.downs,
        "start_bytes": round(t.start_level),  # of the signal: job PSS, workers' USS, job or trainer RssAnon
        "end_bytes": round(t.end_level),
        "rss_change_bytes": None if rss_change is None else round(rss_change),
        "headroom_bytes": None if room is None else room.bytes,
        "headroom_source": None if room is None else room.source,
        "limit_bytes": None if room is None else room.limit_bytes,
        "eta_s": None if eta is None else round(eta, 1),
        "cause": attribution.cause,
        "workers": attribution.workers,
        "growing_processes": len(attribution.growing),
        "growing_workers": sum(1 for g in attribution.growing if g.role == "worker"),
        "top_process": attribution.growing[0].label if attribution.growing else None,
        "top_process_rate_bytes_per_s": round(attribution.growing[0].slope, 1)
        if attribution.growing
        else None,
        "ceiling_bytes": None if ceiling is None else round(ceiling.level_bytes),
        "ceiling_rest_bytes": None if ceiling is None else round(ceiling.rest_bytes),
        "ceiling_bound_bytes": None if ceiling is None else round(ceiling.bound_bytes),
        "worker_ceiling_bytes": None if ceiling is None else round(ceiling.worker_bytes),
        "ceiling_basis": None if ceiling is None else ceiling.basis,
        "fits": fits,
        "epoch_s": None if gens is None else round(gens.epoch_s, 1),
        "generations": None if gens is None else len(gens.peaks) + 1,
        "epoch_peak_bytes": None if epoch_peak is None else round(epoch_peak),
    }
    advice = _ADVICE[attribution.cause]
    restarting = s.loaders and all(x.persistent_workers is False for x in s.loaders)
    if attribution.cause == COPY_ON_READ and restarting:
        advice = advice.replace(", or restart workers (persistent_workers=False)", "")  # it already does
    return [
        Candidate(
            MEMORY_GROWTH,
            "job",
            severity,
            f"job (pid {s.target.pid})",
            message,
            advice,
            evidence,
        )
    ]


def describe_ceiling(ceiling: Ceiling, room: Headroom, eta: float | None) -> str:
    """ "levels off at ≈ 9.8 GiB, fits in 22 GiB — no OOM" or "would need 41 GiB of 32 GiB: OOM
    in about 25 min" (the limit's use now plus what the copying can still add)."""
    limit = room.limit_bytes or 0
    need = limit - room.bytes + ceiling.rest_bytes
    where = "the cgroup limit" if room.source == "cgroup" else "the machine's memory"
    basis = "as its rise slows" if ceiling.basis == "trend" else "once every shared page is copied"
    each = f"each worker ≤ {size(ceiling.worker_bytes)}"
    head = f"copy-on-read levels off at ≈ {size(ceiling.level_bytes)} {basis} ({each})"
    if ceiling_fits(ceiling, room.bytes):
        return f"{head}, fits in {size(limit)} ({where}, {size(need)} needed) — no OOM"
    when = f": OOM in about {duration(eta)}" if eta is not None else ": OOM"
    if ceiling.rest_bytes <= room.bytes:  # an extrapolated level, too close to the limit to promise
        return (
            f"{head}; it would need {size(need)} of {size(limit)} ({where}), too close to call{when} at worst"
        )
    return f"{head}; it would need {size(need)} of {size(limit)} ({where}){when}"


def describe_epochs(g: Generations, peak: float, level: float, room: Headroom, eta: float | None) -> str:
    """ "the workers restart every ...: this generation peaks at ≈ X, which fits — no OOM", or
    the ETA within this epoch."""
    head = (
        f"the workers restart every {duration(g.epoch_s)} (persistent_workers=False) and their memory "
        f"goes with them: this generation peaks at ≈ {size(peak)} ({size(peak - level)} more)"
    )
    if eta is None:
        return f"{head}, which fits ({size(room.bytes)} left) — no OOM"
    return f"{head}, more than the {size(room.bytes)} left: OOM in about {duration(eta)}, within this epoch"


# -- swap_activity ---------------------------------------------------------------------------


def _job_swap(s: Snapshot) -> float | None:
    return sum_known(p.swap_bytes for p in s.processes if p.state not in DEAD_STATES)


def _spread(snaps: list[Snapshot], k: int = 5) -> list[Snapshot]:
    if len(snaps) <= k:
        return snaps
    step = (len(snaps) - 1) / (k - 1)
    return [snaps[round(i * step)] for i in range(k)]


def detect_swap_activity(ctx: Context) -> list[Candidate]:
    cfg = ctx.numbers(MemoryNumbers)
    window = list(ctx.window(cfg.swap_window_s))
    if len(window) < 2 or window[-1].time - window[0].time < 0.3 * cfg.swap_window_s:
        return []
    held = ctx.is_active(SWAP_ACTIVITY, "job")
    factor = 0.25 if held else 1.0
    first, last = window[0].memory.swap_used_bytes, window[-1].memory.swap_used_bytes
    if first is not None and last is not None and last - first < cfg.swap_job_rise_bytes * factor:
        machine_quiet = max(s.memory.swap_used_bytes or 0 for s in _spread(window)) - first
        if machine_quiet < cfg.swap_job_rise_bytes * factor:
            return []  # the job's swap is part of the machine's: nothing can have risen
    probes = _spread(window)
    job = [v for v in (_job_swap(s) for s in probes) if v is not None]
    machine = [s.memory.swap_used_bytes for s in probes if s.memory.swap_used_bytes is not None]
    job_rise = job[-1] - min(job) if len(job) >= 2 else 0.0
    machine_rise = float(machine[-1] - min(machine)) if len(machine) >= 2 else 0.0
    job_swaps = job_rise >= cfg.swap_job_rise_bytes * factor
    machine_swaps = machine_rise >= cfg.swap_machine_rise_bytes * factor
    if not (job_swaps or machine_swaps):
        return []
    s = ctx.latest
    pressure = s.pressure.memory_some_avg10 if s.pressure is not None else None
    if job_swaps:
        severity = (
            CRITICAL if pressure is not None and pressure >= cfg.swap_critical_memory_pressure else WARNING
        )
        message = (
            f"The job's swapped-out memory rose {size(job_rise)} in the last {duration(cfg.swap_window_s)} "
            f"to {size(job[-1])}"
        )
    else:
        severity = INFO
        message = (
            f"The machine's swap use rose {size(machine_rise)} in the last {duration(cfg.swap_window_s)}"
        )
    if machine:
        message += f" (machine swap in use: {size(machine[-1])}"
        message += f", memory pressure {pressure:.0f}%)." if pressure is not None else ")."
    else:
        message += "."
    return [
        Candidate(
            SWAP_ACTIVITY,
            "job",
            severity,
            f"job (pid {s.target.pid})",
            message,
            "Memory is over-committed and pages go to disk, which stalls the job: lower num_workers "
            "or batch_size, fix any memory_growth, and watch pinned memory (page-locked, it cannot "
            "be swapped, so everything else is).",
            {
                "job_swap_bytes": None if not job else round(job[-1]),
                "job_swap_rise_bytes": round(job_rise),
                "machine_swap_used_bytes": None if not machine else machine[-1],
                "machine_swap_rise_bytes": round(machine_rise),
                "memory_pressure_some_avg10": pressure,
                "window_s": cfg.swap_window_s,
                "rise_threshold_bytes": cfg.swap_job_rise_bytes * factor,
            },
        )
    ]
