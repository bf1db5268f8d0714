"""The dashboard app: one factory for the CLI and the tests, one render path for every source.

Data flow: the source samples on its own thread and hands each immutable Snapshot to
``post_message`` (thread-safe). On the UI thread the message is ingested into the bounded
:class:`~dlmon.ui.state.DashboardState` at once, whatever the view is doing, and one render is
scheduled: a burst of snapshots (a replay) costs one repaint. Pausing, a modal, or a detail
screen only stop the main panels from repainting; nothing is lost and the newest snapshot is
shown when they come back.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer

from dlmon.flow.sources import AgentLoader, HasFaults, Injectable, Paced, Seekable, Source
from dlmon.model import Snapshot
from dlmon.model.format import children_left
from dlmon.ui.columns import SORT_ORDER, SORTS
from dlmon.ui.logtail import LogTail
from dlmon.ui.panels import (
    AlertsPanel,
    GpuPanel,
    IoPanel,
    LogsPanel,
    MemoryPanel,
    StatePanel,
    ThroughputPanel,
    WorkersPanel,
)
from dlmon.ui.rank_filter import only_rank
from dlmon.ui.result import DashboardResult
from dlmon.ui.screens import QUIT_STOP, AdviceScreen, HelpScreen, QuitScreen, ShowsState, WorkerDetailScreen
from dlmon.ui.state import DashboardState, ViewContext
from dlmon.ui.svg import save_svg
from dlmon.ui.views import HeaderInfo, header_line
from dlmon.ui.widgets import HeaderBar, Panel, WorkerTable

PANELS: tuple[tuple[str, str, str], ...] = (
    ("1", "memory", "Memory"),
    ("2", "workers", "Workers"),
    ("3", "gpu", "GPU"),
    ("4", "io", "IO"),
    ("5", "throughput", "Throughput"),
    ("6", "alerts", "Alerts"),
    ("7", "logs", "Logs"),
)
TOP_PANELS = frozenset({"memory", "gpu", "io", "throughput"})  # the panels in #top (all but memory in #side)
LOG_POLL_S = 1.0
MIN_RENDER_GAP_S = 0.25  # a fast interval (or a replay) repaints at most 4 times a second
LOG_KEEP = 2000  # lines of the training's output kept in memory (shown or not)
LOG_LINE_KEEP = 4096  # characters kept of each (wider than any terminal): 2,000 x 200 KB lines is 400 MB
LOG_BIG = 1 << 30  # the log file's size turns to a warning past this (dlmon never truncates it)


class SnapshotArrived(Message):
    """A new snapshot from the source (posted from the sampling thread, or by a test)."""

    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__()
        self.snapshot = snapshot


class Sought(Message):
    """A replay jumped (seek, next alert): the history starts again from ``time``."""

    def __init__(self, time: float) -> None:
        super().__init__()
        self.time = time


class SourceEnded(Message):
    def __init__(self, reason: str) -> None:
        super().__init__()
        self.reason = reason


class AgentLoadEnded(Message):
    """The load of the agent the user asked for is over: ``why`` it failed, None if it serves."""

    def __init__(self, why: str | None) -> None:
        super().__init__()
        self.why = why


class MainScreen(Screen[None]):
    """All panels at once, collapsing to one-liners on small terminals; one panel in full on demand."""

    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (36, "-tall"), (48, "-taller")]

    BINDINGS = [
        Binding("tab", "next_panel", "Next panel", show=False),
        Binding("shift+tab", "next_panel(-1)", "Previous panel", show=False),
        *(Binding(key, f"panel('{pid}')", title, show=False) for key, pid, title in PANELS),
        Binding("0,escape", "overview", "All panels", show=False),
        Binding("z", "zoom", "Zoom panel", show=False),
        *(Binding(s.binding, f"sort('{key}')", s.description, show=False) for key, s in SORTS.items()),
        Binding("i", "invert_sort", "Reverse sort (load the agent, while offered)", show=False),
        Binding("greater_than_sign", "sort_step(1)", "Next sort column", show=False),
        Binding("less_than_sign", "sort_step(-1)", "Previous sort column", show=False),
    ]

    def __init__(self, has_logs: bool) -> None:
        super().__init__(id="main")
        self.has_logs = has_logs
        self.zoomed: str | None = None
        self._panels: tuple[StatePanel, ...] = ()  # composed once: a query per frame cost ~6% of the UI

    @property
    def dlmon(self) -> DlmonApp:
        app = self.app
        assert isinstance(app, DlmonApp)
        return app

    def compose(self) -> ComposeResult:
        yield HeaderBar(id="header")
        with Vertical(id="body"):
            with Horizontal(id="top"):
                yield MemoryPanel()
                with Vertical(id="side"):
                    yield GpuPanel()
                    yield IoPanel()
                    yield ThroughputPanel()
            yield WorkersPanel()
            yield AlertsPanel()
            if self.has_logs:
                yield LogsPanel()
        yield Footer()

    def on_mount(self) -> None:
        self._panels = tuple(self.query(StatePanel))
        self._apply_zoom()
        self.query_one("#table", WorkerTable).focus()
        self.dlmon.screen_ready()

    def on_resize(self) -> None:
        # widths changed (and maybe the breakpoint classes): re-lay the lines after the layout
        self.call_after_refresh(self.dlmon.refresh_view, True)

    # ---- drawing ----------------------------------------------------------------------------
    @property
    def compact(self) -> bool:
        return self.has_class("-short") or self.has_class("-narrow")

    def show(self, ctx: ViewContext) -> None:
        """Every visible panel draws itself from the same context."""
        width = self.size.width or 80
        header = header_line(ctx.state, self.dlmon.header_info(ctx), width)
        self.query_one("#header", HeaderBar).set_lines((header,))
        compact = self.compact
        for panel in self._panels:
            if self.zoomed is None or self.zoomed == panel.id:
                panel.show(ctx, compact, self.zoomed == panel.id)
        if self.has_logs and (self.zoomed is None or self.zoomed == "logs"):
            self.show_log()

    def show_log(self) -> None:
        app = self.dlmon
        path = app.log_tail.path if app.log_tail is not None else None
        self.query_one(LogsPanel).show_log(app.log_lines, app.log_progress, app.log_size, path)

    # ---- panels -----------------------------------------------------------------------------
    def panel_ids(self) -> list[str]:
        return [pid for _, pid, _ in PANELS if pid != "logs" or self.has_logs]

    def _apply_zoom(self) -> None:
        """The layout is the stylesheet's: classes say which panel is zoomed and which of the
        containers hold it (dlmon.tcss hides the rest)."""
        zoomed = self.zoomed
        self.set_class(zoomed is not None, "-zoomed")
        self.set_class(zoomed in TOP_PANELS, "-zoom-top")
        self.set_class(zoomed in TOP_PANELS - {"memory"}, "-zoom-side")
        for pid in self.panel_ids():
            self.query_one(f"#{pid}", Panel).set_class(pid == zoomed, "-zoom")

    def zoom(self, panel_id: str | None) -> None:
        if panel_id is not None and panel_id not in self.panel_ids():
            self.dlmon.notify(f"no {panel_id} panel here", severity="warning")
            return
        self.zoomed = panel_id
        self._apply_zoom()
        if panel_id == "workers" or (panel_id is None and self.focused is None):
            self.query_one("#table", WorkerTable).focus()
        elif panel_id is not None:
            self.query_one(f"#{panel_id}", Panel).focus()
        self.call_after_refresh(self.dlmon.refresh_view, True)

    def focused_panel(self) -> str | None:
        node = self.focused
        while node is not None:
            if isinstance(node, Panel):
                return node.id
            parent = node.parent
            node = parent if isinstance(parent, Widget) else None
        return None

    def action_panel(self, panel_id: str) -> None:
        self.zoom(None if self.zoomed == panel_id else panel_id)

    def action_overview(self) -> None:
        if self.zoomed is not None:
            self.zoom(None)

    def action_zoom(self) -> None:
        current = self.focused_panel()
        self.zoom(None if self.zoomed is not None else current)

    def action_next_panel(self, step: int = 1) -> None:
        ids = self.panel_ids()
        if self.zoomed is not None:
            i = ids.index(self.zoomed)
            self.zoom(ids[(i + step) % len(ids)])
            return
        on_screen = ids
        current = self.focused_panel()
        i = on_screen.index(current) if current in on_screen else -1
        target = on_screen[(i + step) % len(on_screen)]
        if target == "workers":
            self.query_one("#table", WorkerTable).focus()
        else:
            self.query_one(f"#{target}", Panel).focus()

    # ---- sorting ----------------------------------------------------------------------------
    def action_sort(self, key: str) -> None:
        self.query_one(WorkersPanel).set_sort(key)

    def action_invert_sort(self) -> None:
        """``i``: loads the agent while the Throughput panel offers it on the screen; else, and
        zoomed into another panel, where the offer is not shown, reverses the workers table."""
        if self.dlmon.agent_offered() and self.zoomed in (None, "throughput"):
            self.dlmon.load_agent()  # the Throughput panel says "press i to load the agent"
            return
        self.reverse_sort()

    def reverse_sort(self) -> None:
        workers = self.query_one(WorkersPanel)
        workers.set_sort(workers.table.sort, not workers.table.reverse)

    def action_sort_step(self, step: int) -> None:
        workers = self.query_one(WorkersPanel)
        sort = workers.table.sort
        i = SORT_ORDER.index(sort) if sort in SORT_ORDER else 0
        workers.set_sort(SORT_ORDER[(i + step) % len(SORT_ORDER)], False)

    def on_worker_table_opened(self, message: WorkerTable.Opened) -> None:
        self.dlmon.open_detail(message.key)


class DlmonApp(App[DashboardResult]):
    """The dlmon dashboard. Build it with :func:`dlmon.ui.create_app`."""

    CSS_PATH = "dlmon.tcss"
    TITLE = "dlmon"
    ENABLE_COMMAND_PALETTE = True

    BINDINGS = [
        Binding("q", "request_quit", "Quit"),
        Binding("ctrl+c", "request_quit", "Quit", show=False, priority=True),
        Binding("p", "toggle_pause", "Pause"),
        Binding("question_mark", "help", "Help"),
        Binding("s", "save_svg", "Screenshot"),
        Binding("a", "advice", "Advice"),
        Binding("right_square_bracket", "next_alert", "Next alert (replay)", show=False),
        Binding("full_stop", "seek(60)", "1 min on (replay)", show=False),
        Binding("comma", "seek(-60)", "1 min back (replay)", show=False),
    ]

    def __init__(
        self,
        source: Source,
        *,
        interval: float | None = None,
        clock: Callable[[], float] = time.time,
        ask_stop_on_quit: bool = False,
        boot_time: float | None = None,
        stop_by_default: bool = False,
        rank: int | None = None,
    ) -> None:
        super().__init__()
        self.rank = rank
        self.stop_by_default = stop_by_default
        self.source = source
        self.clock = clock
        self.ask_stop_on_quit = ask_stop_on_quit
        if interval is None and isinstance(source, Paced):
            interval = float(source.interval)
        self.interval = interval
        self.boot_time = boot_time
        self.clock_ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.state = DashboardState(rank=self.rank)
        # a job without the agent that dlmon could load it into (`dlmon attach`): offered on screen
        self.agent_loader: AgentLoader | None = (
            source.agent_loader if isinstance(source, Injectable) else None
        )
        self._agent_loading = False
        if self.agent_loader is not None:
            self.state.agent_offer = self.agent_loader.offer
        self.paused = False
        self.renders = 0  # how many times the panels were redrawn (tests, benchmarks)
        self.screenshots: list[str] = []
        self.log_tail = LogTail(source.log_path) if source.log_path else None
        self.log_lines: deque[str] = deque(maxlen=LOG_KEEP)  # bounded whether the pane is shown or not
        self.log_progress = ""  # the unfinished last line: a tqdm bar redrawn with \r
        self.log_size: int | None = None
        self._render_pending = False
        self._last_render = 0.0
        self._stale_shown = False
        self._started = False
        self._charts_due = False  # the next repaint draws the charts up to the newest data
        self._faults_seen: tuple[int, str | None] = (0, None)  # failed samples, record stop, last shown

    # ---- lifecycle --------------------------------------------------------------------------
    def get_default_screen(self) -> Screen[None]:
        return MainScreen(has_logs=self.log_tail is not None)

    @property
    def main_screen(self) -> MainScreen:
        screen = self.screen_stack[0]
        assert isinstance(screen, MainScreen)
        return screen

    def screen_ready(self) -> None:
        """The main screen is composed: draw the first frame, then start the source."""
        if self._started:
            return
        self._started = True
        self.refresh_view(True)
        self.set_interval(max(2.0, 2 * (self.interval or 1.0)), self._check_stale)
        if self.log_tail is not None:
            self._poll_log()
            self.set_interval(LOG_POLL_S, self._poll_log)
        if isinstance(self.source, Seekable):
            self.source.on_seek = self._sought
        self.source.start(self._deliver, self._ended)

    def on_unmount(self) -> None:
        # joining the sampling thread can take a tick: never on the UI thread
        threading.Thread(target=self.source.stop, name="dlmon-stop", daemon=True).start()

    # ---- data in (any thread) ---------------------------------------------------------------
    def _deliver(self, snapshot: Snapshot) -> None:
        with contextlib.suppress(RuntimeError):  # the app closed under us: nothing to show it on
            self.post_message(SnapshotArrived(snapshot))

    def _sought(self, when: float) -> None:
        with contextlib.suppress(RuntimeError):
            self.post_message(Sought(when))

    def _ended(self, reason: str) -> None:
        with contextlib.suppress(RuntimeError):
            self.post_message(SourceEnded(reason))

    # ---- data in (UI thread) ----------------------------------------------------------------
    def on_snapshot_arrived(self, message: SnapshotArrived) -> None:
        snapshot = message.snapshot
        if self.rank is not None:
            snapshot = only_rank(snapshot, self.rank)
        self.state.ingest(snapshot)  # with the analyzer's failure count, which each snapshot carries
        ended = not snapshot.target.alive
        if (snapshot.loaders or ended) and self.state.agent_offer is not None and not self._agent_loading:
            self.agent_loader = None  # an agent answers, or the job is gone: nothing left to offer
            self.state.agent_offer = None
        self._schedule_render()

    # ---- loading the agent on request (`i` while offered) ------------------------------------
    def agent_offered(self) -> bool:
        return self.agent_loader is not None and self.state.agent_offer is not None

    def _job_gone(self) -> bool:
        latest = self.state.latest
        return self.state.end_reason is not None or (latest is not None and not latest.target.alive)

    def load_agent(self) -> None:
        loader = self.agent_loader
        if loader is None or self._agent_loading:
            return
        self._agent_loading = True
        self._say_offer("loading the agent into the job…")
        threading.Thread(target=self._load_agent, args=(loader,), name="dlmon-inject", daemon=True).start()

    def _load_agent(self, loader: AgentLoader) -> None:
        why = loader.load()  # seconds, through gdb: never on the UI thread
        with contextlib.suppress(RuntimeError):
            self.post_message(AgentLoadEnded(why))

    def on_agent_load_ended(self, message: AgentLoadEnded) -> None:
        self._agent_loading = False
        if self._job_gone():  # it ended during the load: its pid may be another process's by now
            self.agent_loader = None
            self._say_offer(None)
        elif message.why is None:
            self.agent_loader = None
            self._say_offer("agent loaded: its DataLoader figures come from the next batch")
        else:
            self._say_offer(f"{message.why} (press i to try again)")

    def _say_offer(self, line: str | None) -> None:
        self.state.agent_offer = line
        self.state.version += 1
        self._schedule_render()

    def on_sought(self, message: Sought) -> None:
        # snapshots queued before the jump came first (one message queue): start a fresh history
        self.state = DashboardState(rank=self.rank)
        self._charts_due = True  # what the charts show is from before the jump
        self.notify(f"replay at {time.strftime('%H:%M:%S', time.localtime(message.time))}")
        self._schedule_render()

    def action_next_alert(self) -> None:
        if isinstance(self.source, Seekable):
            self.source.next_alert()
        else:
            self.notify("] jumps to the next alert in a replay", severity="warning")

    def action_seek(self, seconds: float) -> None:
        latest = self.state.latest
        if not isinstance(self.source, Seekable) or latest is None:
            self.notify(", and . move through a replay", severity="warning")
            return
        self.source.seek(latest.time + seconds)

    def on_source_ended(self, message: SourceEnded) -> None:
        self.state.end(message.reason)
        if not self._agent_loading:  # nothing is watched any more: nothing to load into
            self.agent_loader = None
            self.state.agent_offer = None
        self._charts_due = True  # no later tick will move the charts on to the last samples
        latest = self.state.latest
        if latest is not None and not latest.target.alive:
            code = latest.target.exit_code
            shown = code if code is not None else "unknown"
            self.notify(
                f"the target exited (code {shown}); the last data stays on screen", severity="warning"
            )
        self._schedule_render()

    def _schedule_render(self) -> None:
        if self._render_pending:
            return
        self._render_pending = True
        wait = self._last_render + MIN_RENDER_GAP_S - time.monotonic()
        if wait > 0:
            self.set_timer(wait, self._render_scheduled)
        else:
            self.call_later(self._render_scheduled)

    def _render_scheduled(self) -> None:
        self._render_pending = False
        self._last_render = time.monotonic()
        self.refresh_view()

    def context(self, fresh: bool = False) -> ViewContext:
        latest = self.state.latest
        now = latest.time if latest is not None else self.clock()
        interval = self.interval
        if interval is None and latest is not None:
            interval = latest.interval_s
        return ViewContext(self.state, now, interval, fresh)

    def header_info(self, ctx: ViewContext) -> HeaderInfo:
        interval = ctx.interval
        return HeaderInfo(
            description=self.source.description,
            live=self.source.live,
            paused=self.paused,
            now=self.clock(),
            boot_time=self.boot_time,
            clock_ticks=self.clock_ticks,
            interval=interval,
            stale_after=(3 * interval + 2) if (interval and self.source.live) else None,
        )

    def refresh_view(self, force: bool = False) -> None:
        """Redraw what is on screen from the newest state (nothing while paused, unless forced)."""
        if self.paused and not force:
            return
        if not self._started or not self.screen_stack:
            return  # a repaint scheduled just before the app closed fires after its screens went
        # the screen on top draws the state if it shows any (a detail screen); under a modal
        # (help, advice, quit) the main screen stays visible and goes on drawing
        # a forced repaint is one the user asked for (pause, resume, zoom, resize, back from a
        # detail, which forces the main screen's): its charts end where its figures do, not up
        # to CHART_REBUILD_S of data earlier
        screen = self.screen
        fresh, self._charts_due = force or self._charts_due, False
        (screen if isinstance(screen, ShowsState) else self.main_screen).show(self.context(fresh))
        self.renders += 1

    def _check_stale(self) -> None:
        self._show_faults()
        latest = self.state.latest
        if latest is None or self.paused:
            return
        info = self.header_info(self.context())
        stale = info.stale_after is not None and info.now - latest.time > info.stale_after
        if stale or self._stale_shown:
            self._stale_shown = stale
            self.refresh_view()

    def _show_faults(self) -> None:
        """dlmon's own failures (a failed sample, a record that stopped), as a notice when new."""
        if not isinstance(self.source, HasFaults):
            return
        faults = self.source.faults
        failed, stopped = self._faults_seen
        if faults.record_stopped and faults.record_stopped != stopped:
            self.notify(f"recording stopped: {faults.record_stopped}", severity="error", timeout=30)
        if faults.failed_samples > failed:
            self.notify(
                f"{faults.failed_samples} sample(s) failed (last: {faults.last_failure}); sampling goes on",
                severity="warning",
            )
        self._faults_seen = (faults.failed_samples, faults.record_stopped)

    def _poll_log(self) -> None:
        tail = self.log_tail
        if tail is None:
            return
        lines = tail.poll()
        progress = tail.partial
        try:
            self.log_size = os.stat(tail.path).st_size
        except OSError:
            self.log_size = None
        if not lines and progress == self.log_progress:
            return
        self.log_lines.extend(line[:LOG_LINE_KEEP] for line in lines[-LOG_KEEP:])
        self.log_progress = progress
        main = self.main_screen
        if main.has_logs and (main.zoomed is None or main.zoomed == "logs") and not self.paused:
            main.show_log()

    # ---- actions ----------------------------------------------------------------------------
    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.notify("paused: sampling goes on, the view is frozen" if self.paused else "resumed")
        self.refresh_view(True)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_advice(self) -> None:
        from dlmon.analysis import advise, format_advice

        history = list(self.state.history)  # the whole bounded history: the title says its span
        text = format_advice(advise(history)) if history else "No measurements yet."
        span = history[-1].time - history[0].time if history else 0.0
        self.push_screen(AdviceScreen(text, span_s=span, snapshots=len(history)))

    def action_save_svg(self) -> None:
        path = save_svg(self, "dlmon", self.clock())
        if path is not None:
            self.screenshots.append(path)

    def open_detail(self, key: tuple[str, str, int]) -> None:
        screen = WorkerDetailScreen(key)
        self.push_screen(screen, callback=lambda _: self.refresh_view(True))
        self.call_after_refresh(self.refresh_view, True)

    async def action_quit(self) -> None:
        self.action_request_quit()

    def action_request_quit(self) -> None:
        latest = self.state.latest
        running = latest is not None and latest.target.alive and self.state.end_reason is None
        # a child that outlived the training is still the training's: offer to stop it too
        running = running or (latest is not None and children_left(latest))
        if self.ask_stop_on_quit and running and not isinstance(self.screen, QuitScreen):
            assert latest is not None
            self.push_screen(
                QuitScreen(latest.target.pid, latest.target.cmdline, stop_by_default=self.stop_by_default),
                callback=self._quit_answer,
            )
            return
        self.exit(self.result(quit_by_user=True, stop_training=False))

    def _quit_answer(self, answer: str | None) -> None:
        if answer is None:
            return
        self.exit(self.result(quit_by_user=True, stop_training=answer == QUIT_STOP))

    def result(self, *, quit_by_user: bool, stop_training: bool) -> DashboardResult:
        latest = self.state.latest
        exited = latest is not None and not latest.target.alive
        return DashboardResult(
            quit_by_user=quit_by_user,
            target_exited=exited,
            exit_code=latest.target.exit_code if latest is not None and exited else None,
            stop_training=stop_training,
            end_reason=self.state.end_reason,
            screenshots=tuple(self.screenshots),
        )

    # ---- command palette --------------------------------------------------------------------
    def get_system_commands(self, screen: Screen[object]) -> Iterable[SystemCommand]:
        yield SystemCommand("Quit", "Quit dlmon (q)", self.action_request_quit)
        yield SystemCommand(
            "Pause / resume", "Freeze the view; sampling goes on (p)", self.action_toggle_pause
        )
        yield SystemCommand("Help", "Keys and how to read the figures (?)", self.action_help)
        yield SystemCommand(
            "Screenshot", "Save an SVG of the screen in screenshots/ or here (s)", self.action_save_svg
        )
        yield SystemCommand(
            "Advice", "num_workers, memory and loader settings from the measurements (a)", self.action_advice
        )
        main = self.main_screen
        if screen is main:
            for key, pid, title in PANELS:
                if pid in main.panel_ids():
                    yield SystemCommand(
                        f"Show {title}", f"The {title.lower()} panel in full ({key})", _bind(main.zoom, pid)
                    )
            yield SystemCommand("Show all panels", "Back to the overview (0 / esc)", main.action_overview)
            yield SystemCommand("Next panel", "Focus the next panel (tab)", main.action_next_panel)
            for sort in SORT_ORDER:
                yield SystemCommand(
                    f"Sort workers by {SORTS[sort].name}",
                    "Sort the workers table",
                    _bind(main.action_sort, sort),
                )
            yield SystemCommand("Reverse the sort", "Reverse the table order (i)", main.reverse_sort)
            if self.agent_offered():
                yield SystemCommand(
                    "Load the agent",
                    "Load dlmon's agent into the job for its DataLoader figures (i, while offered)",
                    self.load_agent,
                )
            yield SystemCommand(
                "Open worker detail",
                "The selected row's figures and history (enter)",
                main.query_one("#table", WorkerTable).action_open,
            )
        yield SystemCommand("Theme", "Change the colour theme", self.action_change_theme)


def _bind(fn: Callable[[str], None], arg: str) -> Callable[[], None]:
    def call() -> None:
        fn(arg)

    return call


def run_app(app: DlmonApp) -> DashboardResult:
    """Run ``app`` in the terminal; always stops its source. Returns how the session ended."""
    try:
        # wheel and clicks where the terminal sends them (shift+drag still selects text in most)
        result = app.run(mouse=True)
    finally:
        app.source.stop()
    if result is None:
        result = app.result(quit_by_user=False, stop_training=False)
    return result
