"""What the panels share: the style names, the label span, severity words and figure formats."""

from __future__ import annotations

from dlmon.analysis.kinds import SEVERITIES, SEVERITY_RANK
from dlmon.ui.fmt import NA, cbytes, human_bytes
from dlmon.ui.text import Span

STYLES = (
    *("b", "label", "dim", "ok", "warn", "crit", "head", "sorted", "title", "key", "stale"),
    *("cursor", "cursor-blur"),
)
# worst first, for sorting (critical 0, warning 1, info 2): analysis.kinds.SEVERITY_RANK turned round
SEVERITY_ORDER = {severity: max(SEVERITY_RANK.values()) - rank for severity, rank in SEVERITY_RANK.items()}
SEVERITY_STYLE = {"critical": "crit", "warning": "warn", "info": "dim"}
SEVERITY_WORD = {"critical": "CRIT", "warning": "WARN", "info": "INFO"}
# a severity added to analysis.kinds needs its style and its word here
assert set(SEVERITY_STYLE) == set(SEVERITY_WORD) == set(SEVERITIES), "severities without a style or a word"


def severity_order(severity: str) -> int:
    """The sort key of ``severity``, worst first; one this dlmon does not know sorts last."""
    return SEVERITY_ORDER.get(severity, len(SEVERITY_RANK))


def label(text: str, width: int) -> Span:
    return (text.ljust(width), "label")


def used_of(used: int | None, total: int | None, compact: bool) -> str:
    f = cbytes if compact else human_bytes
    if total is None:
        return f(used)
    return f"{f(used)}/{f(total)}" if compact else f"{human_bytes(used)} of {human_bytes(total)}"


def rate_text(v: float | None) -> str:
    if v is None:
        return NA
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def wait_style(v: float | None) -> str:
    return "" if v is None else "crit" if v > 50 else "warn" if v > 20 else "ok"
