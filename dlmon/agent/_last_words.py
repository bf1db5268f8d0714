"""The training's last words: the exceptions that end it, written to the death journal at once.

Three places an exception is seen, each appended as one journal line (``kind: "exception"``):

- ``origin: "next"``: an exception that leaves a DataLoader iterator's ``__next__``. A worker's
  exception arrives here re-raised by torch (``ExceptionWrapper``): its message says ``Caught X in
  DataLoader worker process N`` and carries the worker's own traceback, from which the worker id,
  the original exception and the user's frame are parsed. The program may catch it and go on:
  this line alone is no death (the reader decides from how the process ended).
- ``origin: "main"``: the main thread's uncaught exception (``sys.excepthook``): the process dies.
- ``origin: "thread"``: another thread's uncaught exception (``threading.excepthook``): that
  thread ends; the process may go on.

The hooks chain to the ones they replace and call them whatever happens here: the user sees the
same traceback as without dlmon. Nothing runs on the normal path of ``__next__``: ``left_next``
is called only in its ``except`` branch, and ``note_batch`` once per epoch (the first batch).

Lines carry no ``pid`` key (the training's pid is ``process``): a dlmon that predates them reads
the journal's ``pid`` lines as worker deaths and skips these.

Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from dlmon.agent import _journal
from dlmon.agent._code_paths import is_library_file, library_prefixes

KIND = "exception"
MAX_RECORDS = 32  # lines per process: a loop that catches and retries must not fill the disk
MAX_FRAMES = 200  # traceback frames walked
MAX_MESSAGE = 600  # characters of a message kept before the line is fitted to MAX_LINE
MAX_TRACEBACK = 2400
MAX_BATCH_LEAVES = 256  # tensors looked at when sizing a batch
MAX_SIZED_LOADERS = 64

_WORKER_HEADER = re.compile(r"Caught (\S+) in (DataLoader worker process (\d+)|pin memory thread[^.\n]*)")
# the function name is stripped after the match: "(.+?)\s*$" backtracks quadratically on a line
# ending in a long run of spaces (the exception hook runs in the training)
_FRAME_LINE = re.compile(r'^\s*File "(.+?)", line (\d+), in (.+)$')

_count = 0
_batch_bytes: dict[int, int] = {}  # loader serial -> bytes of its last measured batch
_installed = False
_pid: int | None = None  # the process the hooks were installed in (a forked child writes nothing)


# -- the hooks ---------------------------------------------------------------------------------


def install() -> None:
    """Chain dlmon's hooks in front of ``sys.excepthook`` and ``threading.excepthook``. Idempotent."""
    global _installed, _pid
    _pid = os.getpid()
    if _installed:
        return
    _installed = True
    library_prefixes()  # now, not in an except branch
    try:
        prev = sys.excepthook
        if not getattr(prev, "__dlmon_last_words__", False):
            sys.excepthook = _make_excepthook(prev)
    except Exception:
        pass
    try:
        prev_t = threading.excepthook
        if not getattr(prev_t, "__dlmon_last_words__", False):
            threading.excepthook = _make_thread_excepthook(prev_t)
    except Exception:
        pass


def _make_excepthook(prev: Callable[..., Any]) -> Callable[..., Any]:
    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> Any:
        # the user's traceback is printed whatever happens here (a second Ctrl-C included)
        with contextlib.suppress(BaseException):
            if isinstance(exc, Exception):
                _record(exc, "main", tb, None)
        return prev(exc_type, exc, tb)

    excepthook.__dlmon_last_words__ = True  # type: ignore[attr-defined]
    return excepthook


def _make_thread_excepthook(prev: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def excepthook(args: Any) -> Any:
        with contextlib.suppress(BaseException):
            exc = args.exc_value
            if isinstance(exc, Exception):
                thread = args.thread
                _record(exc, "thread", args.exc_traceback, None, getattr(thread, "name", None))
        return prev(args)

    excepthook.__dlmon_last_words__ = True  # type: ignore[attr-defined]
    return excepthook


def left_next(st: Any, exc: BaseException) -> None:
    """In ``__next__``'s except branch: ``exc`` leaves the DataLoader (StopIteration never comes here)."""
    try:
        if isinstance(exc, Exception) and _count < MAX_RECORDS:
            _record(exc, "next", exc.__traceback__, st)
    except Exception:
        pass


def note_batch(st: Any, data: Any) -> None:
    """The first batch of an epoch: remember its size in bytes (tensors only), for the shm verdict."""
    try:
        serial = st.loader.serial
        if serial not in _batch_bytes and len(_batch_bytes) >= MAX_SIZED_LOADERS:
            return
        n = batch_bytes(data)
        if n:
            _batch_bytes[serial] = n
    except Exception:
        pass


def batch_bytes(data: Any) -> int | None:
    """Bytes of the tensors in a (nested) batch, looking at MAX_BATCH_LEAVES of them at most."""
    total = 0
    seen = 0
    stack = [data]
    while stack and seen < MAX_BATCH_LEAVES:
        x = stack.pop()
        if isinstance(x, Mapping):
            stack.extend(x.values())
            continue
        if isinstance(x, (list, tuple)):
            stack.extend(x)
            continue
        nbytes = getattr(x, "nbytes", None)
        if isinstance(nbytes, int) and hasattr(x, "shape"):
            total += nbytes
            seen += 1
    return total or None


# -- one line ------------------------------------------------------------------------------------


def _record(
    exc: BaseException, origin: str, tb: TracebackType | None, st: Any, thread: str | None = None
) -> None:
    global _count
    if _count >= MAX_RECORDS + (1 if origin == "main" else 0) or os.getpid() != _pid:
        return
    _count += 1
    rec = describe(exc, tb)
    rec.update(
        kind=KIND,
        origin=origin,
        process=os.getpid(),
        thread=thread or threading.current_thread().name,
        unix_time=time.time(),
        seq=_count,
    )
    if st is not None:
        loader = st.loader
        rec["loader_id"] = loader.serial
        rec["loader_name"] = loader.name
        rec["batches"] = int(loader.c[0])
        size = _batch_bytes.get(loader.serial)
        if size is not None:
            rec["batch_bytes"] = size
        for key in ("num_workers", "prefetch_factor"):  # a job that dies at once was never polled
            value = loader.settings.get(key)
            if isinstance(value, int):
                rec[key] = value
    strategy = _sharing_strategy()
    if strategy is not None:
        rec["sharing_strategy"] = strategy
    if _is_memory_error(rec) and rec.get("worker_id") is None:  # this process's limit, not a worker's
        limit = _address_space_limit()
        if limit is not None:
            rec["address_space_limit"] = limit
    _journal.append_last_words(rec)


def describe(exc: BaseException, tb: TracebackType | None) -> dict[str, Any]:
    """What the verdict needs of ``exc``: its type and message, the worker's exception it carries
    (if torch re-raised one), the user's frame, and the traceback's tail."""
    rec: dict[str, Any] = {"type": _type_name(exc), "message": _message(exc)}
    frames = _frames(tb)
    wrapped = _worker_exception(exc)
    if wrapped is not None:
        text = _message(wrapped, limit=64 * 1024)
        head = _WORKER_HEADER.search(text)
        if head is not None:
            rec["worker_id"] = int(head.group(3)) if head.group(3) is not None else None
            rec["worker_origin"] = "worker" if head.group(3) is not None else "pin_memory"
            original = text[text.find("Original Traceback") :]
            wframes, last = _parse_traceback(original)
            if last:
                wtype, _, wmsg = last.partition(": ")
                rec["worker_type"] = wtype.strip()[:200]
                rec["worker_message"] = wmsg.strip()[:MAX_MESSAGE]
            elif head.group(1):
                rec["worker_type"] = head.group(1)
            frames = wframes or frames
            rec["message"] = text.splitlines()[0][:MAX_MESSAGE] if text else rec["message"]
            rec["traceback"] = original[-MAX_TRACEBACK:]
    user = _user_frame(frames)
    if user is not None:
        rec["file"], rec["line"], rec["function"] = user
        rec["raised_there"] = user == frames[-1]  # the user's own line raised, not a library under it
    if "traceback" not in rec:
        rec["traceback"] = "\n".join(f'  File "{f}", line {n}, in {fn}' for f, n, fn in frames[-12:])
    return rec


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    mod = getattr(cls, "__module__", "") or ""
    name = getattr(cls, "__qualname__", cls.__name__)
    return name if mod in ("builtins", "__main__", "") else f"{mod}.{name}"


def _message(exc: BaseException, limit: int = MAX_MESSAGE) -> str:
    try:
        text = str(exc)
    except Exception:
        return "<str() of the exception failed>"
    return text[:limit]


def _worker_exception(exc: BaseException) -> BaseException | None:
    """``exc`` or one of the exceptions it chains to that torch re-raised from a worker."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        seen += 1
        try:
            head = str(e)[:400]
        except Exception:
            head = ""
        if "Caught " in head and ("DataLoader worker process" in head or "pin memory thread" in head):
            return e
        e = e.__cause__ or e.__context__
    return None


def _frames(tb: TracebackType | None) -> list[tuple[str, int, str]]:
    out: list[tuple[str, int, str]] = []
    while tb is not None and len(out) < MAX_FRAMES:
        code = tb.tb_frame.f_code
        out.append((code.co_filename, tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    return out


def _parse_traceback(text: str) -> tuple[list[tuple[str, int, str]], str]:
    """Frames of a traceback's text (its last section) and its final ``Type: message`` line."""
    frames: list[tuple[str, int, str]] = []
    last = ""
    tail_start = False
    for line in text.splitlines():
        m = _FRAME_LINE.match(line)
        if m is not None:
            frames.append((m.group(1), int(m.group(2)), m.group(3).strip()))
            tail_start, last = True, ""
            continue
        if not tail_start or line.startswith(" ") or not line.strip():
            continue
        if line.startswith(("During handling of the above", "The above exception was")):
            frames, tail_start, last = [], False, ""
            continue
        if not last:
            last = line.strip()
    return frames, last


def _user_frame(frames: list[tuple[str, int, str]]) -> tuple[str, int, str] | None:
    for frame in reversed(frames):
        if not is_library_file(frame[0]):
            return frame
    return None


def _sharing_strategy() -> str | None:
    try:
        tm = sys.modules.get("torch.multiprocessing")
        get = getattr(tm, "get_sharing_strategy", None)
        got = get() if get is not None else None
        return got if isinstance(got, str) else None
    except Exception:
        return None


def _is_memory_error(rec: Mapping[str, Any]) -> bool:
    return "MemoryError" in (rec.get("worker_type") or rec.get("type") or "")


def _address_space_limit() -> int | None:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        return None if soft == resource.RLIM_INFINITY else int(soft)
    except Exception:
        return None


def after_fork_child() -> None:
    """A forked child (a DataLoader worker) counts its own lines; the parent's batch sizes are not its."""
    global _count
    _count = 0
    _batch_bytes.clear()
