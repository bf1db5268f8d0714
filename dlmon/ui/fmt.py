"""Compact figures for table cells and one-line summaries (no UI imports).

Missing values never become 0: table cells show an en dash, summaries ``n/a`` (as ``dlmon.model.format``).
"""

from __future__ import annotations

import math
import time

from dlmon.model.format import human_bytes, human_rate, percent

__all__ = [
    "DASH",
    "NA",
    "cbytes",
    "clock",
    "cpct",
    "duration",
    "human_bytes",
    "human_rate",
    "mbps",
    "percent",
    "ratio",
]

DASH = "\u2013"  # a missing table cell (an en dash)
NA = "n/a"  # a missing figure in running text

_COMPACT_UNITS = ("B", "K", "M", "G", "T", "P")


def cbytes(value: float | None, missing: str = DASH) -> str:
    """Bytes in at most 6 cells, binary units: ``512B``, ``12.3M``, ``123M``, ``1.23G``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    size = float(value)
    sign = "-" if size < 0 else ""
    size = abs(size)
    for unit in _COMPACT_UNITS:
        if size < 1000 or unit == _COMPACT_UNITS[-1]:
            if unit == "B":
                return f"{sign}{size:.0f}B"
            if size < 9.995:
                return f"{sign}{size:.2f}{unit}"
            if size < 99.95:
                return f"{sign}{size:.1f}{unit}"
            return f"{sign}{size:.0f}{unit}"
        size /= 1024
    raise AssertionError("unreachable")


def mbps(bytes_per_s: float | None, missing: str = DASH) -> str:
    """A rate in decimal MB/s without the unit (the column header says it)."""
    if bytes_per_s is None:
        return missing
    value = bytes_per_s / 1e6
    if value < 9.95:
        return f"{value:.1f}"
    return f"{value:.0f}"


def cpct(value: float | None, missing: str = DASH, digits: int = 0) -> str:
    """A percentage without the sign (the header says it)."""
    if value is None:
        return missing
    return f"{value:.{digits}f}"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def clock(unix_time: float) -> str:
    """``14:02:11``, local time."""
    return time.strftime("%H:%M:%S", time.localtime(unix_time))


def duration(seconds: float | None, missing: str = NA) -> str:
    """``45s``, ``12m03s``, ``1h02m``, ``3d04h``."""
    if seconds is None or seconds != seconds:
        return missing
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"
