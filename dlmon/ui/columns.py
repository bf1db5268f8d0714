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
from dlmon.ui.fmt import DASH, cbytes, cpct, duration, mbps

if TYPE_CHECKING:  # state.py sorts by these columns: a runtime import would be a cycle
    from dlmon.ui.state import ProcessRow

Cell = str | tuple[str, str]  # the text in the row's style, or the text and a style of its own
CellFn = Callable[["ProcessRow", float | None], Cell]  # (row, the sampling interval)


@dataclass(frozen=True, slots=True)
class Sort:
    """How the table sorts by a column; ``value`` None is the natural order (role, worker id,
    first seen), else the rows go largest first with the missing values last."""

    order: int  # its place in the < > cycle, the key bindings, the palette and the help
    binding: str  # the key that sorts by it (a textual key name)
    name: str  # "sorted by PSS" in the caption, "Sort workers by PSS" in the palette
    help: str  # its word on the help's sort line
    description: str  # the binding's description
    value: Callable[[ProcessRow], float | None] | None = None


@dataclass(frozen=True, slots=True)
class Column:
    key: str
    title: str
    width: int
    right: bool
    priority: int  # higher stays longer when the table is narrow
    cell: CellFn
    sort: Sort | None = None
    needs: Literal["batches", "gpu"] | None = None  # shown only when the job has loaders / a GPU


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
_SIGNAMES = {9: "killed", 7: "SIGBUS", 11: "SIGSEGV", 6: "SIGABRT", 15: "SIGTERM"}


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
                return (_SIGNAMES.get(d.signal, f"SIG{d.signal}"), "crit")
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
    return row.gone or row.process.state in ("Z", "X")


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


COLUMNS: tuple[Column, ...] = (
    Column("role", "ROLE", 6, False, 100, lambda r, _: r.process.role),
    Column(
        "id",
        "ID",
        3,
        True,
        90,
        lambda r, _: str(r.process.worker_id) if r.process.worker_id is not None else DASH,
        Sort(0, "n", "worker id", "worker id", "Sort by id"),
    ),
    Column("pid", "PID", 7, True, 95, lambda r, _: str(r.process.pid)),
    Column("state", "STATE", 8, False, 98, lambda r, _: row_state(r)),  # "exit 137", "SIGSEGV"
    Column(
        "cpu",
        "CPU%",
        5,
        True,
        80,
        lambda r, _: DASH if r.gone else cpct(r.process.cpu_percent),
        Sort(1, "c", "CPU %", "CPU", "Sort by CPU", _live(lambda p: p.cpu_percent)),
    ),
    Column(
        "thr",
        "THR",
        4,
        True,
        10,
        lambda r, _: DASH if _dead(r) or r.process.num_threads is None else str(r.process.num_threads),
    ),
    Column(
        "rss",
        "RSS",
        6,
        True,
        70,
        _held(lambda p: p.rss_bytes),
        Sort(3, "r", "RSS", "RSS", "Sort by RSS", _any(lambda p: p.rss_bytes)),
    ),
    Column(
        "uss",
        "USS",
        6,
        True,
        60,
        _held(lambda p: p.uss_bytes),
        Sort(4, "u", "USS", "USS", "Sort by USS", _any(lambda p: p.uss_bytes)),
    ),
    Column(
        "pss",
        "PSS",
        7,
        True,
        97,
        _proportional(lambda p: p.pss_bytes),
        Sort(2, "m", "PSS", "PSS", "Sort by PSS", _any(lambda p: p.pss_bytes)),
    ),
    # PSS of mapped files (Pss_File): reclaimable, no leak
    Column("file", "FILE", 6, True, 15, _proportional(lambda p: p.pss_file_bytes)),
    Column("shm", "SHM", 6, True, 20, _held(lambda p: p.shmem_bytes)),
    Column(
        "read",
        "RD MB/s",
        7,
        True,
        50,
        lambda r, _: DASH if r.gone else mbps(r.process.read_bytes_per_s),
        Sort(5, "d", "read MB/s", "read", "Sort by read", _live(lambda p: p.read_bytes_per_s)),
    ),
    Column(
        "batch",
        "BATCH%",
        6,
        True,
        40,
        lambda r, _: DASH if r.batch_share is None else f"{r.batch_share * 100:.0f}",
        needs="batches",
    ),
    Column("last", "LAST", 6, True, 5, _last_batch, needs="batches"),  # dropped first when narrow
    Column(
        "gpu",
        "GPU",
        6,
        True,
        30,
        lambda r, _: cbytes(r.process.gpu_memory_bytes),
        Sort(6, "g", "GPU memory", "GPU", "Sort by GPU memory", _any(lambda p: p.gpu_memory_bytes)),
        needs="gpu",
    ),
)


def _sorts() -> dict[str, Sort]:
    sortable = [(c.sort, c.key) for c in COLUMNS if c.sort is not None]
    return {key: sort for sort, key in sorted(sortable, key=lambda pair: pair[0].order)}


SORTS: dict[str, Sort] = _sorts()
"""Sort key (the column's key) -> how; in the order of the < > cycle, the bindings and the help."""
SORT_ORDER: tuple[str, ...] = tuple(SORTS)
