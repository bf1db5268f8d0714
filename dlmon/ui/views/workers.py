"""The workers table: the columns a width leaves, its rows, header, caption, rank and stuck lines."""

from __future__ import annotations

from collections.abc import Sequence

from dlmon.analysis.kinds import STALL
from dlmon.model import Alert, RankInfo
from dlmon.ui.columns import COLUMNS, SORTS, Column, Needs
from dlmon.ui.fmt import NA, cbytes, cpct, duration
from dlmon.ui.state import ProcessRow, RankGroup
from dlmon.ui.text import SEP, Line, Span, clip, fit
from dlmon.ui.views.common import rate_text, wait_style


def table_columns(width: int, *, batches: bool, gpu: bool) -> tuple[Column, ...]:
    shown: dict[Needs | None, bool] = {None: True, "batches": batches, "gpu": gpu}
    cols = [c for c in COLUMNS if shown[c.needs]]
    while cols and sum(c.width for c in cols) + len(cols) - 1 > width:
        cols.remove(min(cols, key=lambda c: c.priority))
    return tuple(cols)


def table_cells(row: ProcessRow, cols: Sequence[Column], interval: float | None) -> Line:
    row_style = "dim" if row.gone else ""
    spans: list[Span] = []
    for i, c in enumerate(cols):
        cell = c.cell(row, interval)
        text, style = (cell, row_style) if isinstance(cell, str) else cell
        text = text[: c.width]
        if i:
            spans.append((" ", row_style))
        spans.append((text.rjust(c.width) if c.right else text.ljust(c.width), style))
    return tuple(spans)


def table_header(cols: Sequence[Column], sort: str, reverse: bool) -> Line:
    spans: list[Span] = []
    for i, c in enumerate(cols):
        title = c.title
        style = "head"
        if c.sort is not None and c.key == sort:
            title += "▴" if reverse else "▾"
            style = "sorted"
        title = title[: c.width] if len(title) > c.width else title
        if i:
            spans.append((" ", "head"))
        spans.append((title.rjust(c.width) if c.right else title.ljust(c.width), style))
    return tuple(spans)


def sort_caption(sort: str, reverse: bool, count: int) -> str:
    how = SORTS.get(sort)
    natural = how is not None and how.value is None
    order = "ascending" if reverse else ("natural order" if natural else "descending")
    return f"{count} processes · sorted by {how.name if how is not None else sort} ({order})"


def rank_line(group: RankGroup, expanded: bool, width: int) -> Line:
    """``  ▾ rank 3 (local 1) · 8 workers · PSS 9.08G with its workers · 8.5 batch/s · data wait 25%``
    under a rank (its number when the agent read it from the launcher's environment)."""
    wait = None if group.data_wait_fraction is None else group.data_wait_fraction * 100
    n = len(group.workers)
    owner = group.owner.process
    which = [] if owner.rank is None else [(RankInfo(owner.rank, owner.local_rank).label() + " · ", "b")]
    return fit(
        [
            [("▾ " if expanded else "▸ ", "key"), *which, (f"{n} worker" + ("" if n == 1 else "s"), "b")],
            [("PSS ", "dim"), (cbytes(group.pss_bytes, NA), "b"), (" with its workers", "dim")],
            [(rate_text(group.batches_per_s), ""), (" batch/s", "dim")],
            [("data wait ", "dim"), (f"{cpct(wait, NA)}%", wait_style(wait))],
        ],
        width,
        SEP,
        lead=[("  ", "")],
    )


def stall_of(row: ProcessRow, alerts: Sequence[Alert]) -> Alert | None:
    """The stall alert that names this row's process as the stuck one."""
    for a in alerts:
        if a.kind == STALL and a.evidence.get("pid") == row.process.pid and not row.gone:
            return a
    return None


def stuck_line(row: ProcessRow, alerts: Sequence[Alert], width: int) -> Line | None:
    """``  └ stuck in hang_here (jobs.py:88) for 2.2 min`` under a stuck worker's row."""
    a = stall_of(row, alerts)
    if a is None:
        return None
    where = a.evidence.get("stuck_in")
    secs = a.evidence.get("stalled_s")
    text = f"  └ stuck in {where}" if where else "  └ stuck"
    if isinstance(secs, (int, float)):
        text += f" for {duration(float(secs))}"
    return ((clip(text, width), "crit"),)
