"""Hooks into ``torch.utils.data`` and the cumulative counters they feed.

Standard library only. Torch is never imported here: the hooks are installed by a post-import
hook when the program itself imports ``torch.utils.data.dataloader`` (which ``import torch``
does), or at once when it is already imported.

Hot path (``_BaseDataLoaderIter.__next__``): two ``perf_counter_ns`` calls, a few attribute
reads and writes and integer adds into a list owned by the loader. No locks, no I/O, no
allocation beyond what the interpreter does for ints. The serving thread reads the same lists
without locking: every counter is cumulative and monotonic, so a torn read only means that one
number is a few nanoseconds or one batch behind another. The entry time of a call in progress
is written to its iterator's state (``t_in``) and cleared on the way out, so that a stall shows
while it lasts.

Known cosmetic effect: a warning that torch issues inside ``__next__`` with ``stacklevel=2``
(today only "Length of IterableDataset ... was reported to be ...") names this file, the caller
of torch's ``__next__``, instead of the user's loop; the message itself is unchanged. Hooking
``_next_data`` instead would avoid that, but the rest of ``__next__`` (torch's profiler range,
two GIL releases, in which the multiprocessing queue's feeder thread runs) would then count as
compute: about 1% of the data wait in a plain multi-worker loop, more under GIL
contention. Timing the whole ``__next__`` is what the user's own ``next()`` sees, so it stays.
Warnings issued with ``stacklevel=2`` in the iterator classes' ``__init__`` name dlmon's
wrapper instead of ``DataLoader.__iter__`` (torch's own code either way).

Every hook body is wrapped: an exception inside dlmon never reaches the training. The
original torch function's own exceptions (``StopIteration``, worker errors) pass unchanged.

The hooks live by responsibility, each module importing only those before it:
``_registry`` (``R``, the counter slots, ``_fail``/``_ok``, hook marks), ``_workers`` (worker
pids, batches per worker, deaths, SIGCHLD), ``_sites`` (the user's site, framework, role),
``_epochs`` (epoch ends and starts, sample counting), ``_loaders`` (loader and iterator
construction, ``prune_loaders``), and this module: ``__next__``, the import hook and
``_patch_all``. The names other modules and tests use are re-exported here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from dlmon.agent import _last_words
from dlmon.agent._epochs import (
    _call_ended,
    _epoch_started,
    _epoch_stopped_by_length,
    _on_stop,
    _probe_samples,
)
from dlmon.agent._loaders import (
    _late_attach,
    _make_loader_init,
    _on_subclass,
    _patch_iter_class,
    _patch_loader_class,
)
from dlmon.agent._loaders import prune_loaders as prune_loaders
from dlmon.agent._registry import B_BATCHES as B_BATCHES
from dlmon.agent._registry import B_COMPUTE as B_COMPUTE
from dlmon.agent._registry import B_END as B_END
from dlmon.agent._registry import B_EPOCHS as B_EPOCHS
from dlmon.agent._registry import B_EPOCHS_STARTED as B_EPOCHS_STARTED
from dlmon.agent._registry import B_SAMPLES as B_SAMPLES
from dlmon.agent._registry import B_STARTUP as B_STARTUP
from dlmon.agent._registry import B_WAIT as B_WAIT
from dlmon.agent._registry import R as R
from dlmon.agent._registry import (
    _fail,
    _has_hook,
    _is_ours,
    _mark,
    _ok,
    _pc,
)
from dlmon.agent._registry import _IterState as _IterState
from dlmon.agent._registry import _LoaderState as _LoaderState
from dlmon.agent._registry import sample_num_threads as sample_num_threads
from dlmon.agent._workers import (
    _install_sigchld_observer,
    _make_process_data,
    _make_remove_pids,
    _make_set_pids,
    _make_set_sigchld,
    _make_worker_loop,
    _make_worker_signal_handlers,
)
from dlmon.agent._workers import _make_next_data_task_info as _make_next_data_task_info
from dlmon.agent._workers import scan_worker_deaths as scan_worker_deaths

DATALOADER_MODULE = "torch.utils.data.dataloader"
WORKER_MODULE = "torch.utils.data._utils.worker"


# ---------------------------------------------------------------------------------------------
# the import hook


class _PatchingLoader:
    """Wraps the real loader of torch.utils.data.dataloader; patches after the module executes."""

    def __init__(self, real: Any) -> None:
        self._dlmon_real = real

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._dlmon_real, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        real = self._dlmon_real
        try:  # the module sees its real loader (inspect, linecache, torch.package)
            module.__loader__ = real
            if module.__spec__ is not None:
                module.__spec__.loader = real
        except Exception:
            pass
        real.exec_module(module)
        on_dataloader_imported(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dlmon_real, name)


class _PostImportFinder:
    """A ``sys.meta_path`` finder that only answers for torch.utils.data.dataloader."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != DATALOADER_MODULE or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            for finder in list(sys.meta_path):
                if finder is self:
                    continue
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is None:
                    continue
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                else:
                    _fail("import_hook", "torch.utils.data.dataloader has a loader without exec_module")
                return spec
            return None
        except Exception as exc:
            _fail("import_hook", exc)
            return None
        finally:
            self._busy.on = False


_finder: _PostImportFinder | None = None


def install() -> None:
    """Patch now if torch.utils.data is imported, else arrange to patch when it is."""
    global _finder
    if R.patched:
        return
    mod = sys.modules.get(DATALOADER_MODULE)
    if mod is not None and getattr(mod, "_BaseDataLoaderIter", None) is not None:
        on_dataloader_imported(mod)
        return
    if _finder is None:
        _finder = _PostImportFinder()
        sys.meta_path.insert(0, _finder)


def _remove_finder() -> None:
    global _finder
    if _finder is not None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(_finder)
        _finder = None


def on_dataloader_imported(module: ModuleType) -> None:
    """Install every hook; each one that fails is listed in ``degraded`` and left out."""
    try:
        if R.patched:
            return
        R.patched = True
        _remove_finder()
        torch_mod = sys.modules.get("torch")
        tfile = getattr(torch_mod, "__file__", None)
        if isinstance(tfile, str):
            R.torch_dir = os.path.dirname(os.path.abspath(tfile)) + os.sep
        _patch_all(module)
        sample_num_threads()
    except Exception as exc:
        _fail("install", exc)


def _patch_all(dl: ModuleType) -> None:
    base = getattr(dl, "_BaseDataLoaderIter", None)
    loader_cls = getattr(dl, "DataLoader", None)
    mp_cls = getattr(dl, "_MultiProcessingDataLoaderIter", None)

    # 0. SIGCHLD observer, chained in front of torch's handler. First: loaded off the main thread
    #    into a running job, this is where the observer is deferred to the main thread's next
    #    batch, and that batch must not come through the patched __next__ before the deferral
    #    is set (a running iterator passes through _late_attach once only).
    sh = None
    try:
        utils = getattr(dl, "_utils", None) or sys.modules.get("torch.utils.data._utils")
        sh = getattr(utils, "signal_handling", None)
        if sh is None:
            raise AttributeError("no torch.utils.data._utils.signal_handling")
        if not hasattr(os, "waitid") or not hasattr(os, "WNOWAIT"):
            raise AttributeError("os.waitid with WNOWAIT is not available on this platform")
        set_h = sh._set_SIGCHLD_handler
        if not _is_ours(set_h):
            sh._set_SIGCHLD_handler = _mark(_make_set_sigchld(set_h), set_h, "sigchld")
        _ok("sigchld")
        if getattr(sh, "_SIGCHLD_handler_set", False):  # torch's handler is already there
            _install_sigchld_observer()
    except Exception as exc:
        _fail("sigchld", f"{type(exc).__name__}: {exc}; deaths found only when polled")

    # 1. __next__: the throughput/wait counters. Without it nothing else is worth much.
    try:
        if base is None:
            raise AttributeError("torch.utils.data.dataloader has no _BaseDataLoaderIter")
        found = 0
        for cls in (base, *base.__subclasses__()):
            orig = cls.__dict__.get("__next__")
            if orig is None:
                continue
            found += 1
            if not _has_hook(orig, "next"):
                cls.__next__ = _mark(_make_next(orig), orig, "next")
        if not found:
            raise AttributeError("no __next__ found on _BaseDataLoaderIter")
        _ok("iter_next")
    except Exception as exc:
        _fail("iter_next", exc)

    # 2. iterator construction: preallocated per-iterator state, the loader's settings.
    try:
        if base is None:
            raise AttributeError("no _BaseDataLoaderIter")
        # the base class too: iterator classes defined later (torchdata's StatefulDataLoader)
        # reach it through super().__init__; the first such iterator patches its own class
        for cls in (base, *base.__subclasses__()):
            _patch_iter_class(cls)
        _ok("iter_init")
    except Exception as exc:
        _fail("iter_init", exc)

    # 3. DataLoader construction: where the user built it (file:line), for a readable name.
    try:
        if loader_cls is None:
            raise AttributeError("no DataLoader")
        orig = loader_cls.__dict__["__init__"]
        if not _is_ours(orig):
            loader_cls.__init__ = _mark(_make_loader_init(orig), orig, "loader_init")
        # subclasses defined later whose __init__ may not call DataLoader.__init__ (torchdata's
        # StatefulDataLoader): named where they are built too
        for sub in loader_cls.__subclasses__():
            _patch_loader_class(sub)
        _on_subclass(loader_cls, _patch_loader_class)
        if base is not None:
            _on_subclass(base, _patch_iter_class)
        _ok("loader_init")
    except Exception as exc:
        _fail("loader_init", exc)

    # 4. worker pids: dataloader.py calls _utils.signal_handling._set_worker_pids(...) through the
    #    module attribute, so that attribute is where it is looked up and where it is patched.
    try:
        if sh is None:
            raise AttributeError("no torch.utils.data._utils.signal_handling")
        set_orig = sh._set_worker_pids
        rm_orig = sh._remove_worker_pids
        if not _is_ours(set_orig):
            sh._set_worker_pids = _mark(_make_set_pids(set_orig), set_orig, "set_pids")
        if not _is_ours(rm_orig):
            sh._remove_worker_pids = _mark(_make_remove_pids(rm_orig), rm_orig, "remove_pids")
        _ok("worker_pids")
    except Exception as exc:
        _fail("worker_pids", f"{type(exc).__name__}: {exc}; worker pids read from iterator._workers")

    # 5. batches per worker.
    try:
        if mp_cls is None:
            raise AttributeError("no _MultiProcessingDataLoaderIter")
        orig = mp_cls.__dict__.get("_process_data")
        if orig is None:
            raise AttributeError("no _MultiProcessingDataLoaderIter._process_data")
        code = getattr(orig, "__code__", None)
        if code is not None and code.co_argcount >= 3:
            if not _is_ours(orig):
                ew = getattr(dl, "ExceptionWrapper", None)
                if not isinstance(ew, type):
                    ew = getattr(sys.modules.get("torch._utils"), "ExceptionWrapper", None)
                mp_cls._process_data = _mark(
                    _make_process_data(orig, ew if isinstance(ew, type) else None), orig, "process_data"
                )
            _ok("batches_per_worker")
        else:
            # older torch: _process_data(self, data); the worker of the next in-order batch is
            # in _task_info[_rcvd_idx] before _next_data runs.
            nd = mp_cls.__dict__.get("_next_data")
            if nd is None:
                raise AttributeError("no _process_data(self, data, worker_idx) and no _next_data")
            if not _has_hook(nd, "task_info"):  # around the timing hook, if that is there already
                mp_cls._next_data = _mark(_make_next_data_task_info(nd), nd, "task_info")
            _ok("batches_per_worker")
            R.degraded["batches_per_worker"] = "derived from _task_info (in-order batches only)"
    except Exception as exc:
        _fail("batches_per_worker", exc)

    # 7. worker start: a stack-dump handler in each forked worker, for hang diagnosis.
    try:
        wmod = sys.modules.get(WORKER_MODULE)
        loop = getattr(wmod, "_worker_loop", None)
        if loop is None:
            raise AttributeError("no torch.utils.data._utils.worker._worker_loop")
        if not _is_ours(loop):
            wmod._worker_loop = _mark(_make_worker_loop(loop), loop, "worker_loop")  # type: ignore[union-attr]
        wsh = getattr(sh, "_set_worker_signal_handlers", None)
        if wsh is not None and not _is_ours(wsh):
            sh._set_worker_signal_handlers = _mark(_make_worker_signal_handlers(wsh), wsh, "worker_signals")  # type: ignore[union-attr]
        _ok("worker_stacks")
    except Exception as exc:
        _fail("worker_stacks", exc)


# ---------------------------------------------------------------------------------------------
# __next__


def _make_next(orig: Callable[[Any], Any]) -> Callable[[Any], Any]:
    pc = _pc

    def __next__(self: Any) -> Any:
        t0 = pc()
        st = getattr(self, "_dlmon_st", None)
        try:
            first = self._num_yielded == 0
        except Exception:
            first = False
        if st is not None:
            try:
                st.t_in = t0  # a call in progress, visible to the serving thread
                if first:  # a new epoch, even one begun without finishing the last
                    if st.in_epoch:  # the last one stopped by length, without StopIteration
                        _epoch_stopped_by_length(st)
                    st.in_epoch = False
                    st.last_ret = 0
            except Exception:
                pass
        try:
            data = orig(self)
        except StopIteration:
            if st is not None:
                _on_stop(st, t0, first)
            raise
        except BaseException as exc:
            if st is not None:
                _call_ended(st)
            _last_words.left_next(st, exc)  # never raises
            raise
        t1 = pc()
        if st is None:
            _late_attach(self, data, t0, t1, first)
            return data
        try:
            st.t_in = 0
            c = st.c
            if first:
                c[4] += t1 - t0  # B_STARTUP
                c[7] += 1  # B_EPOCHS_STARTED
                st.in_epoch = True
                _epoch_started(st)
                _last_words.note_batch(st, data)  # once an epoch: its size, for a shm verdict
            else:
                c[2] += t1 - t0  # B_WAIT
                lr = st.last_ret
                if lr:
                    c[3] += t0 - lr  # B_COMPUTE
            st.last_ret = t1
            c[0] += 1  # B_BATCHES
            m = st.mode
            try:
                if m == 1:
                    n = data.shape[0]
                elif m == 2:
                    n = data[0].shape[0]
                elif m == 3:
                    n = next(iter(data.values())).shape[0]
                elif m == 4:
                    n = st.bs
                else:
                    n = _probe_samples(st, data)
            except Exception:
                n = _probe_samples(st, data)
            c[1] += n
        except Exception:
            pass
        return data

    return __next__
