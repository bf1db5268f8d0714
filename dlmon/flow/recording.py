"""Record files: one JSON object per line. JSON only, never pickle.

Lines are ``{"type": "snapshot", ...}`` (see docs/snapshot.md) and, last, one
``{"type": "end", "time": ..., "reason": ...}`` saying why the recording stopped.

What a record file promises (docs/snapshot.md, "Record files"):

* whole lines only: each line goes out in one ``write()`` (the rest of a short write is written
  next, and the error a short write announces is caught); an error (ENOSPC, EIO) truncates the
  file back to the end of the last whole line before it is raised, so a full disk never leaves
  half a line. A SIGKILL during a ``write()`` of a regular file on a local file system leaves the
  line written or not (not a POSIX promise for every file system: readers skip and report a torn
  last line).
* durable up to ``FSYNC_EVERY_S``: the file is fsync'd at most every ``FSYNC_EVERY_S`` seconds
  and when it is closed, so a host crash loses at most the last ~10 s.
* never created or truncated before the target is known: :func:`check_record_path` checks a path
  without touching an existing file's contents.
* a path ending in ``.gz`` is written gzip'd, with the same promises: each line is compressed
  and fully flushed (``Z_FULL_FLUSH``) into one write, so every whole line is readable at any
  moment and no line refers back to one that a cut-back dropped. A SIGKILLed writer leaves no
  gzip trailer: readers get every whole line, then report the missing end (after a cut-back the
  trailer's checksum, which counts the dropped line, is reported the same way).
* beside a regular file, ``FILE.dlmon-summary``: the report's summary of the lines written so far,
  replaced every 30 s and at the end (dlmon/flow/sidecar.py). It never stops or slows the record
  beyond its own cost (measured in docs/performance.md); a failure only stops the checkpoints.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dlmon.model import Snapshot
from dlmon.model.serialize import snapshot_to_dict

if TYPE_CHECKING:
    from dlmon.flow.sidecar import CheckpointWriter

END_TARGET_EXITED = "target_exited"
END_INTERRUPTED = "interrupted"
END_DURATION = "duration"

FSYNC_EVERY_S = 10.0


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return _encode(snapshot_to_dict(snapshot))


def _encode(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()


class RecordPathRefused(OSError):
    """A record path dlmon will not write through (a symlink, a file that is not a record)."""


def _world_writable(directory: str) -> bool:
    try:
        return bool(os.stat(directory).st_mode & stat.S_IWOTH)
    except OSError:
        return False


def _looks_like_record(path: str) -> bool:
    """The first bytes of an existing file are those of a dlmon record (plain or gzip'd)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
        if head[:2] == b"\x1f\x8b":
            head = zlib.decompressobj(31).decompress(head, 4096)
    except (OSError, zlib.error):
        return False
    head = head.lstrip()
    return head.startswith(b'{"type":') or (head.startswith(b"{") and b'"schema":' in head)


def refuse_record_path(path: str, force: bool = False) -> None:
    """Raise :class:`RecordPathRefused` when writing ``path`` would replace what is not ours.

    A symlink to a file (or to nothing yet) is refused unless ``force``, and always in a
    world-writable directory (/tmp: another user may have planted it); a symlink to a device or a
    pipe (``/dev/stdout``) is fine. An existing non-empty file that is not a dlmon record is
    refused unless ``force``.
    """
    try:
        link = stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return  # nothing there (or not ours to look at: the open says why)
    if link and _is_own_std_stream(path):
        return  # -o /dev/stdout > file: the user's shell opened that file for us
    if link:
        try:
            target_mode: int | None = os.stat(path).st_mode
        except OSError:
            target_mode = None
        if target_mode is None or stat.S_ISREG(target_mode) or stat.S_ISDIR(target_mode):
            where = os.readlink(path)
            if _world_writable(os.path.dirname(os.path.abspath(path))):
                raise RecordPathRefused(
                    errno.ELOOP,
                    f"{path} is a symlink (to {where}) in a world-writable directory: "
                    "never followed (anyone may have planted it; --force does not change this)",
                )
            if not force:
                raise RecordPathRefused(
                    errno.ELOOP, f"{path} is a symlink (to {where}): not followed (--force writes through it)"
                )
    try:
        info = os.stat(path)
    except OSError:
        return
    if not force and stat.S_ISREG(info.st_mode) and info.st_size > 0 and not _looks_like_record(path):
        raise RecordPathRefused(
            errno.EEXIST, f"{path} exists and is not a dlmon record: not replaced (--force replaces it)"
        )


def _is_own_std_stream(path: str) -> bool:
    """``path`` (a symlink such as /dev/stdout or /proc/self/fd/2) leads to the very file our
    stdin, stdout or stderr is open on."""
    try:
        target = os.stat(path)
    except OSError:
        return False
    for fd in (0, 1, 2):
        try:
            own = os.fstat(fd)
        except OSError:
            continue
        if (own.st_dev, own.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


def check_record_path(path: str, force: bool = False) -> None:
    """Raise OSError when ``path`` cannot become a record file; never truncates or leaves a file.

    An existing file is opened for appending (nothing written); a new one is created and removed.
    See :func:`refuse_record_path` for the paths refused (``force``).
    """
    refuse_record_path(path, force)
    try:  # O_NONBLOCK: a FIFO without a reader would block here (ENXIO instead: fine, one may come)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO and _is_fifo(path):
            return
        if not isinstance(exc, FileNotFoundError):
            raise
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        os.close(fd)
        os.unlink(path)
        return
    os.close(fd)


def _is_fifo(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def _open_fifo(path: str) -> int | None:
    """A FIFO opened for writing without waiting (then blocking, like any pipe); None: no reader yet."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return None
        raise
    os.set_blocking(fd, True)
    return fd


def existing_bytes(path: str) -> int | None:
    """The size of the regular file at ``path`` that a recording would replace, else None."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) and info.st_size > 0 else None


class RecordWriter:
    def __init__(
        self, path: str, *, clock: Callable[[], float] = time.monotonic, checkpoints: bool = True
    ) -> None:
        """Create or truncate ``path``: -o names the file this recording becomes.

        :attr:`replaced_bytes` is the size of the regular file it replaced (None: nothing was
        there), so the caller can say so. A regular file gets summary checkpoints beside it
        (``checkpoints``; dlmon/flow/sidecar.py), which let ``dlmon report`` skip the lines they cover.
        """
        self.path = path
        self.replaced_bytes = existing_bytes(path)
        # A FIFO nobody reads yet: open() would block the whole watch (its --duration included).
        # Lines are dropped (counted) until a reader opens it, then written like to any pipe.
        self.waiting_for_reader = _is_fifo(path)
        self.dropped_lines = 0
        if self.waiting_for_reader:
            self._fd: int | None = _open_fifo(path)
            self.waiting_for_reader = self._fd is None
        else:  # in /tmp and the like, a symlink planted since the check is not followed either
            nofollow = os.O_NOFOLLOW if _world_writable(os.path.dirname(os.path.abspath(path))) else 0
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | nofollow
            self._fd = os.open(path, flags, 0o644)
        self._regular = self._fd is not None and stat.S_ISREG(os.fstat(self._fd).st_mode)
        self._offset = 0  # end of the last whole line
        self._clock = clock
        self._synced_at = clock()
        # gzip container (wbits 31); a fresh dictionary per line (Z_FULL_FLUSH), see the module doc
        self._gzip = zlib.compressobj(6, zlib.DEFLATED, 31) if path.endswith(".gz") else None
        self._checkpoints: CheckpointWriter | None = None
        if checkpoints and self._regular and self._names_the_file():
            from dlmon.flow.sidecar import CheckpointWriter  # the summary: only when recording

            self._checkpoints = CheckpointWriter(path, clock)

    def _names_the_file(self) -> bool:
        """``path`` is the regular file written, not a link to it: ``-o /dev/stdout`` (a shell's
        redirect to a file) would put its sidecar in /dev (as root), ``/proc/self/fd/1`` nowhere."""
        try:  # not an inode comparison: an fd on overlayfs (old kernels) reports the layer's inode
            return stat.S_ISREG(os.lstat(self.path).st_mode)
        except OSError:
            return False

    def write(self, snapshot: Snapshot) -> None:
        self._write(encode_snapshot(snapshot))

    def end(self, reason: str, **extra: Any) -> None:
        self._write(_encode({"type": "end", "time": time.time(), "reason": reason, **extra}))

    def _write(self, line: bytes) -> None:
        if self.waiting_for_reader:
            self._fd = _open_fifo(self.path)
            if self._fd is None:
                self.dropped_lines += 1
                return
            self.waiting_for_reader = False
        if self._fd is None:
            raise OSError(errno.EBADF, "the record file is closed")
        plain = line
        if self._gzip is not None:
            line = self._gzip.compress(line) + self._gzip.flush(zlib.Z_FULL_FLUSH)
        if not self._regular:  # a pipe or a device: no offset to go back to; finish the line
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view) :]
            return
        view = memoryview(line)
        try:
            while view:  # one write() normally; the rest of a short write, or the error it hides
                view = view[os.write(self._fd, view) :]
        except OSError:
            self._cut_back()
            raise
        self._offset += len(line)
        if self._checkpoints is not None:
            self._checkpoints.add(plain)
        if self._clock() - self._synced_at >= FSYNC_EVERY_S:
            self.sync()

    def _cut_back(self) -> None:
        """Drop the part of a line that did get written: the file ends with a whole line."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, self._offset)
            os.lseek(self._fd, self._offset, os.SEEK_SET)
        except OSError:
            pass

    def sync(self) -> None:
        if self._fd is not None and self._regular:
            os.fsync(self._fd)
        self._synced_at = self._clock()

    def close(self) -> None:
        """fsync and close; safe to call again. Raises OSError if the final fsync fails."""
        if self._fd is not None and self._gzip is not None:
            tail, self._gzip = self._gzip.flush(zlib.Z_FINISH), None  # the gzip trailer (CRC, size)
            with contextlib.suppress(OSError):  # the lines are all there; readers report the missing end
                os.write(self._fd, tail)
        if self._checkpoints is not None:  # the last one covers the whole record
            self._checkpoints.close()
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._regular:
                os.fsync(fd)
        finally:
            os.close(fd)
