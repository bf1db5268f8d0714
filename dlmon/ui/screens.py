"""Screens pushed over the dashboard: a worker's detail, the help, and the quit question."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Static

from dlmon.ui.columns import SORTS
from dlmon.ui.fmt import duration
from dlmon.ui.state import ProcessRow, RowKey, ViewContext
from dlmon.ui.text import Line, fit
from dlmon.ui.views import detail_lines
from dlmon.ui.widgets import ChartLine, HeaderBar, LinesView, TimeChart

HELP_TEXT = (
    """\
[b]Keys[/b]
  [b]q[/b] quit              [b]p[/b] pause the view (sampling goes on)
  [b]?[/b] this help         [b]s[/b] save an SVG screenshot (to screenshots/ or here)
  [b]a[/b] advice: num_workers, memory, pin_memory... from what was measured
  [b]1[/b]-[b]7[/b] one panel in full: 1 memory 2 workers 3 GPU 4 IO 5 throughput
      6 alerts 7 logs (dlmon run); the same key again, [b]0[/b] or [b]esc[/b]: all
  [b]tab[/b] [b]shift+tab[/b] next / previous panel   [b]z[/b] the focused panel in full
  [b]ctrl+p[/b] command palette: every action by name
  replay: [b]][/b] next alert   [b],[/b] [b].[/b] one minute back / on

[b]Workers table[/b]
  [b]up down pgup pgdn home end[/b] move   [b]enter[/b] the process's detail, history
  sort: """
    + " ".join(f"[b]{sort.binding}[/b] {sort.help}" for sort in SORTS.values())
    + """
        the same key again or [b]i[/b] reverses; [b]<[/b] [b]>[/b] previous / next
  DDP (torchrun, mp.spawn): each rank is one folded line with its sums;
  [b]space[/b] (or [b]right[/b] / [b]left[/b]) shows / folds its workers

[b]Reading it[/b]
  PSS: a process's fair share of the pages it maps (a page shared by N
  processes counts 1/N in each), so the PSS sum is the job's true total.
  RSS counts shared pages in every process: the RSS sum of forked workers
  double-counts. USS: memory only that process holds.
  [b]~[/b] before a PSS: read more than a few samples ago, and memory in the job
  moved since (PSS is read on a CPU budget; the detail says how long ago).
  [b]\u2013[/b] or [b]n/a[/b]: not measured.
  STATE: run, sleep, disk (waiting on IO), zombie (exited, not reaped),
  gone (no longer there), killed / SIGn / exit n (seen dying by the agent).
"""
)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,question_mark,enter", "dismiss", "Close"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(HELP_TEXT, id="help-text")
        yield Footer()

    def on_mount(self) -> None:
        box = self.query_one("#help-box")
        box.border_title = "dlmon help"
        box.border_subtitle = "esc to close"

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(None)


class AdviceScreen(ModalScreen[None]):
    """``dlmon advise`` inside the dashboard: the seed's sizing rules fed with what was measured."""

    BINDINGS = [
        Binding("escape,a,enter", "dismiss", "Close"),
    ]

    def __init__(self, text: str, *, span_s: float = 0.0, snapshots: int = 0) -> None:
        super().__init__()
        self._text = text
        self.span_s = span_s
        self.snapshots = snapshots

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(escape(self._text), id="advice-text")
        yield Footer()

    def on_mount(self) -> None:
        box = self.query_one("#help-box")
        box.border_title = (
            f"dlmon advice (from the last {duration(self.span_s)} of measurements: "
            f"{self.snapshots} snapshots)"
        )
        box.border_subtitle = "esc to close"

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(None)


QUIT_LEAVE = "leave"
QUIT_STOP = "stop"


class QuitScreen(ModalScreen[str | None]):
    """``dlmon run``: quitting asks whether to stop the training too. Default: leave it running;
    ``dlmon demo`` (``stop_by_default``): stop it, a synthetic training is no one's real job."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("l", "answer('leave')", "Leave it running"),
        Binding("x", "answer('stop')", "Stop the training"),
    ]

    def __init__(self, pid: int, command: str, *, stop_by_default: bool = False) -> None:
        super().__init__()
        self.pid = pid
        self.command = command
        self.default = QUIT_STOP if stop_by_default else QUIT_LEAVE

    def compose(self) -> ComposeResult:
        command = " ".join(self.command.split())
        if len(command) > 200:
            command = command[:199] + "…"
        with Vertical(id="quit-box"):
            yield Static(
                f"Quit dlmon. The training is still running:\n[b]{escape(command)}[/b] (pid {self.pid})\n\n"
                "Leave it running, or stop it too?",
                id="quit-text",
                markup=True,
            )
            with Horizontal(id="quit-buttons"):
                stop = self.default == QUIT_STOP
                leave_label = "Leave it running" + ("" if stop else " (enter)")
                stop_label = "Stop the training" + (" (enter)" if stop else "")
                if stop:
                    yield Button(stop_label, id=QUIT_STOP, variant="error")
                    yield Button(leave_label, id=QUIT_LEAVE, variant="default")
                else:
                    yield Button(leave_label, id=QUIT_LEAVE, variant="primary")
                    yield Button(stop_label, id=QUIT_STOP, variant="error")
                yield Button("Cancel", id="cancel")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#quit-box").border_title = "Quit"
        self.query_one(f"#{self.default}", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id if event.button.id in (QUIT_LEAVE, QUIT_STOP) else None)

    def action_answer(self, answer: str) -> None:
        self.dismiss(answer)

    def action_cancel(self) -> None:
        self.dismiss(None)


@runtime_checkable
class ShowsState(Protocol):
    """A screen that draws the dashboard state: the app hands it every repaint."""

    def show(self, ctx: ViewContext) -> None: ...


class WorkerDetailScreen(Screen[None]):
    """One process's figures and its history; updates live while open (unless paused)."""

    BINDINGS = [Binding("escape,enter", "close", "Back to the dashboard")]

    def __init__(self, key: RowKey) -> None:
        super().__init__()
        self.key = key
        self.row: ProcessRow | None = None

    def compose(self) -> ComposeResult:
        yield HeaderBar(id="detail-header")
        with Vertical(id="detail-body", classes="panel"):
            yield LinesView(id="detail-lines")
            yield TimeChart(unit="MiB", scale=2**20, min_window=300.0, id="detail-memory")
            yield TimeChart(
                unit="CPU %",
                scale=1.0,
                right_unit="read MB/s",
                right_scale=1e6,
                min_window=300.0,
                id="detail-cpu",
            )
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#detail-body").border_title = "Worker detail"

    def show(self, ctx: ViewContext) -> None:
        state, now, interval = ctx.state, ctx.now, ctx.interval
        row = state.rows.get(self.key, self.row)
        if row is None:
            return
        self.row = row
        width = max(20, self.size.width - 4)
        head: Line = fit(
            [
                [(" dlmon ", "title"), (" ", ""), (row.label, "b")],
                [("gone" if row.gone else "live", "dim" if row.gone else "ok")],
                [("esc: back", "key")],
            ],
            self.size.width or 80,
            (" │ ", "dim"),
        )
        self.query_one("#detail-header", HeaderBar).set_lines((head,))
        self.query_one("#detail-body", Vertical).border_title = f"{row.label} · {row.process.comm}"
        self.query_one("#detail-lines", LinesView).set_lines(detail_lines(row, state.latest, width))
        self.query_one("#detail-memory", TimeChart).show(
            [
                ChartLine("PSS", row.pss, "pss"),
                ChartLine("USS", row.uss, "uss"),
                ChartLine("RSS", row.rss, "rss"),
            ],
            now,
            interval,
            ctx.fresh,
        )
        self.query_one("#detail-cpu", TimeChart).show(
            [ChartLine("CPU %", row.cpu, "cpu"), ChartLine("read MB/s", row.read, "read", right=True)],
            now,
            interval,
            ctx.fresh,
        )

    def on_resize(self) -> None:
        refresh = getattr(self.app, "refresh_view", None)
        if callable(refresh):
            self.call_after_refresh(refresh, True)

    def action_close(self) -> None:
        self.dismiss(None)
