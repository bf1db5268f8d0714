"""Alert transitions for headless mode: what was raised, escalated or cleared since last tick."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from dlmon.analysis.severity import SEVERITY_RANK
from dlmon.model import Alert

RAISED = "raised"
ESCALATED = "escalated"  # same alert, higher severity
CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class AlertEvent:
    action: str  # "raised" | "escalated" | "cleared"
    alert: Alert  # for "cleared", the alert as it was last shown
    previous_severity: str | None = None  # for "escalated"


def _key(alert: Alert) -> tuple[str, str]:
    return alert.kind, alert.subject


def events(previous_alerts: Sequence[Alert], current_alerts: Sequence[Alert]) -> list[AlertEvent]:
    """Compare two ticks' alerts (an alert is its kind and subject): raised and escalated ones in
    the order of ``current_alerts``, then cleared ones in the order of ``previous_alerts``."""
    before = {_key(a): a for a in previous_alerts}
    now = {_key(a) for a in current_alerts}
    out: list[AlertEvent] = []
    for alert in current_alerts:
        old = before.get(_key(alert))
        if old is None:
            out.append(AlertEvent(RAISED, alert))
        elif SEVERITY_RANK.get(alert.severity, 0) > SEVERITY_RANK.get(old.severity, 0):
            out.append(AlertEvent(ESCALATED, alert, old.severity))
    out.extend(AlertEvent(CLEARED, a) for a in previous_alerts if _key(a) not in now)
    return out


def format_event(event: AlertEvent, at: float | None = None, with_advice: bool = True) -> str:
    """One line (two with advice) for stderr, e.g.
    ``12:00:03 RAISED warning memory_growth job (pid 42): The job's memory ...``.
    ``at``: the time to print (the snapshot's); a raised alert's ``since`` by default."""
    a = event.alert
    stamp = time.strftime("%H:%M:%S", time.localtime(a.since if at is None else at))
    if event.action == CLEARED:
        return f"{stamp} CLEARED {a.kind} {a.subject}"
    change = f" (was {event.previous_severity})" if event.previous_severity else ""
    line = f"{stamp} {event.action.upper()} {a.severity}{change} {a.kind} {a.subject}: {a.message}"
    if with_advice and a.advice:
        line += f"\n    advice: {a.advice}"
    return line
