"""The main screen's panels: each composes its own views and draws itself from the state.

``MainScreen.show`` hands every visible panel the same :class:`~dlmon.ui.state.ViewContext` and
how it is shown (one line on a small terminal, in full when zoomed); what a panel says comes
from the pure functions of ``dlmon.ui.views``.
"""

from __future__ import annotations

import os
from collections.abc import Reversible

from textual.app import ComposeResult
from textual.widget import Widget

from dlmon.ui.fmt import human_bytes
from dlmon.ui.state import ViewContext
from dlmon.ui.views import (
    alert_lines,
    gpu_lines,
    io_lines,
    memory_chart_plan,
    memory_lines,
    throughput_lines,
)
from dlmon.ui.widgets import ChartLine, LinesView, LogView, Panel, TimeChart, WorkerTable

OVERVIEW_ROWS = 3  # GPUs, disks, loaders shown in full in the overview; more collapse to "+N more"


class StatePanel(Panel):
    """A panel drawn from the dashboard state at every repaint."""

    def show(self, ctx: ViewContext, compact: bool, zoomed: bool) -> None:
        raise NotImplementedError

    def lines_width(self, view: Widget) -> int:
        return view.size.width or self.screen.size.width or 80


class MemoryPanel(StatePanel):
    def __init__(self) -> None:
        super().__init__("Memory", "1", id="memory")

    def compose(self) -> ComposeResult:
        yield LinesView(id="memory-lines")
        yield TimeChart(unit="GiB", scale=2**30, zero_based=False, id="memory-chart")

    def show(self, ctx: ViewContext, compact: bool, zoomed: bool) -> None:
        state = ctx.state
        view = self.query_one("#memory-lines", LinesView)
        view.set_lines(memory_lines(state, self.lines_width(view), compact and not zoomed))
        chart = self.query_one("#memory-chart", TimeChart)
        if chart.display:
            plan = memory_chart_plan(state)
            chart.unit, chart.scale = plan.unit, plan.scale
            lines = [ChartLine("job PSS", state.pss_sum, "pss")]
            if plan.anon:
                lines.append(ChartLine("job anon", state.pss_anon_sum, "anon"))
            if plan.limit:
                lines.append(ChartLine("cgroup limit", state.limit, "limit"))
            chart.show(lines, ctx.now, ctx.interval, ctx.fresh)


class WorkersPanel(StatePanel):
    def __init__(self) -> None:
        super().__init__("Workers", "2", id="workers", focusable=False)

    def compose(self) -> ComposeResult:
        yield WorkerTable(id="table")

    @property
    def table(self) -> WorkerTable:
        return self.query_one("#table", WorkerTable)

    def show(self, ctx: ViewContext, compact: bool, zoomed: bool) -> None:
        table = self.table
        table.show(ctx.state, ctx.interval)
        self.set_caption(table.caption)

    def set_sort(self, sort: str, reverse: bool | None = None) -> None:
        table = self.table
        table.set_sort(sort, reverse)
        self.set_caption(table.caption)


class GpuPanel(StatePanel):
    def __init__(self) -> None:
        super().__init__("GPU", "3", id="gpu")

    def compose(self) -> ComposeResult:
        yield LinesView(id="gpu-lines")

    def show(self, ctx: ViewContext, compact: bool, zoomed: bool) -> None:
        view = self.query_one("#gpu-lines", LinesView)
        rows = None if zoomed else OVERVIEW_ROWS
        view.set_lines(
            gpu_lines(ctx.state, self.lines_width(view), compact and not zoomed, zoomed, rows=rows)
        )


class IoPanel(StatePanel):
    def __init__(self) -> None:
        super().__init__("IO", "4", id="io")

    def compose(self) -> ComposeResult:
        yield LinesView(id="io-lines")

    def show(self, ctx: ViewContext, compact: bool, zoomed: bool) -> None:
        view = self.query_one("#io-lines", LinesView)
        rows = None if zoomed else OVERVIEW_ROWS
        view.set_lines(io_lines(ctx.state, self.lines_width(view), compact and not zoomed, rows=rows))


class ThroughputPanel(StatePanel):
    def __init__(self) -> None:
        super().__init__("Throughput", "5", id="throughput")

    def compose(self) -> ComposeResult:
        yield LinesView(id="throughput-lines")
        yield TimeChart(
            unit="batch/s", scale=1.0, right_unit="wait %", id="throughput-chart", classes="-nodata"
        )

    def show(self, ctx: ViewContext, compact: bool, zoomed: bool) -> None:
        state = ctx.state
        view = self.query_one("#throughput-lines", LinesView)
        rows = None if zoomed else OVERVIEW_ROWS
        view.set_lines(throughput_lines(state, self.lines_width(view), compact and not zoomed, rows=rows))
        chart = self.query_one("#throughput-chart", TimeChart)
        loaders = state.live_loaders()[:2]
        chart.set_class(not loaders, "-nodata")
        if loaders and chart.size.height:
            lines: list[ChartLine] = []
            kinds = (("rate", "wait"), ("rate-2", "wait-2"))
            for hist, (rate, wait) in zip(loaders, kinds[: len(loaders)], strict=True):
                name = f" {hist.loader.label}" if len(loaders) > 1 else ""
                lines.append(ChartLine(f"batch/s{name}", hist.batches_per_s, rate))
                lines.append(ChartLine(f"data wait %{name}", hist.data_wait_percent, wait, right=True))
            chart.show(lines, ctx.now, ctx.interval, ctx.fresh)


class AlertsPanel(StatePanel):
    def __init__(self) -> None:
        super().__init__("Alerts", "6", id="alerts")

    def compose(self) -> ComposeResult:
        yield LinesView(id="alerts-lines")

    def show(self, ctx: ViewContext, compact: bool, zoomed: bool) -> None:
        view = self.query_one("#alerts-lines", LinesView)
        view.set_lines(alert_lines(ctx.state, self.lines_width(view), compact and not zoomed))
        latest = ctx.state.latest
        alerts = len(latest.alerts) if latest is not None else 0
        self.set_caption(f"{alerts} active" if alerts else None)


class LogsPanel(Panel):
    """The training's output: drawn from the app's bounded log buffer, not from snapshots."""

    def __init__(self) -> None:
        super().__init__("Logs", "7", id="logs")

    def compose(self) -> ComposeResult:
        yield LogView(id="log")

    def show_log(self, lines: Reversible[str], progress: str, size: int | None, path: str | None) -> None:
        """The newest lines that fit (cheap: the view gets one screenful, never the backlog)."""
        view = self.query_one("#log", LogView)
        view.show(lines, progress, view.size.width or self.screen.size.width or 80)
        if size is not None:
            caption = f"{human_bytes(size)} on disk (dlmon never truncates it)"
            if path is not None:
                caption = f"{os.path.basename(path)} · {caption}"
            self.set_caption(caption)
