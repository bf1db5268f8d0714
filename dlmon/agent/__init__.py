"""dlmon's in-process agent: measures DataLoaders from inside the training process.

For a process not started by dlmon, two lines near the top of the training script::

    import dlmon.agent
    dlmon.agent.start()

``start()`` installs hooks into ``torch.utils.data`` when (and only if) the program imports it,
and serves cumulative counters as one JSON line on the Unix socket ``socket_path(os.getpid())``.
Importing this package imports the standard library only, never torch; a program that never
imports torch pays for one idle daemon thread and nothing else.

``arm()`` installs the same hooks but starts serving only when the process builds its first
DataLoader iterator; ``dlmon run`` uses it in children that ``multiprocessing`` spawns
(``torch.multiprocessing.spawn`` ranks), whose spawn-context DataLoader workers never serve.

Set ``DLMON_AGENT_DISABLE=1`` to make ``start()`` and ``arm()`` no-ops.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from typing import Any

from dlmon.agent import _hooks, _journal, _last_words, _rank, wire
from dlmon.agent._paths import socket_dir, socket_path

__all__ = ["arm", "counters", "serving_path", "socket_dir", "socket_path", "start", "start_injected"]

_lock = threading.Lock()
# The Server while serving. Not named ``_server``: importing the submodule dlmon.agent._server
# sets that attribute of this package to the module.
_serving: Any = None
_started_pid: int | None = None  # set once serving, so that a failed start() can be retried
_server_error: str | None = None
_fork_registered = False
_atexit_registered = False


def start() -> None:
    """Start the agent in this process. Idempotent; never raises; returns at once.

    A forked child (a DataLoader worker) does not inherit a running agent: it neither serves
    its parent's socket nor starts its own, unless it calls ``start()`` itself.
    """
    try:
        _start()
    except Exception as exc:  # the training must run whatever happens here
        _hooks.R.degraded["start"] = f"{type(exc).__name__}: {exc}"[:300]


def start_injected() -> None:
    """``start()`` for an agent loaded into the process while it runs (``dlmon attach --inject``):
    its replies say from when it counts. An agent already serving is left as it was. Never raises."""
    try:
        _start(injected=True)
    except Exception as exc:
        _hooks.R.degraded["start"] = f"{type(exc).__name__}: {exc}"[:300]


def arm() -> None:
    """Install the hooks now, and start serving at the first DataLoader iteration of this process.

    For processes that may or may not be trainings: the children that ``multiprocessing`` spawns
    (``torch.multiprocessing.spawn`` ranks, but also spawn-context DataLoader workers, which
    never iterate a DataLoader and so never serve). Never raises.
    """
    try:
        _arm()
    except Exception as exc:
        _hooks.R.degraded["start"] = f"{type(exc).__name__}: {exc}"[:300]


def _disabled() -> bool:
    return os.environ.get("DLMON_AGENT_DISABLE", "").strip().lower() not in ("", "0", "false", "no")


def _register_fork() -> None:
    global _fork_registered
    if not _fork_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_child)
        _fork_registered = True


def _install_hooks() -> None:
    try:
        _hooks.install()
    except Exception as exc:
        _hooks.R.degraded["install"] = f"{type(exc).__name__}: {exc}"[:300]


def _arm() -> None:
    if _disabled():
        return
    with _lock:
        if _started_pid == os.getpid():
            return
        _register_fork()
        _install_hooks()
        _hooks.R.on_first_iter = start


def _start(injected: bool = False) -> None:
    global _serving, _started_pid, _server_error, _atexit_registered
    if _disabled():
        return
    with _lock:
        pid = os.getpid()
        if _started_pid == pid:
            return
        _hooks.R.on_first_iter = None
        _register_fork()
        _install_hooks()
        _rank.current()  # read now; re-read lazily while the launcher has not set it yet
        from dlmon.agent._server import Server

        srv = Server()
        try:
            srv.open()
        except Exception as exc:
            _server_error = f"{type(exc).__name__}: {exc}"[:300]
            _hooks.R.degraded["server"] = _server_error
            srv.close(unlink=False)
            return
        _serving = srv
        _started_pid = pid
        if injected:
            _hooks.R.injected_unix_time = time.time()
            with contextlib.suppress(Exception):
                from dlmon.agent._loaders import adopt_calls_in_progress

                adopt_calls_in_progress()
        _last_words.install()  # its lines go to the journal, which exists from now on
        _server_error = None
        _hooks.R.degraded.pop("server", None)
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True


def _after_fork_child() -> None:
    """In a forked child: drop the parent's server (close our copies of its fds, never unlink)."""
    global _serving, _started_pid, _lock
    _lock = threading.Lock()  # another thread may have held it at fork time
    _hooks.R.lock = threading.Lock()
    _hooks.R.on_first_iter = None  # a forked child does not start an agent of its own
    _hooks.R.injected_unix_time = None
    srv = _serving
    _serving = None
    _started_pid = None
    _hooks.R.by_key.clear()  # the parent's workers are our siblings, not our children
    _journal.after_fork_child()
    _last_words.after_fork_child()
    _rank.reset()  # a child forked to be a rank gets its own variables
    if srv is not None:
        with contextlib.suppress(Exception):
            srv.close(unlink=False)


def _at_exit() -> None:
    srv = _serving
    if srv is not None and srv.pid == os.getpid():
        srv.close(unlink=True)


def counters() -> dict[str, Any]:
    """The same cumulative counters the socket serves, read in-process (for tests and tools).

    Works before ``start()`` and when the agent is disabled or failed to start; never raises.
    """
    try:
        from dlmon.agent._server import build_counters

        return dict(build_counters(_serving))
    except Exception as exc:
        return {"v": wire.WIRE_VERSION, "pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"[:300]}


def serving_path() -> str | None:
    """The socket this process's agent serves on, or None when it is not serving. Never raises."""
    try:
        srv = _serving
        if srv is None or srv.listener is None:
            return None
        path = srv.path
        return path if isinstance(path, str) else None
    except Exception:
        return None
