"""The workers table's columns, one entry each: what the table, the sorting, the key bindings,
the command palette and the help all derive from (no UI imports).

A column carries its header, its width rules, the function that renders a row's cell and, when
the table can be sorted by it, its :class:`Sort`: the value rows are ordered by, the key that
sorts and the words the caption, the palette and the help use. A new per-process figure on the
screen is one :class:`Column` in :data:`COLUMNS` (and a line in ``views/detail.py`` if the
detail screen shows it too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from dlmon.model import ProcessSample
from dlmon.model.format import DEAD_STATES, SIGKILL, signal_name
from dlmon.ui.fmt import DASH, cbytes, cpct, duration, mbps

if TYPE_CHECKING:  # state.py sorts by these columns: a runtime import would be a cycle
    from dlmon.ui.state import ProcessRow

Needs = Literal["batches", "gpu"]  # a figure the job must have for the column to show
Cell = str | tuple[str, str]  # the text in the row's style, or the text and a style of its own
CellFn = Callable[["ProcessRow", float | None], Cell]  # (row, the sampling interval)


@dataclass(frozen=True, slots=True)
class Sort:
    """How the table sorts by a column; ``value`` None is the natural order (role, worker id,
    first seen: said on purpose, never a default), else the rows go largest first with the
    missing values last."""

    binding: str  # the key that sorts by it (a textual key name)
    name: str  # "sorted by PSS" in the caption, "Sort workers by PSS" in the palette
    help: str  # its word on the help's sort line
    description: str  # the binding's description
    value: Callable[[ProcessRow], float | None] | None


@dataclass(frozen=True, slots=True)
class Column:
    key: str
    title: str
    width: int
    right: bool
    priority: int  # higher stays longer when the table is narrow
    cell: CellFn
    sort: Sort | None = None
    needs: Needs | None = None  # shown only when the job has loaders / a GPU


_STATE_NAMES = {
    "R": "run",
    "S": "sleep",
    "D": "disk",
    "Z": "zombie",
    "T": "stopped",
    "t": "traced",
    "X": "dead",
    "I": "idle",
    "W": "paging",
    "P": "parked",
}


def pss_stale(p: ProcessSample, interval: float | None) -> bool:
    """Read more than a few samples ago while memory in the job moved (a reading of a tree that
    stood still since is as good as a new one, whatever its age)."""
    return not p.pss_still and p.pss_age_s is not None and p.pss_age_s > max(5.0, 3 * (interval or 1.0))


def row_state(row: ProcessRow) -> tuple[str, str]:
    """(word, style) for the STATE cell."""
    if row.gone:
        d = row.death
        if d is not None:
            if d.signal is not None:
                name = "killed" if d.signal == SIGKILL else signal_name(d.signal)
                return (name, "crit")
            return (f"exit {d.exit_code}" if d.exit_code is not None else "died", "crit")
        return ("gone", "dim")
    st = row.process.state
    word = _STATE_NAMES.get(st, st)
    if st == "Z":
        return (word, "crit")
    if st == "D":
        return (word, "warn")
    if st in ("T", "t"):
        return (word, "warn")
    return (word, "")


def _dead(row: ProcessRow) -> bool:
    """Gone, or a zombie: its memory figures are the last ones read, not what it holds."""
    return row.gone or row.process.state in DEAD_STATES


def _held(read: Callable[[ProcessSample], int | None]) -> CellFn:
    def cell(row: ProcessRow, interval: float | None) -> Cell:
        return DASH if _dead(row) else cbytes(read(row.process))

    return cell


def _proportional(read: Callable[[ProcessSample], int | None]) -> CellFn:
    """A PSS figure: ``~`` and the stale style when it was read a while ago (see pss_stale)."""

    def cell(row: ProcessRow, interval: float | None) -> Cell:
        value = read(row.process)
        if _dead(row):
            return DASH
        if value is not None and pss_stale(row.process, interval):
            return ("~" + cbytes(value), "stale")
        return cbytes(value)

    return cell


def _num(v: float | None) -> float | None:
    return None if v is None else float(v)


def _live(read: Callable[[ProcessSample], float | None]) -> Callable[[ProcessRow], float | None]:
    """A rate or a share: a gone process has none, whatever it had last."""
    return lambda r: None if r.gone else _num(read(r.process))


def _any(read: Callable[[ProcessSample], float | None]) -> Callable[[ProcessRow], float | None]:
    return lambda r: _num(read(r.process))


def _last_batch(row: ProcessRow, interval: float | None) -> Cell:
    """Seconds since this worker's last batch."""
    return DASH if row.gone or row.batch_age_s is None else duration(row.batch_age_s).replace(" ", "")


def _worker_id(row: ProcessRow, interval: float | None) -> Cell:
    return str(row.process.worker_id) if row.process.worker_id is not None else DASH


def _threads(row: ProcessRow, interval: float | None) -> Cell:
    return DASH if _dead(row) or row.process.num_threads is None else str(row.process.num_threads)


def _batch_share(row: ProcessRow, interval: float | None) -> Cell:
    return DASH if row.batch_share is None else f"{row.batch_share * 100:.0f}"


COLUMNS: tuple[Column, ...] = (
    Column("role", "ROLE", width=6, right=False, priority=100, cell=lambda r, _: r.process.role),
    Column(
        "id",
        "ID",
        width=3,
        right=True,
        priority=90,
        cell=_worker_id,
        sort=Sort(binding="n", name="worker id", help="worker id", description="Sort by id", value=None),
    ),
    Column("pid", "PID", width=7, right=True, priority=95, cell=lambda r, _: str(r.process.pid)),
    # "exit 137", "SIGSEGV"
    Column("state", "STATE", width=8, right=False, priority=98, cell=lambda r, _: row_state(r)),
    Column(
        "cpu",
        "CPU%",
        width=5,
        right=True,
        priority=80,
        cell=lambda r, _: DASH if r.gone else cpct(r.process.cpu_percent),
        sort=Sort(
            binding="c",
            name="CPU %",
            help="CPU",
            description="Sort by CPU",
            value=_live(lambda p: p.cpu_percent),
        ),
    ),
    Column("thr", "THR", width=4, right=True, priority=10, cell=_threads),
    Column(
        "rss",
        "RSS",
        width=6,
        right=True,
        priority=70,
        cell=_held(lambda p: p.rss_bytes),
        sort=Sort(
            binding="r",
            name="RSS",
            help="RSS",
            description="Sort by RSS",
            value=_any(lambda p: p.rss_bytes),
        ),
    ),
    Column(
        "uss",
        "USS",
        width=6,
        right=True,
        priority=60,
        cell=_held(lambda p: p.uss_bytes),
        sort=Sort(
            binding="u",
            name="USS",
            help="USS",
            description="Sort by USS",
            value=_any(lambda p: p.uss_bytes),
        ),
    ),
    Column(
        "pss",
        "PSS",
        width=7,
        right=True,
        priority=97,
        cell=_proportional(lambda p: p.pss_bytes),
        sort=Sort(
            binding="m",
            name="PSS",
            help="PSS",
            description="Sort by PSS",
            value=_any(lambda p: p.pss_bytes),
        ),
    ),
    # PSS of mapped files (Pss_File): reclaimable, no leak
    Column("file", "FILE", width=6, right=True, priority=15, cell=_proportional(lambda p: p.pss_file_bytes)),
    Column("shm", "SHM", width=6, right=True, priority=20, cell=_held(lambda p: p.shmem_bytes)),
    Column(
        "read",
        "RD MB/s",
        width=7,
        right=True,
        priority=50,
        cell=lambda r, _: DASH if r.gone else mbps(r.process.read_bytes_per_s),
        sort=Sort(
            binding="d",
            name="read MB/s",
            help="read",
            description="Sort by read",
            value=_live(lambda p: p.read_bytes_per_s),
        ),
    ),
    Column("batch", "BATCH%", width=6, right=True, priority=40, cell=_batch_share, needs="batches"),
    # dropped first when narrow
    Column("last", "LAST", width=6, right=True, priority=5, cell=_last_batch, needs="batches"),
    Column(
        "gpu",
        "GPU",
        width=6,
        right=True,
        priority=30,
        cell=lambda r, _: cbytes(r.process.gpu_memory_bytes),
        sort=Sort(
            binding="g",
            name="GPU memory",
            help="GPU",
            description="Sort by GPU memory",
            value=_any(lambda p: p.gpu_memory_bytes),
        ),
        needs="gpu",
    ),
)


SORT_CYCLE: tuple[str, ...] = ("id", "cpu", "pss", "rss", "uss", "read", "gpu")
"""The < > cycle, the key bindings, the palette and the help, in this order (not the table's:
memory sorts by PSS first). Every sortable column's key, once."""
NATURAL_SORT = SORT_CYCLE[0]


def _sorts() -> dict[str, Sort]:
    keys = [c.key for c in COLUMNS]
    if len(keys) != len(set(keys)):
        raise ValueError(f"two columns share a key: {sorted(k for k in keys if keys.count(k) > 1)}")
    sortable = {c.key: c.sort for c in COLUMNS if c.sort is not None}
    if sorted(sortable) != sorted(SORT_CYCLE) or len(SORT_CYCLE) != len(set(SORT_CYCLE)):
        raise ValueError(f"SORT_CYCLE {SORT_CYCLE} is not the sortable columns {sorted(sortable)}")
    natural = [key for key, sort in sortable.items() if sort.value is None]
    if natural != [NATURAL_SORT]:
        raise ValueError(f"only {NATURAL_SORT!r} sorts in the natural order, not {natural}")
    return {key: sortable[key] for key in SORT_CYCLE}


SORTS: dict[str, Sort] = _sorts()
"""Sort key (the column's key) -> how; in the order of the < > cycle, the bindings and the help."""
SORT_ORDER: tuple[str, ...] = tuple(SORTS)
