"""The alerts panel: the alerts worst first, the exit verdict, the analyzer's failures."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from dlmon.analysis.verdict import exit_verdict
from dlmon.model import Alert
from dlmon.ui.fmt import duration
from dlmon.ui.state import DashboardState
from dlmon.ui.text import BAR, Line, Lines, clip, fit, truncate, width_of, wrap
from dlmon.ui.views.common import SEVERITY_STYLE, SEVERITY_WORD, label, severity_order


def sorted_alerts(alerts: Sequence[Alert]) -> list[Alert]:
    return sorted(alerts, key=lambda a: (severity_order(a.severity), a.since))


def alert_lines(state: DashboardState, width: int, compact: bool, panel_key: str = "6") -> Lines:
    s = state.latest
    alerts = sorted_alerts(s.alerts) if s is not None else []
    if compact:
        lead = [label("ALERT", 6)]
        if not alerts:
            n = state.analysis_errors
            note: Line = ((f" · analysis failed {n} times [{panel_key}]", "dim"),) if n else ()
            return (truncate((*lead, ("none", "dim"), *note), width),)
        counts: dict[str, int] = {}
        for a in alerts:
            counts[a.severity] = counts.get(a.severity, 0) + 1
        first = alerts[0]
        worst_first = sorted(counts.items(), key=lambda kv: severity_order(kv[0]))
        summary = ", ".join(f"{n} {sev}" for sev, n in worst_first)
        head = fit(
            [[(summary, SEVERITY_STYLE.get(first.severity, ""))], [(f"{first.kind}: {first.subject}", "b")]],
            width - 6,
            BAR,
            lead=lead,
        )
        rest = width - 6 - width_of(head) - 3
        if rest > 8:
            head = (*head, BAR, (clip(first.message, rest), ""))
        return ((*head, (f" [{panel_key}]", "key")),)
    failed = analysis_failed_lines(state, width)
    if not alerts:
        return ((("no alerts", "dim"),), *failed)
    assert s is not None
    out: list[Line] = []
    verdict = exit_verdict(s, None) if not s.target.alive else None
    if verdict is not None:  # the final frame says how it ended, until the user quits
        for chunk in textwrap.wrap(verdict, max(10, width)):
            out.append(((chunk, "crit"),))
    for a in alerts:
        sev = SEVERITY_WORD.get(a.severity, a.severity.upper()[:4])
        since = duration(s.time - a.since)
        title: Line = (
            (sev.ljust(5), SEVERITY_STYLE.get(a.severity, "")),
            (f"{a.kind} ", "b"),
            (f"{a.subject}", ""),
            (f" (for {since})", "dim"),
        )
        out.append(truncate(title, width))
        for chunk in textwrap.wrap(a.message, max(10, width - 5)):
            out.append(((" " * 5, ""), (chunk, "")))
        for k, chunk in enumerate(textwrap.wrap(a.advice, max(10, width - 7))):
            out.append(((" " * 5, ""), ("→ " if k == 0 else "  ", "key"), (chunk, "dim")))
    return (*out, *failed)


def analysis_failed_lines(state: DashboardState, width: int) -> Lines:
    """``analysis failed 3 times (last: ValueError: ...)``: a detector that raised adds nothing
    that tick, so its alerts may be missing; said dimly under the alerts, never hidden."""
    n = state.analysis_errors
    if n <= 0:
        return ()
    times = "once" if n == 1 else f"{n} times"
    last = f" (last: {state.analysis_error})" if state.analysis_error else ""
    text = f"analysis failed {times}{last}; alerts from the failing detector may be missing"
    return wrap(text, width, "dim")
