"""A lifeline between dlmon and a training that must not outlive it (``dlmon demo``'s).

dlmon keeps the write end of a pipe; the training inherits the read end and a thread there
blocks on it. When dlmon goes away by any means (the terminal closed and SIGHUP, a crash,
SIGKILL), the kernel closes the write end and the read returns end-of-file: the training stops
itself. Unlike PR_SET_PDEATHSIG this needs no ctypes and does not fire when merely the thread
that forked the training ends. dlmon writes :data:`RELEASE` instead when the user chose to leave
the training running. Standard library only: the training imports it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import threading
import time
from collections.abc import Callable

ENV = "DLMON_LIFELINE_FD"  # the read end's fd number, in the training's environment
RELEASE = b"k"  # "keep running": dlmon goes, the training stays, as the user asked
STOP_GRACE_S = 10.0  # after the SIGINT, how long a clean stop may take before SIGKILL


def open_lifeline() -> tuple[int, int]:
    """(read end, to pass to the training; write end, dlmon's, never inherited)."""
    read_end, write_end = os.pipe()
    return read_end, write_end


def release(write_end: int) -> None:
    """Let the training outlive dlmon (the user chose to leave it running)."""
    with contextlib.suppress(OSError):
        os.write(write_end, RELEASE)
    with contextlib.suppress(OSError):
        os.close(write_end)


def _stop_self(grace_s: float) -> None:
    """SIGINT (a clean KeyboardInterrupt), then SIGKILL to the whole group if that does not end it."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(grace_s)
    leader = os.getpgrp() == os.getpid()  # dlmon starts the training in its own group: workers too
    with contextlib.suppress(OSError):
        if leader:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        else:
            os.kill(os.getpid(), signal.SIGKILL)


def hold_from_env(on_cut: Callable[[], None] = lambda: None) -> bool:
    """In the training: hold the lifeline named in ``$DLMON_LIFELINE_FD`` if there is one (taken
    out of the environment: its children have none). True if held."""
    text = os.environ.pop(ENV, "")
    if not text.isdigit():
        return False
    return hold(int(text), on_cut)


def hold(read_end: int, on_cut: Callable[[], None] = lambda: None, grace_s: float = STOP_GRACE_S) -> bool:
    """In the training: a daemon thread that stops this process when dlmon goes away.
    ``on_cut`` runs first (e.g. a line in the training's log saying why it stops). An fd that is
    not a pipe (closed, /dev/null, a file: a stray ``$DLMON_LIFELINE_FD``) is no lifeline: its
    end-of-file would stop a training that dlmon never meant to stop. False then."""
    try:
        if not stat.S_ISFIFO(os.fstat(read_end).st_mode):
            return False
        os.set_inheritable(read_end, False)  # forked workers and subprocesses need not hold it
    except OSError:
        return False

    def watch() -> None:
        try:
            data = os.read(read_end, 1)
        except OSError:
            return  # not a pipe (a bad --lifeline-fd): no lifeline rather than a false stop
        if data == RELEASE:
            return
        with contextlib.suppress(Exception):
            on_cut()
        _stop_self(grace_s)

    threading.Thread(target=watch, name="dlmon-lifeline", daemon=True).start()
    return True
