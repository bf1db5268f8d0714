"""Reading record files as a stream: one line at a time, never the whole file in memory.

Replay reads recordings through :func:`iter_records`, report and diff through
:func:`iter_checked_records` (the same lines, but a snapshot line that reads as it stands is left
as its checked JSON object: the report needs a few figures of each line, and building the typed
Snapshot cost several times the line's ``json.loads``). A file ending in ``.gz`` is read through
gzip. Whatever a line holds, the reader yields one of three things and never raises for content:
a snapshot, the recording's :class:`RecordEnd`, or a :class:`RecordProblem` saying why that line
was skipped. Only opening the file can raise (``OSError``), so "cannot read FILE" and "line 7 is
corrupt" stay two different messages.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, Generic, Literal, TypeVar, cast, overload

from dlmon.model import Snapshot
from dlmon.model.checked import reads_as_is
from dlmon.model.serialize import SnapshotFormatError, snapshot_from_dict

# A 1000-process snapshot is ~1 MiB of JSON; anything far beyond that is not a line dlmon wrote
# (``dlmon replay /dev/zero`` must not grow without bound).
MAX_LINE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RecordProblem:
    line: int
    reason: str


@dataclass(frozen=True, slots=True)
class RecordEnd:
    line: int
    time: float | None
    reason: str


@dataclass(frozen=True, slots=True)
class CheckedSnapshot:
    """A snapshot line left as its JSON object, known to read as a Snapshot with exactly these
    values (:func:`dlmon.model.checked.reads_as_is`, times in range): what the report reads, which
    needs a few figures of each line, not the typed Snapshot. :meth:`snapshot` builds that."""

    time: float
    data: dict[str, Any]

    def snapshot(self) -> Snapshot:
        return snapshot_from_dict(self.data)


Record = Snapshot | RecordEnd | RecordProblem
CheckedRecord = CheckedSnapshot | Snapshot | RecordEnd | RecordProblem


def open_record_file(path: str) -> IO[bytes]:
    """The file as bytes, decompressed when it ends in ``.gz``; raises OSError."""
    if path.endswith(".gz"):
        return cast(IO[bytes], gzip.open(path, "rb"))
    return open(path, "rb")


def iter_records(path: str) -> Iterator[Record]:
    """Yield every line of ``path`` as a snapshot, the end marker, or the reason it was skipped."""
    return in_time_order(_iter_lines(path, parse_line))


def resume_checked_records(
    fh: IO[bytes], first_line: int, latest: tuple[float, int] | None
) -> Iterator[CheckedRecord]:
    """:func:`iter_checked_records` resumed where a reader stopped: the lines of the open record
    ``fh`` from where it stands (a line boundary), the first numbered ``first_line``, put in time
    order by a :class:`TimeOrder` whose latest snapshot was ``latest`` and that held none."""
    order: TimeOrder[CheckedRecord] = TimeOrder(latest)
    for _, number, record in _lines_in(fh, first_line, False, parse_line_checked):
        yield from order.push(number, record)
    yield from order.finish()


def iter_checked_records(path: str) -> Iterator[CheckedRecord]:
    """:func:`iter_records`, but a line that reads as a Snapshot exactly as its JSON object stands
    is yielded as that object, checked (:class:`CheckedSnapshot`), not built: the same lines in
    the same order, the same problems with the same words. A line the check cannot vouch for
    takes the full reader (and comes as a Snapshot, or a RecordProblem saying why)."""
    return in_time_order(_iter_lines(path, parse_line_checked))


R = TypeVar("R", bound=CheckedRecord)


def in_time_order(lines: Iterator[tuple[int, R]]) -> Iterator[R]:
    """Drop a lone snapshot earlier than the latest before it (a line from elsewhere, a forged
    time: it gave "duration -1:59:54"), but keep a clock that stepped back (NTP, a resumed VM):
    when the next snapshot is also early and not earlier than the first, both are kept and time
    goes on from there (a summary spans its earliest to its latest time). At most one snapshot is
    held back, and only until the next one (:class:`TimeOrder`)."""
    order: TimeOrder[R] = TimeOrder()
    for number, record in lines:
        yield from order.push(number, record)
    yield from order.finish()


class TimeOrder(Generic[R]):
    """:func:`in_time_order` one line at a time, so that a reader can stop and resume: between two
    lines its whole state is :attr:`latest` (the time and line of the latest snapshot kept) when
    nothing is :attr:`held` (what a summary checkpoint saves, dlmon/flow/sidecar.py)."""

    def __init__(self, latest: tuple[float, int] | None = None) -> None:
        self.latest = latest
        self.held: tuple[R, float, int] | None = None  # an early snapshot, waiting for the next one

    def push(self, number: int, record: R) -> list[R]:
        """What ``record`` (line ``number``) lets out, in order."""
        held, latest = self.held, self.latest
        if not isinstance(record, Snapshot | CheckedSnapshot):
            if held is not None and isinstance(record, RecordEnd):
                self.held = None
                return [cast(R, self._outlier_of(held, latest)), record]
            return [record]
        time = record.time
        if latest is None or time >= latest[0]:
            self.latest = (time, number)
            if held is not None:  # back in order: the held one was a lone outlier
                self.held = None
                return [cast(R, self._outlier_of(held, latest)), record]
            return [record]
        if held is None:
            self.held = (record, time, number)
            return []
        if time >= held[1]:  # two early lines in order: the clock stepped back
            self.latest, self.held = (time, number), None
            return [held[0], record]
        self.held = (record, time, number)
        return [cast(R, self._outlier_of(held, latest))]

    @staticmethod
    def _outlier_of(held: tuple[R, float, int], latest: tuple[float, int] | None) -> RecordProblem:
        assert latest is not None  # a snapshot is held only after a later one was kept
        return RecordProblem(held[2], f"out of time order (earlier than line {latest[1]})")

    def finish(self) -> list[R]:
        """The end of the lines: a snapshot still held was a lone outlier."""
        held, self.held = self.held, None
        if held is None:
            return []
        return [cast(R, self._outlier_of(held, self.latest))]


P = TypeVar("P", Record, CheckedRecord)


def _iter_lines(path: str, parse: Callable[[int, bytes], P]) -> Iterator[tuple[int, P]]:
    for _, number, record in _read_lines(path, 0, 1, False, parse):
        yield number, record


@overload
def read_lines_from(
    path: str, offset: int = 0, first_line: int = 1, *, offsets: Literal[True] = True
) -> Iterator[tuple[int, int, Record]]: ...
@overload
def read_lines_from(
    path: str, offset: int = 0, first_line: int = 1, *, offsets: Literal[False]
) -> Iterator[tuple[None, int, Record]]: ...
def read_lines_from(
    path: str, offset: int = 0, first_line: int = 1, *, offsets: bool = True
) -> Iterator[tuple[int | None, int, Record]]:
    """(byte offset, line number, record) of each line of ``path``, starting at byte ``offset``,
    where line number ``first_line`` begins (for ``.gz`` the offset counts the decompressed
    bytes): a replay seeks back to a place it indexed this way. The one line reader
    (``_read_lines``) serves it and :func:`iter_records`, which reads with ``offsets`` off, and then
    every offset is None (no ``tell()``, so a pipe reads too)."""
    return _read_lines(path, offset, first_line, offsets, parse_line)


def _read_lines(
    path: str, offset: int, first_line: int, offsets: bool, parse: Callable[[int, bytes], P]
) -> Iterator[tuple[int | None, int, P | RecordProblem]]:
    with open_record_file(path) as fh:
        if offset:
            fh.seek(offset)
        yield from _lines_in(fh, first_line, offsets, parse)


def _lines_in(
    fh: IO[bytes], first_line: int, offsets: bool, parse: Callable[[int, bytes], P]
) -> Iterator[tuple[int | None, int, P | RecordProblem]]:
    """The lines of ``fh`` from where it stands, the first numbered ``first_line``."""
    number = first_line - 1
    while True:
        number += 1
        at = fh.tell() if offsets else None
        try:
            raw = fh.readline(MAX_LINE_BYTES + 1)
        except (OSError, EOFError, zlib.error) as exc:  # a truncated or damaged .gz, a read error
            yield at, number, RecordProblem(number, f"unreadable from here on: {exc}")
            return
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            long = f"longer than {MAX_LINE_BYTES >> 20} MiB"
            rest = _skip_rest_of_line(fh)
            if rest == "eof":  # a last line torn by a crash mid-write: it ended, with the file
                yield at, number, RecordProblem(number, f"{long} and cut off at the end of the file")
                return
            if rest == "endless":
                yield at, number, RecordProblem(number, f"{long} and never ends: stopped")
                return
            yield at, number, RecordProblem(number, f"{long}: skipped")
            continue
        if not raw.strip():
            number += skip_blank_lines(fh)
            continue
        yield at, number, parse(number, raw)


BLANK = b" \t\r\n"


def skip_blank_lines(fh: IO[bytes]) -> int:
    """After a blank line: skip the blank lines that follow, a buffer at a time (a gzip of 400 M
    blank lines took 216 s by readline), up to the last newline before anything else; returns
    how many lines were skipped."""
    peek = getattr(fh, "peek", None)
    if peek is None:
        return 0
    skipped = 0
    while True:
        try:
            chunk = peek(1 << 16)
        except (OSError, EOFError, zlib.error):
            return skipped  # the next readline reports it
        blank = len(chunk) - len(chunk.lstrip(BLANK))
        cut = chunk.rfind(b"\n", 0, blank) + 1
        if cut <= 0:
            return skipped
        skipped += chunk.count(b"\n", 0, cut)
        fh.read(cut)


def _skip_rest_of_line(fh: IO[bytes]) -> Literal["ok", "eof", "endless"]:
    """Read past the end of an over-long line in bounded chunks: "ok" once past its newline,
    "eof" when the file ends first, "endless" when the line runs on for 16 times the cap
    (``/dev/zero`` has no end to skip to)."""
    for _ in range(16 * max(1, MAX_LINE_BYTES >> 20)):
        chunk = fh.readline(1 << 20)
        if not chunk:
            return "eof"
        if chunk.endswith(b"\n"):
            return "ok"
    return "endless"


def parse_line(number: int, raw: bytes) -> Record:
    record = _object(number, raw)
    return record if isinstance(record, RecordProblem) else _record_of(number, record)


def parse_line_checked(number: int, raw: bytes) -> CheckedRecord:
    """:func:`parse_line`, but a snapshot that reads as it stands comes as its checked object."""
    record = _object(number, raw)
    if isinstance(record, RecordProblem):
        return record
    if record.get("type", "snapshot") == "snapshot" and reads_as_is(record) and _times_in_range(record):
        return CheckedSnapshot(record["time"], record)
    return _record_of(number, record)


def _object(number: int, raw: bytes) -> dict[str, Any] | RecordProblem:
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return RecordProblem(number, "not JSON (a truncated or corrupt line)")
    if not isinstance(record, dict):
        return RecordProblem(number, "not a JSON object")
    return record


def _record_of(number: int, record: dict[str, Any]) -> Record:
    kind = record.get("type", "snapshot")
    if kind == "end":
        when = record.get("time")
        try:
            end_time = float(when) if isinstance(when, int | float) else None
        except OverflowError:  # a 400-digit integer: valid JSON, no time
            end_time = None
        if end_time is not None and not math.isfinite(end_time):
            end_time = None
        return RecordEnd(number, end_time, str(record.get("reason")))
    if kind != "snapshot":
        return RecordProblem(number, f"unknown record type {str(kind)[:40]!r}")
    try:
        snapshot = snapshot_from_dict(record)
    except (SnapshotFormatError, RecursionError) as exc:
        return RecordProblem(number, str(exc)[:200])
    bad_time = _time_out_of_range(snapshot)
    return RecordProblem(number, bad_time) if bad_time else snapshot


# Unix times the dashboard shows as a clock (time.localtime): 1e18 is a number, not a time, and
# would crash the dashboard (EOVERFLOW) after the reader passed it.
MAX_UNIX_TIME = 1e11  # the year 5138


def _time_out_of_range(snapshot: Snapshot) -> str | None:
    times = [("time", snapshot.time), ("target.start_unix_time", snapshot.target.start_unix_time)]
    times += [("worker_deaths.time", d.time) for d in snapshot.worker_deaths]
    times += [("alerts.since", a.since) for a in snapshot.alerts]
    for name, value in times:
        if value is not None and not 0 <= value < MAX_UNIX_TIME:
            return f"malformed snapshot: {name}: {value!r} is not a Unix time"
    return None


def _times_in_range(data: dict[str, Any]) -> bool:
    """:func:`_time_out_of_range` of a checked snapshot's object: True when it finds nothing."""
    times = [data["time"], data["target"]["start_unix_time"]]
    times += [d["time"] for d in data["worker_deaths"]]
    times += [a["since"] for a in data["alerts"]]
    return all(0 <= t < MAX_UNIX_TIME for t in times if t is not None)
