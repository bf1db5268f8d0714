"""What the memory_growth rule says about the job now, for the dashboard's Trend line.

The line shows a trend only when the rule (dlmon/analysis/detectors/memory.py) has found one: its
alert's rate, window and ETA. A slope fitted to the last minutes says "+150 MiB/min" for a
trainer that is loading its dataset, a caching allocator filling up, workers starting: the
warm-up read as a trend. So until the rule's warm-up is over the line says it is waiting, then
"no growth" as long as the rule finds none. (The workers' USS view has no warm-up in the rule:
copy-on-read can raise the alert, and so the line, within the first minute.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dlmon.analysis.detectors._base import DEFAULT_THRESHOLDS, Thresholds
from dlmon.analysis.detectors.memory import MEMORY_GROWTH, MemoryNumbers
from dlmon.model import Alert

GROWING = "growing"
WARMING_UP = "warming_up"
NO_GROWTH = "no_growth"


@dataclass(frozen=True, slots=True)
class GrowthReading:
    state: str  # GROWING, WARMING_UP or NO_GROWTH
    rate_bytes_per_s: float | None = None  # GROWING: the rule's robust slope
    eta_s: float | None = None  # GROWING: until the limit (None: levels off below it, or no limit)
    fits: bool | None = None  # GROWING: the growth levels off below the limit (copy-on-read)
    window_s: float | None = None  # GROWING: the window in which the rule found it
    warmup_left_s: float | None = None  # WARMING_UP: seconds until the rule may raise any view


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def growth_reading(
    alerts: Iterable[Alert], watched_s: float | None, config: Thresholds | None = None
) -> GrowthReading:
    """``watched_s``: how long the job has been watched (the rule's warm-up counts from its first
    reading); None when unknown."""
    cfg = (config or DEFAULT_THRESHOLDS).of(MemoryNumbers)
    for alert in alerts:
        if alert.kind == MEMORY_GROWTH:
            e = alert.evidence
            fits = e.get("fits")
            return GrowthReading(
                GROWING,
                _number(e.get("rate_bytes_per_s")),
                _number(e.get("eta_s")),
                fits if isinstance(fits, bool) else None,
                _number(e.get("window_s")),
            )
    if watched_s is None or watched_s < cfg.growth_warmup_s:
        left = None if watched_s is None else cfg.growth_warmup_s - max(0.0, watched_s)
        return GrowthReading(WARMING_UP, warmup_left_s=left)
    return GrowthReading(NO_GROWTH)
