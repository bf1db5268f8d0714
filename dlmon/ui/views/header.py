"""The header bar: the job, its uptime, the alert count, the host and the clock."""

from __future__ import annotations

import time
from dataclasses import dataclass

from dlmon.analysis.kinds import SEVERITY_RANK
from dlmon.model.format import target_stopped
from dlmon.ui.fmt import duration
from dlmon.ui.state import DashboardState
from dlmon.ui.text import BAR, Line, Span, clip, width_of
from dlmon.ui.views.common import SEVERITY_STYLE


@dataclass(frozen=True, slots=True)
class HeaderInfo:
    description: str
    live: bool
    paused: bool
    now: float
    boot_time: float | None
    clock_ticks: int
    interval: float | None
    stale_after: float | None  # seconds without a snapshot before the header says so


def header_line(state: DashboardState, info: HeaderInfo, width: int) -> Line:
    s = state.latest
    left: list[Span] = [(" dlmon ", "title"), (" ", "")]
    right: list[list[Span]] = []
    if info.paused:
        right.append([("PAUSED", "warn")])
    if s is None:
        body = "waiting for the first sample of " + info.description
        if state.end_reason is not None:
            body = f"no data: the source ended ({state.end_reason})"
        return (*left, (clip(body, width - 8), "dim"))
    t = s.target
    if not t.alive:
        code = f"code {t.exit_code}" if t.exit_code is not None else "code unknown"
        right.append([(f"target exited ({code})", "crit")])
    else:
        uptime = None
        if t.start_unix_time is not None:
            uptime = s.time - t.start_unix_time
        elif info.boot_time is not None and t.start_time is not None:  # recordings made before it
            uptime = s.time - (info.boot_time + t.start_time / info.clock_ticks)
        right.append([("up ", "dim"), (duration(uptime), "")])
        if target_stopped(s):  # SIGSTOP or ^Z: alive, but no progress until SIGCONT
            right.insert(-1, [("target stopped", "warn")])
    right.append([(f"pid {t.pid}", "")])
    n = len(s.alerts)
    worst = max(s.alerts, key=lambda a: SEVERITY_RANK.get(a.severity, -1), default=None)
    alert_style = "dim" if worst is None else SEVERITY_STYLE.get(worst.severity, "dim")
    right.append([(f"{n} alert" + ("" if n == 1 else "s"), alert_style if n else "dim")])
    if not info.live:
        right.append([("replay", "warn")])
    if state.end_reason is not None and t.alive:
        right.append([(f"ended: {state.end_reason}", "warn")])
    elif info.stale_after is not None and t.alive and info.now - s.time > info.stale_after:
        right.append([(f"no data for {duration(info.now - s.time)}", "warn")])
    gpus = sum(1 for g in s.gpus if g.mig_index is None)  # cards: MIG devices are slices of one
    right.append([(f"{gpus} GPU" + ("" if gpus == 1 else "s"), "" if gpus else "dim")])
    right.append([(s.host, "")])
    right.append([(time.strftime("%H:%M:%S", time.localtime(s.time)), "dim")])

    # the command takes what the figures leave, but at least 12 cells
    avail = width - width_of(left)
    parts: list[list[Span]] = []
    used = 0
    for part in right:
        need = width_of(part) + 3
        if used + need > avail - 12:
            break
        parts.append(part)
        used += need
    cmd = clip(" ".join((t.cmdline or info.description).split()), max(1, avail - used - 1))
    out: list[Span] = [*left, (cmd, "b")]
    for part in parts:
        out.append(BAR)
        out.extend(part)
    return tuple(out)
