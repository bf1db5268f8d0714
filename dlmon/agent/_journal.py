"""Last words that outlive the process: files in the agent's private (0700) directory.

``<pid>.deaths.jsonl``: one JSON line per worker death, appended with a single ``write`` on an
``O_APPEND`` descriptor the moment the SIGCHLD observer sees it, so that dlmon reads it even when
the trainer dies the next millisecond (torch raises at once and nobody polls the socket again).
The file is left behind on purpose: dlmon reads it after the trainer has exited. A new agent
with the same pid removes its predecessor's; the socket sweep removes old ones.

Exceptions that end the training (``dlmon.agent._last_words``) go to the same journal, as lines
with ``kind: "exception"``. An exception may be "Too many open files": a descriptor is kept in
reserve (``/dev/null``) and given up for the moment of that write.

``<pid>.stack``: a DataLoader worker's stack dump file. The worker registers ``faulthandler``
for :data:`STACK_SIGNAL` at start (C-level handler: it dumps even while the worker is stuck in C
code holding the GIL; nothing runs until the signal comes). Its first line says which process
wrote it (pid and start time) so that dlmon never signals a process that did not register.

Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

DEATHS_SUFFIX = ".deaths.jsonl"
STACK_SUFFIX = ".stack"
MAX_LINE = 4096
JOURNAL_KEEP_S = 24 * 3600.0
# A real-time signal: torch uses none; its default action (terminate) is why dlmon sends it only
# to a process whose stack file says it registered the handler.
STACK_SIGNAL = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else None
STACK_HEADER = "dlmon-stack"

_dir: str | None = None  # the agent's directory, once it serves
# the reserve descriptor (none or one), freed to write last words when the process has run out of
# fds; a list because pop is atomic: two threads' last words never close one fd twice (the second
# close could hit a descriptor the training opened in between)
_reserve: list[int] = []


def set_directory(directory: str, pid: int) -> None:
    """The agent serves from ``directory``: remove a journal a previous process with our pid left."""
    global _dir
    _dir = directory
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(directory, f"{pid}{DEATHS_SUFFIX}"))
    _hold_reserve()


def _hold_reserve() -> None:
    if _reserve:
        return
    with contextlib.suppress(OSError):
        _reserve.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    while len(_reserve) > 1:  # another thread took one at the same time
        _close_reserve()


def _close_reserve() -> None:
    try:
        fd = _reserve.pop()
    except IndexError:
        return
    with contextlib.suppress(OSError):
        os.close(fd)


def directory() -> str | None:
    return _dir


def append_death(rec: Mapping[str, object]) -> None:
    """One line, one write, O_APPEND: a reader never sees half a line from a live writer."""
    try:
        line = json.dumps(rec, separators=(",", ":"), default=str).encode("utf-8") + b"\n"
        if len(line) > MAX_LINE:
            return
        _append(line)
    except Exception:
        pass


# the fields of a last-words line that may be long, cut in this order until the line fits
_SHRINKABLE = ("traceback", "message", "worker_message", "loader_name", "thread", "file", "function")


def fit_line(rec: dict[str, Any], limit: int = MAX_LINE) -> bytes:
    """``rec`` as one JSON line of at most ``limit`` bytes: long text fields are cut (the
    traceback keeps its end, where the error is; messages their start), never dropped."""
    rec = dict(rec)
    line = json.dumps(rec, separators=(",", ":"), default=str).encode("utf-8") + b"\n"
    for key in _SHRINKABLE:
        for _ in range(8):  # an escaped character takes up to 6 bytes: a few rounds at most
            text = rec.get(key)
            if len(line) <= limit or not isinstance(text, str) or len(text) <= 41:
                break
            keep = max(40, len(text) - (len(line) - limit) - 8)
            rec[key] = "…" + text[-keep:] if key == "traceback" else text[:keep] + "…"
            line = json.dumps(rec, separators=(",", ":"), default=str).encode("utf-8") + b"\n"
    return line


def append_last_words(rec: dict[str, Any]) -> None:
    """An exception's line, written even when the process has no descriptor left: the reserve
    one is closed for the write (and for counting the open ones), then taken again."""
    if _dir is None:
        return
    try:
        _close_reserve()
        try:
            fds = open_fd_count()
            if fds is not None:
                rec["open_fds"] = fds
            limit = _fd_limit()
            if limit is not None:
                rec["fd_limit"] = limit
            _append(fit_line(rec))
        finally:
            _hold_reserve()
    except Exception:
        pass


def open_fd_count() -> int | None:
    """Descriptors open in this process, the one that lists them standing for the reserve one."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def _fd_limit() -> int | None:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return None if soft == resource.RLIM_INFINITY else int(soft)
    except Exception:
        return None


def _append(line: bytes) -> None:
    d = _dir
    if d is None:
        return
    try:
        fd = os.open(
            os.path.join(d, f"{os.getpid()}{DEATHS_SUFFIX}"),
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
            0o600,
        )
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except Exception:
        pass


def sweep_old(d: str, now: float | None = None, limit: int = 512) -> int:
    """Remove journals and stack files older than a day (their processes are long gone)."""
    now = time.time() if now is None else now
    removed = 0
    try:
        names = os.listdir(d)[:limit]
    except OSError:
        return 0
    for name in names:
        if not (name.endswith(DEATHS_SUFFIX) or name.endswith(STACK_SUFFIX)):
            continue
        path = os.path.join(d, name)
        try:
            if now - os.lstat(path).st_mtime > JOURNAL_KEEP_S:
                os.unlink(path)
                removed += 1
        except OSError:
            continue
    return removed


def _own_start_time() -> int | None:
    try:
        with open("/proc/self/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


_stack_file: Any = None  # kept open for the life of the worker: faulthandler writes to its fd


def register_worker_stack_dump(worker_id: int | None) -> None:
    """In a DataLoader worker, at start: dump all threads' stacks to our file on STACK_SIGNAL.

    Only when the signal is nobody's (SIG_DFL or SIG_IGN as Python knows it): a handler the
    program set for it is the program's, and chaining to it would make dlmon's request run it.
    The header, which is what lets dlmon send the signal, is written only once the handler is in
    place: a request can never meet the default action (terminate).
    """
    global _stack_file
    d = _dir
    if d is None or STACK_SIGNAL is None or _stack_file is not None:
        return
    try:
        import faulthandler

        prev = signal.getsignal(STACK_SIGNAL)
        if prev is not signal.SIG_DFL and prev is not signal.SIG_IGN:
            return  # the program's (a Python handler) or unknown to Python (None: a C handler)
        path = os.path.join(d, f"{os.getpid()}{STACK_SUFFIX}")
        fd = os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
        )
        f = os.fdopen(fd, "w", buffering=1)
        try:
            faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=False)
        except Exception:
            f.close()  # no fd left behind in the worker
            raise
        _stack_file = f
        f.write(f"{STACK_HEADER} pid={os.getpid()} start={_own_start_time()} worker={worker_id}\n")
        f.flush()
    except Exception:
        pass


def enable_crash_dump() -> None:
    """After torch set the worker's own fatal-signal handlers: dump the stacks on SIGSEGV, SIGBUS,
    SIGABRT, SIGFPE, SIGILL into the stack file first, then let torch's handler run as before.

    A faulthandler the program enabled (PYTHONFAULTHANDLER) is lost in a worker anyway: torch's
    worker handlers replace it; this one goes in after them and chains to them."""
    f = _stack_file
    if f is None:
        return
    try:
        import faulthandler

        faulthandler.enable(file=f, all_threads=True)
    except Exception:
        pass


def worker_exited_normally() -> None:
    """The worker loop returned: its stack file is of no use to anyone now."""
    if _stack_file is None or _dir is None:
        return
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(_dir, f"{os.getpid()}{STACK_SUFFIX}"))


def after_fork_child() -> None:
    """A forked child does not inherit its parent's stack file (it registers its own, if a worker),
    nor keep its copy of the parent's reserve descriptor."""
    global _stack_file
    _stack_file = None
    _close_reserve()
