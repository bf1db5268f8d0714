"""``dlmon cluster``'s screen: the straggler line on top, one row per node (worst first), its
ranks folded under it; Enter unfolds or folds a node's ranks. The cluster is read on a thread
(HTTP to every node, or Prometheus), never on the event loop; a failed refresh keeps the last
view and says why on the status line."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Static
from textual.widgets.data_table import CellDoesNotExist, RowDoesNotExist

from dlmon.cluster.command import HEADERS, ClusterFailed, node_cells
from dlmon.cluster.view import SEVERITY, ClusterView, NodeRow, RankRow
from dlmon.ui.svg import save_svg

Reader = Callable[[], ClusterView]
_STYLE = {3: "bold red", 2: "yellow", 1: "cyan", 0: ""}


def rank_cells(rank: RankRow) -> tuple[str, ...]:
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.0%}"

    rate = "n/a" if rank.batches_per_s is None else f"{rank.batches_per_s:.1f}"
    cpu = "" if rank.worker_cpu is None else f"workers {rank.workers or '?'} at {rank.worker_cpu:.1f} cores"
    verdict = rank.verdict.reason if rank.verdict else "ok"
    loader = f"{rank.site or ''} wait {pct(rank.loader_wait)} of its loader time; {cpu}".strip("; ")
    return (
        f"  └ rank {rank.rank}",
        rate,
        "",
        pct(rank.data_wait),
        "",
        "",
        "",
        "",
        "",
        f"{verdict} · {loader}",
    )


class ClusterApp(App[int]):
    TITLE = "dlmon cluster"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("enter", "fold", "Ranks", priority=True),
        Binding("r", "refresh_now", "Refresh"),
        Binding("s", "save_svg", "Screenshot"),
    ]
    CSS = """
    #straggler { height: auto; padding: 0 1; }
    #status { height: 1; padding: 0 1; color: $text-muted; }
    DataTable { height: 1fr; }
    """

    def __init__(self, read: Reader, interval_s: float, first: ClusterView | None = None) -> None:
        super().__init__()
        self._read = read
        self._interval_s = interval_s
        self._first = first  # the reading the command made before the screen opened
        self._view: ClusterView | None = None
        self._unfolded: set[str] = set()
        self._reading = False

    @property
    def view(self) -> ClusterView | None:
        """The cluster as last read (None before the first read)."""
        return self._view

    def compose(self) -> ComposeResult:
        yield Static("straggler: reading the nodes…", id="straggler")
        table: DataTable[Text | str] = DataTable(cursor_type="row", zebra_stripes=False)
        yield table
        yield Static("", id="status")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for header in HEADERS:
            table.add_column(header, key=header)
        if self._first is not None:  # shown at once, not read again (a dead node costs its timeout)
            self._show(self._first)
        else:
            self.refresh_view()
        self.set_interval(self._interval_s, self.refresh_view)

    def refresh_view(self) -> None:
        if not self._reading:
            self._reading = True
            self._read_in_thread()

    @work(thread=True, exclusive=True)
    def _read_in_thread(self) -> None:
        try:
            view = self._read()
        except ClusterFailed as exc:
            self.call_from_thread(self._failed, exc.message)
        else:
            self.call_from_thread(self._show, view)

    def _failed(self, message: str) -> None:
        self._reading = False
        self.query_one("#status", Static).update(f"refresh failed at {time.strftime('%H:%M:%S')}: {message}")

    def _show(self, view: ClusterView) -> None:
        self._reading = False
        self._view = view
        line = Text("straggler: ", style="bold")
        severity = SEVERITY.get(view.straggler.severity, 0) if view.straggler else 0
        line.append(view.straggler_note, style=_STYLE[severity])
        self.query_one("#straggler", Static).update(line)
        answered = sum(1 for n in view.nodes if n.answered)
        self.query_one("#status", Static).update(
            f"{view.source}: {answered}/{len(view.nodes)} nodes answered at "
            f"{time.strftime('%H:%M:%S', time.localtime(view.time))}"
            + (f" · {view.trend_note}" if view.trend_note else "")
            + " · enter: a node's ranks · q: quit"
        )
        self._fill()

    def _fill(self) -> None:
        if self._view is None:
            return
        table = self.query_one(DataTable)
        keep = self._cursor_key()
        table.clear()
        for node in self._view.nodes:
            cells = list(node_cells(node))
            folded = node.address not in self._unfolded
            if node.ranks:
                count = f"{len(node.ranks)} rank{'s' if len(node.ranks) != 1 else ''}"
                cells[0] = f"{'▸' if folded else '▾'} {cells[0]} ({count})"
            style = _STYLE[node.severity]
            table.add_row(*(Text(c, style=style) for c in cells), key=node.address)
            if not folded:
                for rank in node.ranks:
                    table.add_row(*rank_cells(rank), key=f"{node.address}#{rank.rank}")
        if keep is not None:
            with contextlib.suppress(RowDoesNotExist):  # a node dropped out: the cursor stays
                table.move_cursor(row=table.get_row_index(keep))

    def _cursor_key(self) -> str | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        try:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        except CellDoesNotExist:
            return None
        return None if key.value is None else str(key.value)

    def node_under_cursor(self) -> NodeRow | None:
        key = self._cursor_key()
        if key is None or self._view is None:
            return None
        address = key.split("#", 1)[0]
        return next((n for n in self._view.nodes if n.address == address), None)

    def action_fold(self) -> None:
        node = self.node_under_cursor()
        if node is None:
            return
        if node.address in self._unfolded:
            self._unfolded.discard(node.address)
        else:
            self._unfolded.add(node.address)
        self._fill()
        table = self.query_one(DataTable)
        table.move_cursor(row=table.get_row_index(node.address))

    def action_refresh_now(self) -> None:
        self.refresh_view()

    def action_save_svg(self) -> None:
        save_svg(self, "dlmon-cluster", time.time())


def run_cluster_screen(read: Reader, interval_s: float, first: ClusterView | None = None) -> int:
    ClusterApp(read, interval_s, first).run()
    return 0
