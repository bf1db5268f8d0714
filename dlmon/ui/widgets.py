"""The dashboard's widgets: cheap line-rendering views, the workers table and the charts.

Every view keeps the lines it shows and repaints only when new lines differ; formatted lines are
turned into strips once and reused while they stay on screen. Charts rebuild their plot only
when the bucketed data they show changed (at most once per chart bucket), and cache the result.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Reversible, Sequence
from dataclasses import dataclass

from rich.color import ColorType
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import RenderResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.geometry import Region, Size
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget
from textual_plotext import PlotextPlot

from dlmon.ui.columns import NATURAL_SORT
from dlmon.ui.series import Series, chart_step
from dlmon.ui.state import DashboardState, ProcessRow, RankGroup, RowKey
from dlmon.ui.text import Line, Lines, clip
from dlmon.ui.views import (
    STYLES,
    rank_line,
    sort_caption,
    stuck_line,
    table_cells,
    table_columns,
    table_header,
)

# Text from the target (a command line with newlines, a comm with escapes) must not move the cursor.
_CONTROL = {c: " " for c in (*range(32), 127)}


class LinesView(Widget):
    """Shows styled lines (see ``dlmon.ui.views``); repaints only when they change."""

    COMPONENT_CLASSES = {f"lines--{name}" for name in STYLES}

    DEFAULT_CSS = """
    LinesView { height: auto; width: 1fr; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._lines: Lines = ()
        self._strips: dict[tuple[Line, int], Strip] = {}
        self._styles: dict[str, Style] | None = None
        self._base: Style | None = None

    @property
    def lines(self) -> Lines:
        return self._lines

    @property
    def text(self) -> str:
        """The plain text shown (for tests and screen readers of the log)."""
        return "\n".join("".join(t for t, _ in line) for line in self._lines)

    def set_lines(self, lines: Lines) -> bool:
        """Show ``lines``; returns whether anything changed."""
        old = self._lines
        if lines == old:
            return False
        self._lines = lines
        if self._strips:
            keep = set(lines)
            self._strips = {k: v for k, v in self._strips.items() if k[0] in keep}
        width = self.size.width
        if len(lines) != len(old) or not width:
            self.refresh(layout=len(lines) != len(old))
        else:  # repaint only the lines that changed: the compositor's work is per dirty line
            pairs = enumerate(zip(old, lines, strict=True))
            self.refresh(*(Region(0, y, width, 1) for y, (a, b) in pairs if a != b))
        return True

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._lines)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles = None
        self._base = None
        self._strips.clear()

    def _style_map(self) -> dict[str, Style]:
        if self._styles is None:
            base = self.rich_style
            self._base = base
            styles = {"": base}
            for name in STYLES:
                styles[name] = base + self.get_component_rich_style(f"lines--{name}", partial=True)
            self._styles = styles
        return self._styles

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        styles = self._style_map()
        if y >= len(self._lines):
            return Strip.blank(width, styles[""])
        line = self._lines[y]
        key = (line, width)
        strip = self._strips.get(key)
        if strip is None:
            segments = [
                Segment(text.translate(_CONTROL), styles.get(style, styles[""]))
                for text, style in line
                if text
            ]
            strip = Strip(segments).crop_extend(0, width, styles[""])
            self._strips[key] = strip
        return strip


class Panel(Vertical):
    """A titled box; number keys show it alone, tab moves between panels."""

    can_focus = True

    def __init__(self, title: str, key: str, *, id: str, focusable: bool = True) -> None:
        super().__init__(id=id, classes="panel")
        self.panel_title = title
        self.key = key
        self.border_title = f"{key} {title}"
        self.can_focus = focusable

    def set_caption(self, caption: str | None) -> None:
        if self.border_subtitle != (caption or ""):
            self.border_subtitle = caption or ""


# ---- charts ---------------------------------------------------------------------------------
CHART_REBUILD_S = 15.0  # a chart whose only change is time moves on at most this often


# What a chart line stands for; its colour is the component class ``timechart--<kind>`` in
# dlmon.tcss (plotext draws the plot, so the widget hands it the colour the stylesheet gives).
CHART_LINE_KINDS = (
    "pss", "anon", "limit", "uss", "rss", "cpu", "read", "rate", "wait", "rate-2", "wait-2",
)  # fmt: skip
PlotextColour = int | tuple[int, int, int] | str


@dataclass(frozen=True, slots=True)
class ChartLine:
    label: str
    series: Series
    kind: str  # one of CHART_LINE_KINDS
    right: bool = False  # on the right-hand y axis


class TimeChart(PlotextPlot):
    """A time-series chart of bounded :class:`Series`, redrawn only when its buckets change.

    The x axis is minutes before now; the window is at least ``min_window`` seconds and grows
    with the run, in buckets of a round number of seconds (never finer than the interval). When
    only time moved on (same size, lines and step), the plot is rebuilt once ``min_rebuild_s``
    seconds of data passed, not at every new bucket: a plotext build is the dashboard's most
    expensive step, and the figures above each chart show the newest value every tick.
    """

    DEFAULT_CSS = """
    TimeChart { height: 1fr; min-height: 5; }
    """
    COMPONENT_CLASSES = {f"timechart--{kind}" for kind in CHART_LINE_KINDS}

    def __init__(
        self,
        *,
        unit: str,
        scale: float,
        right_unit: str | None = None,
        right_scale: float = 1.0,
        min_window: float = 600.0,
        zero_based: bool = True,
        min_rebuild_s: float = CHART_REBUILD_S,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(id=id, classes=classes)
        self.unit = unit
        self.scale = scale
        self.right_unit = right_unit
        self.right_scale = right_scale
        self.min_window = min_window
        self.zero_based = zero_based
        self.min_rebuild_s = min_rebuild_s
        self._built_at: float | None = None  # the data time of the newest plot
        self.builds = 0  # how many times the plot was rebuilt (tests, benchmarks)
        self._signature: tuple[object, ...] | None = None
        self._cached: tuple[tuple[object, ...], Text] | None = None
        self._has_data = False
        self._data_version = 0
        self.plotted_labels: tuple[str, ...] = ()
        self.y_range: tuple[float, float] | None = None  # the left axis of the newest plot, in units

    def show(
        self, lines: Sequence[ChartLine], now: float, interval: float | None, fresh: bool = False
    ) -> bool:
        """Set the data; returns whether the plot will be rebuilt (``fresh``: up to ``now``,
        without waiting for ``min_rebuild_s`` of data)."""
        width, height = self.size.width, self.size.height
        if width <= 12 or height <= 3 or not self.display:
            return False
        firsts = [cl.series.first_time for cl in lines if cl.series.first_time is not None]
        if not firsts:
            signature: tuple[object, ...] = (width, height, "empty")
            if signature != self._signature:
                self._signature = signature
                self._has_data = False
                self._data_version += 1
                self.refresh()
                return True
            return False
        dots = max(10, (width - 10) * 2)
        span = now - min(firsts)
        step = chart_step(span, dots, interval, self.min_window)
        bucket = math.floor(now / step)
        # the step keeps the rebuilds rare; the window shows what there is (at least a minute)
        window = min(dots * step, math.ceil(max(span, 60.0, 4 * step) / step) * step)
        self.plotted_labels = tuple(cl.label for cl in lines)
        colours = tuple(self.line_colour(cl.kind) for cl in lines)
        signature = (width, height, step, bucket, window, self.plotted_labels, self.unit, self.scale, colours)
        if signature == self._signature:
            return False
        old = self._signature
        # the same chart a bucket later: wait for min_rebuild_s of data (a replay's burst or a
        # backwards seek still redraws at once)
        if (
            not fresh
            and old is not None
            and old[:3] == signature[:3]
            and old[5:] == signature[5:]
            and self._built_at is not None
            and 0 <= now - self._built_at < self.min_rebuild_s
        ):
            return False
        self._signature = signature
        self._built_at = now
        end = (bucket + 1) * step
        start = end - window
        plt = self.plt
        plt.clear_data()
        any_points = False
        top = {False: 0.0, True: 0.0}
        low = math.inf
        used: set[bool] = set()
        for cl, colour in zip(lines, colours, strict=True):
            points = cl.series.resample(start, end, step)
            if not points:
                continue
            any_points = True
            scale = self.right_scale if cl.right else self.scale
            xs = [(t - now) / 60.0 for t, _ in points]
            ys = [v / scale for _, v in points]
            top[cl.right] = max(top[cl.right], max(ys))
            if not cl.right:
                low = min(low, min(ys))
            used.add(cl.right)
            plt.plot(
                xs,
                ys,
                label=cl.label,
                color=colour,
                marker="braille",
                yside="right" if cl.right else "left",
            )
        plt.xlim(-(now - start) / 60.0, 0)
        if self.zero_based:
            for right, value in top.items():
                if right in used:
                    side = "right" if right else "left"
                    upper = value * 1.08 if value > 0 else 1.0
                    plt.ylim(0, upper, side)  # type: ignore[arg-type]  # the stub says float
            self.y_range = (0.0, top[False] * 1.08 if top[False] > 0 else 1.0)
        elif False in used:  # the data's own range, padded: a slow leak shows as a slope
            pad = max(0.05 * (top[False] - low), 0.02 * abs(top[False]), 1e-9)
            lower, upper = max(0.0, low - pad), top[False] + pad
            plt.ylim(lower, upper, "left")  # type: ignore[arg-type]
            self.y_range = (lower, upper)
        plt.xlabel("minutes ago")
        plt.ylabel(self.unit, "left")  # the stub names it xside
        if self.right_unit is not None:
            plt.ylabel(self.right_unit, "right")
        self._has_data = any_points
        self._data_version += 1
        self.refresh()
        return True

    def on_mount(self) -> None:
        # runs before PlotextPlot's on_mount (handlers go down the MRO) and, on a theme change,
        # before its theme signal: the plot theme is set before textual-plotext registers one
        self.watch(self.app, "theme", self._follow_theme)

    def _follow_theme(self, name: str) -> None:
        """An ANSI theme (ansi-dark, ansi-light) leaves the background and the text colour to the
        terminal ("ansi_default"), which textual-plotext's "auto" theme reads as RGB black: the
        plot was black on black. Plotext's "clear" theme paints neither; the lines keep theirs."""
        theme = self.app.get_theme(name)
        self.theme = "clear" if theme is not None and theme.ansi else "auto"

    def line_colour(self, kind: str) -> PlotextColour:
        """The stylesheet's colour of a line kind, as plotext takes it: an ANSI colour by its
        number (the terminal's palette, as plotext's own colour names), any other by RGB;
        "default" (the text colour) where the stylesheet sets none."""
        colour = self.get_component_rich_style(f"timechart--{kind}", partial=True).color
        if colour is None or colour.is_default:
            return "default"
        if colour.number is not None and colour.type in (ColorType.STANDARD, ColorType.EIGHT_BIT):
            return colour.number
        r, g, b = colour.get_truecolor()
        return (r, g, b)

    def render(self) -> RenderResult:
        key = (self.size.width, self.size.height, self.app.theme, self._data_version)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        if not self._has_data:
            text = Text("collecting data for the chart…", style="dim")
        else:
            self.builds += 1
            rendered = super().render()
            text = rendered if isinstance(rendered, Text) else Text(str(rendered))
        self._cached = (key, text)
        return text


# ---- workers table --------------------------------------------------------------------------
class WorkerTable(LinesView):
    """The process table: one line per process, drawn line by line (no DataTable).

    Sorting and the cursor follow rows by key, so a re-sort or a respawned worker keeps the
    selection. Only the visible window of rows is formatted.
    """

    can_focus = True

    BINDINGS = [
        Binding("up,k", "cursor(-1)", "Up", show=False),
        Binding("down,j", "cursor(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "edge(0)", "First", show=False),
        Binding("end", "edge(1)", "Last", show=False),
        Binding("enter", "open", "Worker detail"),
        Binding("space", "toggle_group", "Expand / collapse rank", show=False),
        Binding("right,plus", "expand(1)", "Expand rank", show=False),
        Binding("left,minus", "expand(0)", "Collapse rank", show=False),
    ]

    DEFAULT_CSS = """
    WorkerTable { height: 1fr; }
    """

    class Opened(Message):
        """The user asked for the detail of a row."""

        def __init__(self, key: RowKey) -> None:
            super().__init__()
            self.key = key

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.sort = NATURAL_SORT
        self.reverse = False
        self.cursor_key: RowKey | None = None
        self._keys: list[RowKey] = []
        self._top = 0
        self._state: DashboardState | None = None
        self._interval: float | None = None
        self.caption = ""
        self.expanded: set[int] = set()  # DDP ranks (owner pids) shown with their workers
        self._groups: dict[int, RankGroup] = {}
        self._group_of: dict[RowKey, int] = {}  # a row's rank (owner pid), for toggling from any row
        self._extra_at: set[int] = set()
        self._summary_at: dict[int, int] = {}

    @property
    def row_keys(self) -> list[RowKey]:
        return list(self._keys)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return max(1, len(self._keys) + 1)

    def show(self, state: DashboardState, interval: float | None) -> None:
        self._state = state
        self._interval = interval
        rows = state.sorted_rows(self.sort, self.reverse)
        total = len(rows)
        self._groups = state.rank_groups() if self.sort == NATURAL_SORT else {}
        if self._groups:
            rows = self._tree(rows)
        self._keys = [r.key for r in rows]
        if self.cursor_key not in state.rows:
            self.cursor_key = self._keys[0] if self._keys else None
        self.caption = sort_caption(self.sort, self.reverse, total)
        if state.rank is not None:
            self.caption += f" · rank {state.rank} only (--rank)"
        if self._groups:
            self.caption += f" · {len(self._groups)} ranks (space: expand)"
        self._rebuild(rows)

    def _tree(self, rows: list[ProcessRow]) -> list[ProcessRow]:
        """Natural order as a tree: each rank followed by its workers when expanded."""
        grouped = {w.key: pid for pid, g in self._groups.items() for w in g.workers}
        self._group_of = dict(grouped)
        out: list[ProcessRow] = []
        for row in rows:
            if row.key in grouped:
                continue
            out.append(row)
            group = self._groups.get(row.process.pid)
            if group is not None and group.owner.key == row.key:
                self._group_of[row.key] = row.process.pid
                if row.process.pid in self.expanded:
                    out.extend(group.workers)
        return out

    def _rebuild(self, rows: list[ProcessRow] | None = None) -> None:
        state = self._state
        if state is None:
            return
        if rows is None:
            rows = [state.rows[k] for k in self._keys if k in state.rows]
        latest = state.latest
        batches = bool(latest is not None and latest.loaders)
        gpu = bool(latest is not None and (latest.gpus or any(r.process.gpu_memory_bytes for r in rows)))
        width = self.size.width or 80
        cols = table_columns(width, batches=batches, gpu=gpu)
        visible = self.size.height - 1 if self.size.height > 1 else len(rows)
        cursor = self._keys.index(self.cursor_key) if self.cursor_key in self._keys else 0
        if cursor < self._top:
            self._top = cursor
        elif cursor >= self._top + visible:
            self._top = cursor - visible + 1
        self._top = max(0, min(self._top, max(0, len(rows) - visible)))
        if self.size.height > 1 and cursor < len(rows):
            # a rank's sums and a stuck line take lines of their own: scroll by lines, not rows
            taken = sum(self._lines_of(rows[i], width) for i in range(self._top, cursor + 1))
            while self._top < cursor and taken > visible:
                taken -= self._lines_of(rows[self._top], width)
                self._top += 1
        focused = self.has_focus
        lines: list[Line] = [table_header(cols, self.sort, self.reverse)]
        self._extra_at = set()  # screen lines that are not rows (rank sums, stuck lines)
        self._summary_at = {}  # a rank's sum line -> its owner pid
        for i in range(self._top, min(len(rows), self._top + visible)):
            line = table_cells(rows[i], cols, self._interval)
            group = self._groups.get(rows[i].process.pid)
            if group is not None and group.owner.key == rows[i].key and cols and cols[0].key == "role":
                line = (("rank".ljust(cols[0].width), "b"), *line[1:])  # a DDP rank: owns a loader
            if i == cursor:
                style = "cursor" if focused else "cursor-blur"
                line = tuple((text, style) for text, _ in line)
            lines.append(line)
            if group is not None and group.owner.key == rows[i].key:
                self._extra_at.add(len(lines))
                self._summary_at[len(lines)] = rows[i].process.pid
                lines.append(rank_line(group, rows[i].process.pid in self.expanded, width))
            stuck = stuck_line(rows[i], latest.alerts, width) if latest is not None else None
            if stuck is not None:
                self._extra_at.add(len(lines))
                lines.append(stuck)
        self.set_lines(tuple(lines))

    def on_resize(self) -> None:
        self._rebuild()

    def on_focus(self) -> None:
        self._rebuild()

    def on_blur(self) -> None:
        self._rebuild()

    def set_sort(self, sort: str, reverse: bool | None = None) -> None:
        if reverse is None:
            reverse = (not self.reverse) if sort == self.sort else False
        self.sort, self.reverse = sort, reverse
        if self._state is not None:
            self.show(self._state, self._interval)

    def _lines_of(self, row: ProcessRow, width: int) -> int:
        """The screen lines ``row`` takes: itself, its rank's sums, its stuck line."""
        group = self._groups.get(row.process.pid)
        sums = 1 if group is not None and group.owner.key == row.key else 0
        latest = self._state.latest if self._state is not None else None
        stuck = 1 if latest is not None and stuck_line(row, latest.alerts, width) is not None else 0
        return 1 + sums + stuck

    def _move_to(self, index: int) -> None:
        if not self._keys:
            return
        index = max(0, min(len(self._keys) - 1, index))
        self.cursor_key = self._keys[index]
        self._rebuild()

    def _cursor_index(self) -> int:
        return self._keys.index(self.cursor_key) if self.cursor_key in self._keys else 0

    def action_cursor(self, delta: int) -> None:
        self._move_to(self._cursor_index() + delta)

    def action_page(self, direction: int) -> None:
        self._move_to(self._cursor_index() + direction * max(1, self.size.height - 2))

    def action_edge(self, end: int) -> None:
        self._move_to(len(self._keys) - 1 if end else 0)

    # ---- mouse (where the terminal sends it; the keyboard does all of it too) ------------------
    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        event.stop()
        self.action_cursor(3)

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        event.stop()
        self.action_cursor(-3)

    def on_click(self, event: events.Click) -> None:
        """A click selects the row under it (a double click opens it, a click on a rank's
        summary line folds or unfolds it)."""
        event.stop()
        self.focus()
        line = event.y
        if line < 1 or line >= len(self.lines):
            return
        owner = self._summary_at.get(line)
        while line in self._extra_at and line > 1:  # a line under a row belongs to that row
            line -= 1
        index = self._top + line - 1 - self._extra_lines_above(line)
        if not 0 <= index < len(self._keys):
            return
        self.cursor_key = self._keys[index]
        if owner is not None:
            self._set_expanded(owner, owner not in self.expanded)
            return
        self._rebuild()
        if event.chain >= 2:
            self.action_open()

    def _extra_lines_above(self, line: int) -> int:
        return sum(1 for y in self._extra_at if y < line)

    def action_toggle_group(self) -> None:
        pid = self._group_of.get(self.cursor_key) if self.cursor_key is not None else None
        if pid is not None:
            self._set_expanded(pid, pid not in self.expanded)

    def action_expand(self, on: int) -> None:
        pid = self._group_of.get(self.cursor_key) if self.cursor_key is not None else None
        if pid is not None:
            self._set_expanded(pid, bool(on))

    def _set_expanded(self, pid: int, on: bool) -> None:
        if on:
            self.expanded.add(pid)
        else:
            self.expanded.discard(pid)
            group = self._groups.get(pid)
            if group is not None:
                self.cursor_key = group.owner.key  # the cursor stays on the rank it folded
        if self._state is not None:
            self.show(self._state, self._interval)

    def action_open(self) -> None:
        if self.cursor_key is not None:
            self.post_message(self.Opened(self.cursor_key))


class LogView(LinesView):
    """The last lines of the training's output that fit, and its unfinished progress line.

    The app keeps the bounded buffer (whether this is shown or not); this view is handed only
    what fits its height, so opening it after hours of output costs one screenful.
    """

    DEFAULT_CSS = """
    LogView { height: 1fr; }
    """

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return max(1, len(self.lines))

    def show(self, lines: Reversible[str], progress: str, width: int) -> None:
        room = self.size.height
        if room <= 0:
            return
        keep = room - (1 if progress else 0)
        tail = list(itertools.islice(reversed(lines), keep))[::-1] if keep > 0 else []
        if progress:
            tail.append(progress)
        out: list[Line] = []
        for i, text in enumerate(tail):
            style = "b" if progress and i == len(tail) - 1 else ""
            out.append(((clip(text, width), style),))
        self.set_lines(tuple(out))


class HeaderBar(LinesView):
    DEFAULT_CSS = """
    HeaderBar { dock: top; height: 1; }
    """
