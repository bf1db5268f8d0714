"""Summary checkpoints beside a record file: ``RUN.jsonl.dlmon-summary`` (issue 26).

``dlmon report`` of a day at 1 Hz parsed 86 400 lines of ~5 KiB each; :func:`json.loads` alone of
each line costs more than the goal of a day in under 2 s. The recorder already holds every line it
writes, so it feeds each one, as the report's own reader would read it back
(:func:`dlmon.flow.records.parse_line_checked` and :class:`~dlmon.flow.records.TimeOrder`), into a
:class:`~dlmon.flow.summary.Summarizer`, and every ``CHECKPOINT_EVERY_S`` and at the end saves that
summary's state beside the record: JSON, never pickle, written to a temporary file and renamed.

A checkpoint says how many bytes and lines of the (uncompressed) record it covers and their
SHA-256. The report hashes that many bytes of the record (~1.7 GB/s, against ~0.2 GB/s for
parsing), and only where they match takes the saved state and reads the lines after them. The
state is a function of the covered bytes alone (the same reader fed the same bytes), so a match
gives the same summary, byte for byte, as reading every line. Anything else (no sidecar, a record
edited or cut short before the checkpoint, a damaged or foreign sidecar, one of another format or
dlmon version, a symlink) is silently the full read: the same output, at the old speed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from dlmon import __version__
from dlmon.flow.records import (
    MAX_LINE_BYTES,
    CheckedRecord,
    TimeOrder,
    open_record_file,
    parse_line_checked,
    resume_checked_records,
)
from dlmon.flow.summary import (
    DISTRIBUTIONS,
    FIGURES,
    MAX_ALERT_WINDOWS,
    MAX_DEATHS,
    MAX_PROBLEMS,
    MAX_SLOTS,
    RESERVOIR_SIZE,
    SERIES_POINTS,
    StateError,
    Summarizer,
)

SUFFIX = ".dlmon-summary"
FORMAT = "dlmon-summary"
VERSION = 1  # of the sidecar and the summary state in it: bumped when either changes meaning
CHECKPOINT_EVERY_S = 30.0
MAX_SIDECAR_BYTES = 64 * 1024 * 1024
HASH = "sha256"  # hashlib's sha256 runs at ~1.7 GB/s here against blake2b's ~1.2 (SHA extensions)
READ_CHUNK = 1 << 20

# What the saved state's meaning depends on besides VERSION: the figures and the caps.
TABLES = [
    [f.key for f in FIGURES],
    list(DISTRIBUTIONS),
    [SERIES_POINTS, RESERVOIR_SIZE, MAX_ALERT_WINDOWS, MAX_DEATHS, MAX_PROBLEMS, MAX_SLOTS],
]


def sidecar_path(record_path: str) -> str:
    return record_path + SUFFIX


class CheckpointWriter:
    """Fed each line the recorder wrote (uncompressed, in order, whole lines only); saves the
    summary of what it was fed every ``CHECKPOINT_EVERY_S`` and at :meth:`close`. Never raises:
    a failure (a full disk, a sidecar path that is not a regular file) stops the checkpoints,
    and the last one saved stays valid for the bytes it covers."""

    def __init__(self, record_path: str, clock: Callable[[], float]) -> None:
        self.path = sidecar_path(record_path)
        self._record_path = record_path
        self._summarizer = Summarizer(record_path)
        self._order: TimeOrder[CheckedRecord] = TimeOrder()
        self._hash = hashlib.sha256()
        self._bytes = 0
        self._lines = 0
        self._clock = clock
        self._saved_at = clock()
        self._saved_bytes = -1
        self.stopped: str | None = None  # why checkpoints stopped
        try:
            if not _regular_or_absent(self.path):
                self.stopped = f"{self.path} is not a regular file: not replaced"
        except OSError as exc:  # a name 14 bytes short of NAME_MAX: the record itself must still open
            self.stopped = f"{type(exc).__name__}: {exc}"

    def add(self, line: bytes) -> None:
        if self.stopped is not None:
            return
        try:
            if len(line) > MAX_LINE_BYTES:  # read back another way than written: not vouched for
                self.stopped = "a line longer than the reader's cap"
                return
            self._hash.update(line)
            self._bytes += len(line)
            self._lines += 1
            for record in self._order.push(self._lines, parse_line_checked(self._lines, line)):
                self._summarizer.feed(record)
            if self._clock() - self._saved_at >= CHECKPOINT_EVERY_S:
                self.save()
        except Exception as exc:  # the recording goes on without checkpoints
            self.stopped = f"{type(exc).__name__}: {exc}"

    def save(self) -> None:
        """Save a checkpoint of every line fed so far (unless one is held back for time order)."""
        self._saved_at = self._clock()
        if self.stopped is not None or self._order.held is not None or self._saved_bytes == self._bytes:
            return
        try:
            # the record's own permissions: it holds the command line and the last snapshot
            mode = stat.S_IMODE(os.stat(self._record_path).st_mode) & 0o666
            _write_atomically(self.path, self._encode(), mode)
            self._saved_bytes = self._bytes
        except Exception as exc:
            self.stopped = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        self.save()
        self.stopped = self.stopped or "closed"

    def _encode(self) -> bytes:
        checkpoint = {
            "format": FORMAT,
            "version": VERSION,
            "dlmon": __version__,
            "tables": TABLES,
            "covers": {"bytes": self._bytes, "lines": self._lines, HASH: self._hash.hexdigest()},
            "latest": list(self._order.latest) if self._order.latest is not None else None,
            "summary": self._summarizer.to_state(),
        }
        return json.dumps(checkpoint, separators=(",", ":")).encode()


def _regular_or_absent(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return True


def _write_atomically(path: str, data: bytes, mode: int) -> None:
    """``data`` as ``path``, whole or not at all: a temporary file beside it, renamed over it.
    A symlink (or anything not a regular file) at ``path`` is left alone: never written through,
    never replaced. ``mode``: its permission bits."""
    if not _regular_or_absent(path):
        raise OSError(f"{path} is not a regular file")
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)  # O_EXCL, 0600
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.close(fd)
        fd = -1
        os.replace(tmp, path)  # rename(2) replaces the name; it never follows a link there
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclass(frozen=True, slots=True)
class Checkpoint:
    bytes: int
    lines: int
    digest: str
    latest: tuple[float, int] | None
    summary: Any  # Summarizer.to_state()


def read_checkpoint(record_path: str) -> Checkpoint | None:
    """The sidecar's checkpoint when it is one this dlmon wrote in this format, owned by the
    record's owner; else None."""
    try:
        fd = os.open(sidecar_path(record_path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_SIDECAR_BYTES:
            return None
        # one planted beside the record (/tmp) could hold figures of its own with the right hash
        record = os.stat(record_path)
        if info.st_uid != record.st_uid:
            return None
        if not stat.S_ISREG(record.st_mode):  # a FIFO: bytes hashed are gone for the full read
            return None
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = json.loads(fh.read(MAX_SIDECAR_BYTES + 1))
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            return None
        if data.get("dlmon") != __version__ or data.get("tables") != TABLES:
            return None
        covers, latest = data["covers"], data["latest"]
        size, lines, digest = covers["bytes"], covers["lines"], covers[HASH]
        if type(size) is not int or type(lines) is not int or type(digest) is not str:
            return None
        if size < 0 or lines < 0:
            return None
        if latest is not None:
            time, line = latest
            if type(time) is not float or type(line) is not int:
                return None
            latest = (time, line)
        return Checkpoint(size, lines, digest, latest, data["summary"])
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)


def resumed_summary(path: str) -> tuple[Summarizer, Iterator[CheckedRecord]] | None:
    """The summary the sidecar of ``path`` saved and the records after the lines it covers, when
    the record's first bytes are still the ones it covers; else None (read every line)."""
    checkpoint = read_checkpoint(path)
    if checkpoint is None:
        return None
    try:
        summarizer = Summarizer.from_state(path, checkpoint.summary)
    except StateError:
        return None
    try:
        fh = open_record_file(path)
    except OSError:
        return None
    try:
        matches = _hash_of_first(fh, checkpoint.bytes) == checkpoint.digest
    except Exception:  # OSError, a damaged .gz (EOFError, zlib.error): the full read says where
        matches = False
    if not matches:
        fh.close()
        return None
    return summarizer, _records_after(fh, checkpoint.lines + 1, checkpoint.latest)


def _hash_of_first(fh: IO[bytes], size: int) -> str | None:
    """The digest of the first ``size`` bytes of ``fh``, leaving it there; None when shorter."""
    digest = hashlib.sha256()
    left = size
    while left:
        chunk = fh.read(min(READ_CHUNK, left))
        if not chunk:
            return None
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest()


def _records_after(
    fh: IO[bytes], first_line: int, latest: tuple[float, int] | None
) -> Iterator[CheckedRecord]:
    with fh:
        yield from resume_checked_records(fh, first_line, latest)
