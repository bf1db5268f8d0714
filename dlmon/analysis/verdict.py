"""The line dlmon ends with when the training ends: who died, how, and why. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from dlmon.analysis.detectors.registry import CAUSE_ORDER
from dlmon.analysis.severity import SEVERITY_RANK
from dlmon.model import Alert, Snapshot


def _first_sentence(alert: Alert) -> str:
    text = alert.message.rstrip()
    return text[:-1] if text.endswith(".") else text


def _lowered(text: str) -> str:
    first, _, rest = text.partition(" ")
    return f"{first.lower()} {rest}" if first in ("The", "A", "An") else text


def exit_verdict(last: Snapshot | None, exit_code: int | None) -> str | None:
    """``training exited 1: DataLoader worker 2 (pid 4242) was killed by the kernel OOM killer ...``.

    ``last`` is the final analysed snapshot (with its alerts); ``exit_code`` the training's exit
    status when dlmon started it (None when attached). None when the target is still running.
    """
    if last is None:
        return None
    if last.target.alive and exit_code is None:
        return None
    code = exit_code if exit_code is not None else last.target.exit_code
    head = f"training exited {code}" if code is not None else f"training (pid {last.target.pid}) exited"
    causes = _causes(last.alerts)
    if not causes:
        if code in (None, 0):
            return None
        return f"{head}; dlmon saw no worker die, no OOM kill and no stall before it (see the training log)."
    first, *rest = causes
    text = f"{head}: {_lowered(_first_sentence(first))}"
    if rest:
        more = "; ".join(_lowered(_first_sentence(a)) for a in rest[:3])
        text += f". Also: {more}"
    return text + "."


def _causes(alerts: Sequence[Alert]) -> list[Alert]:
    """The alerts that explain an end: deaths first (earliest death first), then stalls, orphans."""

    def order(a: Alert) -> tuple[int, int, float]:
        rank = CAUSE_ORDER.index(a.kind)
        when = a.evidence.get("time")
        at = float(when) if isinstance(when, (int, float)) else a.since
        return (rank, -SEVERITY_RANK.get(a.severity, 0), at)

    found = [a for a in alerts if a.kind in CAUSE_ORDER]
    found.sort(key=order)
    # a worker death explains a trainer that raised; the trainer's own death comes first only if killed
    return found
