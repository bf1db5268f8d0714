"""Python stacks read from outside a process: DataLoader workers forked before the agent was loaded
into a running job (``attach --inject``) have no stack handler to signal, and must not be sent its
signal (its default action kills them).

- py-spy (``pip install py-spy``), ``dump --nonblocking``: reads the process's memory without
  stopping any thread. The stack may be torn (read while it changed); it is labelled so.
- else gdb's ``py-bt``, where the target's Python ships its gdb extension (``python3.X-gdb.py``
  next to the executable, as pyenv installs it): gdb stops the process for the read.
- else no stack, and one line saying how to get one.

A read takes py-spy ~0.1 s and gdb a second or more (up to its timeout): :class:`BackgroundReads`
runs them on a thread of their own, one process at a time, and the sampler's next tick picks up
what is done. The sampling thread never waits for py-spy or gdb.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from dlmon.model.snapshot import StackFrame

PY_SPY_TIMEOUT_S = 5.0
GDB_TIMEOUT_S = 15.0
SOURCE_PY_SPY = "py-spy"
SOURCE_GDB = "gdb"
SOURCE_NONE = "none"

_PY_BT_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>\S+)')
_EXE_VERSION = re.compile(r"python(3\.\d+)$")
# reads waiting, and results not yet picked up, at most (a loader's MAX_WORKERS)
MAX_QUEUED = 16

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class OutsideStack:
    source: str  # SOURCE_PY_SPY, SOURCE_GDB or SOURCE_NONE
    thread: str | None
    frames: tuple[StackFrame, ...]  # outermost first


class BackgroundReads(Generic[T]):
    """Runs ``read(worker id, pid, start time)`` for each :meth:`ask` on a daemon thread of its own,
    one at a time (so gdb stops at most one worker at once), and hands back the results that are not
    None at the next :meth:`take`. A read asked for while the same one waits or runs is not queued
    twice; past ``limit`` waiting reads (or results not taken) new ones are dropped. The thread ends
    when nothing is left to read, and starts again at the next ask: a healthy job has none."""

    def __init__(self, read: Callable[[int, int, int | None], T | None], limit: int = MAX_QUEUED) -> None:
        self._read = read
        self._limit = limit
        self._lock = threading.Lock()
        self._wanted: dict[tuple[int, int, int | None], None] = {}  # in the order asked
        self._busy: tuple[int, int, int | None] | None = None
        self._done: list[T] = []
        self._thread: threading.Thread | None = None

    def ask(self, wid: int, pid: int, start: int | None) -> None:
        key = (wid, pid, start)
        with self._lock:
            if key not in self._wanted and key != self._busy and len(self._wanted) < self._limit:
                self._wanted[key] = None
            if self._thread is None and self._wanted:
                thread = threading.Thread(target=self._run, name="dlmon-outside-stacks", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # no thread to be had now: the next ask tries again
                    return
                self._thread = thread

    def take(self) -> list[T]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._wanted:
                    self._thread = None
                    return
                key = next(iter(self._wanted))
                del self._wanted[key]
                self._busy = key
            try:
                got = self._read(*key)
            except Exception:
                got = None
            with self._lock:
                self._busy = None
                if got is not None and len(self._done) < self._limit:
                    self._done.append(got)


def read_stack(pid: int, prefer: str = "_worker_loop") -> OutsideStack:
    """The stack of the thread of ``pid`` whose frames include ``prefer`` (else its first thread),
    by the first way that works here. Never raises."""
    spy = shutil.which("py-spy")
    if spy is not None:
        got = _py_spy(spy, pid, prefer)
        if got is not None:
            return got
    gdb, extension = shutil.which("gdb"), gdb_extension(pid)
    if gdb is not None and extension is not None:
        got = _py_bt(gdb, extension, pid)
        if got is not None:
            return got
    return OutsideStack(SOURCE_NONE, None, ())


def parse_py_spy(text: str, prefer: str) -> tuple[str | None, tuple[StackFrame, ...]] | None:
    """(thread name, frames outermost first) from ``py-spy dump --json``; None if it is not that."""
    try:
        threads = json.loads(text)
    except ValueError:
        return None
    if not isinstance(threads, list):
        return None
    chosen: tuple[str | None, tuple[StackFrame, ...]] | None = None
    for t in threads:
        if not isinstance(t, dict) or not isinstance(t.get("frames"), list):
            continue
        frames = tuple(
            StackFrame(
                str(f.get("filename", "?")),
                f["line"] if isinstance(f.get("line"), int) else None,
                str(f.get("name", "?")),
            )
            for f in reversed(t["frames"])
            if isinstance(f, dict)
        )
        name = t.get("thread_name") if isinstance(t.get("thread_name"), str) else None
        if any(f.function == prefer for f in frames):
            return name, frames
        if chosen is None:
            chosen = (name, frames)
    return chosen


def _py_spy(spy: str, pid: int, prefer: str) -> OutsideStack | None:
    cmd = [spy, "dump", "--nonblocking", "--json", "--pid", str(pid)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    got = parse_py_spy(done.stdout, prefer)
    if got is None or not got[1]:
        return None
    return OutsideStack(SOURCE_PY_SPY, got[0], got[1])


def gdb_extension(pid: int) -> str | None:
    """The target's ``python3.X-gdb.py`` next to its executable, if its Python ships one."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except OSError:
        return None
    m = _EXE_VERSION.search(os.path.basename(exe))
    if m is None:
        return None
    path = os.path.join(os.path.dirname(exe), f"python{m.group(1)}-gdb.py")
    return path if os.path.isfile(f"/proc/{pid}/root{path}") else None


def parse_py_bt(text: str) -> tuple[StackFrame, ...]:
    """gdb's ``py-bt`` (most recent call first) as frames outermost first."""
    frames = [
        StackFrame(m.group("file"), int(m.group("line")), m.group("func"))
        for m in map(_PY_BT_FRAME.match, text.splitlines())
        if m is not None
    ]
    return tuple(reversed(frames))


def _py_bt(gdb: str, extension: str, pid: int) -> OutsideStack | None:
    # the main thread's Python stack: a DataLoader worker's loop runs there
    stopped_before = _state(pid) == "T"
    done: subprocess.CompletedProcess[str] | None = None
    # the symbols of the executable and libpython only: a torch worker maps hundreds of MB of .so
    # files whose reading would keep it stopped for seconds
    cmd = [gdb, "-q", "-batch", "-nx", "-iex", "set auto-load off", "-iex", "set auto-solib-add off"]
    cmd += ["-p", str(pid), "-ex", "sharedlibrary libpython", "-ex", f"source {extension}", "-ex", "py-bt"]
    try:
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=GDB_TIMEOUT_S,
            check=False,
            env={**os.environ, "LC_ALL": "C"},
        )
    except (OSError, subprocess.SubprocessError):
        done = None
    finally:
        # gdb killed (at the timeout, or by a signal) may leave its attach's SIGSTOP behind: the
        # process stopped already, or (the SIGSTOP handed back as gdb died) stopping a moment
        # later, after any look at its state. SIGCONT now both resumes it and cancels that stop.
        # Not a process stopped before (the user's Ctrl-Z stays).
        if not stopped_before and (done is None or done.returncode < 0 or _state(pid) == "T"):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
    if done is None:
        return None
    frames = parse_py_bt(done.stdout)
    return OutsideStack(SOURCE_GDB, "MainThread", frames) if frames else None


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
        return stat[stat.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        return None
