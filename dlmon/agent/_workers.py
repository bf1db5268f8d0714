"""The loaders' worker processes: their pids, batches per worker, deaths, stack dumps.

Standard library only. The hooks here wrap functions of torch's ``signal_handling`` and
``worker`` modules and ``_MultiProcessingDataLoaderIter``; ``_hooks._patch_all`` installs them.
``_process_data`` (or ``_next_data``) runs once per batch: a closure that only adds, through
the iterator's state, and reads no global of dlmon's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from dlmon.agent import _journal, wire
from dlmon.agent._registry import R, _fail, _ok

TORCH_SIGNAL_MODULE = "torch.utils.data._utils.signal_handling"

MAX_DEATHS = 256


# ---------------------------------------------------------------------------------------------
# worker start: a stack-dump handler in each forked worker


def _make_worker_loop(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _worker_loop(*args: Any, **kwargs: Any) -> Any:
        try:
            wid = kwargs.get("worker_id", args[10] if len(args) > 10 else None)
            _journal.register_worker_stack_dump(wid if isinstance(wid, int) else None)
        except Exception:
            pass
        result = orig(*args, **kwargs)
        _journal.worker_exited_normally()
        return result

    return _worker_loop


def _make_worker_signal_handlers(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _set_worker_signal_handlers(*args: Any, **kwargs: Any) -> Any:
        result = orig(*args, **kwargs)
        _journal.enable_crash_dump()  # in front of torch's handlers, chaining to them
        return result

    return _set_worker_signal_handlers


# ---------------------------------------------------------------------------------------------
# worker pids, batches per worker


def _make_set_pids(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _set_worker_pids(key: Any, pids: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(key, pids, *args, **kwargs)
        try:
            st = R.by_key.get(key)
            if st is not None:
                st.pids = tuple(int(p) for p in pids)
        except Exception:
            pass
        return result

    return _set_worker_pids


def _make_remove_pids(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _remove_worker_pids(key: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            st = R.by_key.pop(key, None)
            if st is not None:
                st.pids = ()
        except Exception:
            pass
        return orig(key, *args, **kwargs)

    return _remove_worker_pids


class _NoSuchType:
    pass


def _make_process_data(orig: Callable[..., Any], exc_wrapper: type | None) -> Callable[..., Any]:
    ew: type = exc_wrapper if exc_wrapper is not None else _NoSuchType

    def _process_data(self: Any, data: Any, worker_idx: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(data, ew):  # a worker's exception, re-raised by torch: not a batch
            try:  # noqa: SIM105 -- hot path: a with-block costs more than a try
                self._dlmon_st.per_worker[worker_idx] += 1
            except Exception:
                pass
        return orig(self, data, worker_idx, *args, **kwargs)

    return _process_data


def _make_next_data_task_info(orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def _next_data(self: Any) -> Any:
        wid = None
        try:
            if getattr(self, "_in_order", True):
                info = self._task_info.get(self._rcvd_idx)
                if info:
                    wid = info[0]
        except Exception:
            pass
        data = orig(self)
        if wid is not None:
            try:  # noqa: SIM105 -- hot path
                self._dlmon_st.per_worker[wid] += 1
            except Exception:
                pass
        return data

    return _next_data


# ---------------------------------------------------------------------------------------------
# worker deaths


def _make_set_sigchld(orig: Callable[[], Any]) -> Callable[[], Any]:
    def _set_SIGCHLD_handler() -> Any:
        result = orig()
        try:
            _install_sigchld_observer()
        except Exception as exc:
            _fail("sigchld", exc)
        return result

    return _set_SIGCHLD_handler


def _install_sigchld_observer() -> None:
    """Put an observer in front of torch's SIGCHLD handler; it chains to it.

    Only torch's own handler is ever wrapped: SIG_IGN, SIG_DFL or a handler the program set
    (perhaps after torch's) is left exactly as it is, and deaths are then found when polled.
    """
    if threading.current_thread() is not threading.main_thread():
        if getattr(signal.getsignal(signal.SIGCHLD), "__dlmon_observer__", False):
            return  # in already (an iterator built in a thread after the main thread's)
        R.sigchld_deferred = True  # signal.signal works in the main thread only
        R.degraded["sigchld"] = (
            "handler not installed yet (not the main thread): at the main thread's next batch; "
            "until then deaths are found when polled"
        )
        return
    R.sigchld_deferred = False
    prev = signal.getsignal(signal.SIGCHLD)
    if getattr(prev, "__dlmon_observer__", False):
        return
    if not callable(prev) or getattr(prev, "__module__", None) != TORCH_SIGNAL_MODULE:
        R.degraded["sigchld"] = "SIGCHLD handler is the program's, not torch's: deaths found when polled"
        return
    torch_handler = prev

    def observer(signum: int, frame: FrameType | None) -> Any:
        with contextlib.suppress(Exception):
            scan_worker_deaths()
        return torch_handler(signum, frame)  # raises "DataLoader worker ... is killed"

    observer.__dlmon_observer__ = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGCHLD, observer)
    _ok("sigchld")


def install_deferred_sigchld_observer() -> None:
    """In an iterator's first batch seen by the agent (off the per-batch path): the observer that
    could not be installed from the thread that loaded the agent, now from the main thread."""
    if R.sigchld_deferred and threading.current_thread() is threading.main_thread():
        try:
            _install_sigchld_observer()
        except Exception as exc:
            R.sigchld_deferred = False
            _fail("sigchld", exc)


def scan_worker_deaths() -> None:
    """Record dead worker processes without reaping them (waitid WNOWAIT): torch still sees them.

    Workers that are not our children (started by a forkserver) cannot be waited for: that is
    reported under ``degraded["worker_deaths"]``.
    """
    scanned = False
    not_ours: int | None = None
    for st in list(R.by_key.values()):
        pids = st.pids
        for worker_id, pid in enumerate(pids):
            if pid in R.dead_pids:
                continue
            scanned = True
            try:
                res = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                not_ours = pid
                continue
            except OSError:
                continue
            if res is None or res.si_pid == 0:
                continue
            code = res.si_code
            sig: int | None = None
            exit_code: int | None = None
            if code in (os.CLD_KILLED, os.CLD_DUMPED):
                sig = res.si_status
            elif code == os.CLD_EXITED:
                exit_code = res.si_status
                if exit_code == 0:
                    continue  # a normal shutdown, not a death
            else:
                continue
            rec = wire.worker_death_wire(
                pid=pid,
                worker_id=worker_id,
                loader_id=st.loader.serial,
                iterator_id=st.serial,
                signal=sig,
                signal_name=_signal_name(sig),
                exit_code=exit_code,
                core_dumped=code == os.CLD_DUMPED,
                time_ns=time.monotonic_ns(),
                unix_time=time.time(),
                loader_name=st.loader.name,
            )
            if R.dead_pids.setdefault(pid, rec) is rec:
                R.deaths.append(rec)
                _journal.append_death(rec)  # before torch raises: it outlives the trainer
                if len(R.deaths) > MAX_DEATHS:
                    del R.deaths[: len(R.deaths) - MAX_DEATHS]
                if len(R.dead_pids) > 4 * MAX_DEATHS:
                    R.dead_pids.clear()
                    R.dead_pids.update({int(d["pid"]): d for d in R.deaths})
    if not_ours is not None:
        R.degraded["worker_deaths"] = (
            f"worker {not_ours} is not a child of this process (forkserver workers?): "
            "waitid gives ECHILD, so its death cannot be seen"
        )
    elif scanned:
        R.degraded.pop("worker_deaths", None)


def _signal_name(sig: int | None) -> str | None:
    if sig is None:
        return None
    try:
        return signal.Signals(sig).name
    except ValueError:
        return None
