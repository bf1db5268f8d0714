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
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import FunctionType, ModuleType
from typing import Any

from dlmon.agent import _last_words, _tune
from dlmon.agent._epochs import (
    _call_ended,
    _epoch_started,
    _epoch_stopped_by_length,
    _on_stop,
    _probe_samples,
)
from dlmon.agent._registry import B_BATCHES as B_BATCHES
from dlmon.agent._registry import B_COMPUTE as B_COMPUTE
from dlmon.agent._registry import B_END as B_END
from dlmon.agent._registry import B_EPOCHS as B_EPOCHS
from dlmon.agent._registry import B_EPOCHS_STARTED as B_EPOCHS_STARTED
from dlmon.agent._registry import B_SAMPLES as B_SAMPLES
from dlmon.agent._registry import B_STARTUP as B_STARTUP
from dlmon.agent._registry import B_WAIT as B_WAIT
from dlmon.agent._registry import (
    M_CONST,
    _fail,
    _has_hook,
    _is_ours,
    _mark,
    _ok,
    _pc,
)
from dlmon.agent._registry import R as R
from dlmon.agent._registry import _IterState as _IterState
from dlmon.agent._registry import _LoaderState as _LoaderState
from dlmon.agent._registry import sample_num_threads as sample_num_threads
from dlmon.agent._sites import (
    _built_by_library,
    _framework_context,
    _loader_class_framework,
    _note_context,
    _set_site,
    _tune_site,
    _user_site,
)
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


MAX_LOADERS = 256  # live + retained dead loaders in the report
MAX_LIVE_LOADERS = 256  # beyond this many live loaders, new ones are not measured (degraded)
MAX_DEAD_LOADERS = 32
DEAD_LOADER_KEEP_NS = 300 * 1_000_000_000


class _TooManyLoaders(Exception):
    pass


# Iterators whose state could not be attached (their class refuses the attribute, or too many
# loaders): never tried again, so that a refusal costs one set lookup per batch, not a new state.
_attach_failed: weakref.WeakSet[Any] = weakref.WeakSet()
_attach_failed_types: set[type] = set()


def _attach_refused(it: Any) -> bool:
    if type(it) in _attach_failed_types:
        return True
    try:
        return it in _attach_failed
    except TypeError:  # not hashable
        return False


def _remember_attach_failure(it: Any) -> None:
    try:
        _attach_failed.add(it)
    except TypeError:  # not weak-referenceable or not hashable: give up on its class
        _attach_failed_types.add(type(it))


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
    sh = None
    try:
        utils = getattr(dl, "_utils", None) or sys.modules.get("torch.utils.data._utils")
        sh = getattr(utils, "signal_handling", None)
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

    # 6. SIGCHLD observer, chained in front of torch's handler.
    try:
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


def _late_attach(it: Any, data: Any, t0: int, t1: int, first: bool) -> None:
    """An iterator built before the hooks were installed: attach state now and count this batch."""
    try:
        if _attach_refused(it):
            return
        st = _attach(it, None)
        if st is None:
            return
        c = st.c
        if first:
            c[4] += t1 - t0
            c[7] += 1
        else:
            c[2] += t1 - t0
        st.in_epoch = True
        st.last_ret = t1
        c[0] += 1
        c[1] += _probe_samples(st, data)
    except Exception:
        pass


# ---------------------------------------------------------------------------------------------
# construction: loaders and iterators


def _make_loader_init(orig: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if _tune.active():  # dlmon tune: this loader's arguments may come from DLMON_TUNE
            call_args, kwargs = _tune.rewrite(orig, _tune_site(self), (self, *args), kwargs)
            orig(*call_args, **kwargs)
        else:
            orig(self, *args, **kwargs)
        with contextlib.suppress(Exception):
            _loader_constructed(self)

    return __init__


_patched_iter_classes: set[type] = set()


def _on_subclass(cls: type, patch: Callable[[type], None]) -> None:
    """Call ``patch`` on every subclass of ``cls`` defined from now on (``__init_subclass__``,
    chained to what the class had: typing.Generic's for torch's DataLoader)."""
    prev = cls.__dict__.get("__init_subclass__")
    if getattr(getattr(prev, "__func__", None), "__dlmon_subclass__", False):
        return
    parent: Any = cls

    def __init_subclass__(sub: Any, /, **kwargs: Any) -> None:
        if isinstance(prev, classmethod):
            prev.__func__(sub, **kwargs)
        else:
            super(parent, sub).__init_subclass__(**kwargs)
        with contextlib.suppress(Exception):
            patch(sub)

    __init_subclass__.__dlmon_subclass__ = True  # type: ignore[attr-defined]
    setattr(cls, "__init_subclass__", classmethod(__init_subclass__))  # noqa: B010 -- mypy: a method


_patched_loader_classes: set[type] = set()


def _patch_loader_class(cls: type) -> None:
    if cls in _patched_loader_classes:
        return
    _patched_loader_classes.add(cls)
    orig = cls.__dict__.get("__init__")
    if not isinstance(orig, FunctionType) or _is_ours(orig):
        return  # none, or not a plain function (a functools.partialmethod: not callable as is)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        with contextlib.suppress(Exception):
            _loader_constructed(self)  # once: DataLoader.__init__'s hook may have named it already

    cls.__init__ = _mark(__init__, orig, "loader_subclass_init")  # type: ignore[misc]


def _patch_iter_class(cls: type) -> None:
    """Hook ``__init__`` and ``_reset`` where ``cls`` defines them (once per class).

    ``_reset`` is hooked on subclasses only: a persistent-worker iterator is restarted through
    the most derived one (``DataLoader.__iter__`` calls ``iterator._reset(loader)``)."""
    if cls in _patched_iter_classes:
        return
    _patched_iter_classes.add(cls)
    orig = cls.__dict__.get("__init__")
    if isinstance(orig, FunctionType) and not _is_ours(orig):
        cls.__init__ = _mark(_make_iter_init(orig), orig, "iter_init")  # type: ignore[misc]
    reset = cls.__dict__.get("_reset")
    if isinstance(reset, FunctionType) and cls.__name__ != "_BaseDataLoaderIter" and not _is_ours(reset):
        cls._reset = _mark(_make_reset(reset), reset, "reset")  # type: ignore[attr-defined]


def _make_reset(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _reset(self: Any, loader: Any, *args: Any, **kwargs: Any) -> Any:
        st: _IterState | None = None
        with contextlib.suppress(Exception):
            first_iter = kwargs.get("first_iter", args[0] if args else False)
            got = getattr(self, "_dlmon_st", None)
            # not inside __init__ (first_iter) or another hooked _reset: those are timed already
            if not first_iter and isinstance(got, _IterState) and not got.t_in:
                st = got
                _epoch_stopped_by_length(st)  # a persistent iterator restarted mid-epoch
                _note_context(st.loader, *_framework_context())
        if st is None:
            return orig(self, loader, *args, **kwargs)
        t0 = _pc()
        st.t_in = t0  # restarting the workers' epoch is start-up wait
        try:
            return orig(self, loader, *args, **kwargs)
        finally:
            with contextlib.suppress(Exception):
                st.t_in = 0
                st.c[B_STARTUP] += _pc() - t0

    return _reset


def _make_iter_init(orig: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(self, "_dlmon_st", None) is not None or _attach_refused(self):  # done by an outer hook
            orig(self, loader, *args, **kwargs)
            return
        if R.on_first_iter is not None:
            _first_iter()
        st: _IterState | None = None
        with contextlib.suppress(Exception):
            _patch_iter_class(type(self))  # a class defined after the hooks: its next iterators
            st = _attach(self, loader)
        t0 = _pc()
        if st is not None:
            st.t_in = t0  # building the iterator (starting workers) is start-up wait
        try:
            orig(self, loader, *args, **kwargs)
        finally:
            if st is not None:
                with contextlib.suppress(Exception):
                    st.t_in = 0
                    st.c[B_STARTUP] += _pc() - t0
                    _iter_constructed(self, st)

    return __init__


def _first_iter() -> None:
    """The first DataLoader iterator of this process is being built: run the armed callback once."""
    cb = R.on_first_iter
    R.on_first_iter = None
    if cb is not None:
        try:
            cb()
        except Exception as exc:
            R.degraded["start"] = f"{type(exc).__name__}: {exc}"[:300]


def _new_loader_state() -> _LoaderState:
    if len(R.loaders) >= MAX_LIVE_LOADERS:
        prune_loaders()
        live = sum(1 for ls in list(R.loaders.values()) if ls.alive)
        if live >= MAX_LIVE_LOADERS:
            R.degraded["loaders"] = f"over {MAX_LIVE_LOADERS} live DataLoaders: newer ones are not measured"
            raise _TooManyLoaders(MAX_LIVE_LOADERS)
    with R.lock:
        serial = R.next_serial
        R.next_serial += 1
        ls = _LoaderState(serial)
        R.loaders[serial] = ls
    R.degraded.pop("loaders", None)
    prune_loaders()
    return ls


def _loader_died(serial: int, key: int) -> Callable[[Any], None]:
    def cb(_ref: Any) -> None:
        try:
            ls = R.loaders.get(serial)
            if R.by_loader_id.get(key) is ls:
                R.by_loader_id.pop(key, None)
            R.loader_refs.pop(key, None)
            # a loader that goes on in this row (_continue_dead_twin) keeps it alive
            if ls is not None and not any(v is ls for v in list(R.by_loader_id.values())):
                ls.alive = False
                ls.dead_ns = time.monotonic_ns()
        except Exception:
            pass

    return cb


def _loader_constructed(loader: Any) -> _LoaderState:
    key = id(loader)
    ls = R.by_loader_id.get(key)
    ref = R.loader_refs.get(key)
    if ls is None or ref is None or ref() is not loader:
        ls = _new_loader_state()
        try:
            R.loader_refs[key] = weakref.ref(loader, _loader_died(ls.serial, key))
            R.by_loader_id[key] = ls
            ls.tracked = True
        except TypeError:  # not weak-referenceable: it is not tracked across iterators
            pass
        _set_site(ls, _user_site(loader), "constructed")
        with contextlib.suppress(Exception):
            _note_context(ls, *_framework_context())
            _note_context(ls, _loader_class_framework(loader), None)
            if _built_by_library(loader):  # two loaders the user wrote over one dataset stay two
                _inherit_from_wrapped(ls, loader)
    _read_loader_settings(ls, loader)
    return ls


def _inherit_from_wrapped(ls: _LoaderState, loader: Any) -> None:
    """A loader a framework builds again from the user's (accelerate's DataLoaderShard and
    DataLoaderDispatcher, Lightning's re-instantiation for a DistributedSampler): the same
    dataset object as a loader built before and never iterated. It takes that loader's name,
    site and role, and the older one is marked replaced (never listed: it is never iterated)."""
    ds = getattr(loader, "dataset", None)
    if ds is None:
        return
    with contextlib.suppress(TypeError):
        ls.dataset_ref = weakref.ref(ds)
    for old in reversed(list(R.loaders.values())):
        if old is ls or old.iterated or not old.alive or old.replaced_by is not None:
            continue
        ref = old.dataset_ref
        if ref is None or ref() is not ds:
            continue
        old.replaced_by = ls.serial
        if old.file is not None:
            ls.file, ls.line, ls.function, ls.name = old.file, old.line, old.function, old.name
            ls.site_kind = old.site_kind
        if old.role_source == "framework" and ls.role_source != "framework":
            ls.role, ls.role_source = old.role, old.role_source
        _note_context(ls, old.framework, None)
        return


def _loader_state_for(loader: Any) -> _LoaderState:
    key = id(loader)
    ls = R.by_loader_id.get(key)
    ref = R.loader_refs.get(key)
    if ls is not None and ref is not None and ref() is loader:
        return ls
    ls = _loader_constructed(loader)  # built before the hooks: name it where it is first iterated
    if ls.site_kind == "constructed":
        ls.site_kind = "first_iterated"
    return ls


def _mp_context_name(ctx: Any) -> str | None:
    try:
        if ctx is not None:
            name = ctx.get_start_method() if hasattr(ctx, "get_start_method") else None
            return str(name) if name is not None else None
        mp = sys.modules.get("multiprocessing")
        if mp is None:
            return None
        name = mp.get_start_method(allow_none=True)  # never fixes the start method as a side effect
        if name is None:
            default = getattr(getattr(mp, "context", None), "_default_context", None)
            name = getattr(getattr(default, "_default_context", None), "_name", None)
        return str(name) if name is not None else None
    except Exception:
        return None


def _read_loader_settings(ls: _LoaderState, loader: Any) -> None:
    s: dict[str, Any] = {}

    def get(attr: str) -> Any:
        try:
            return getattr(loader, attr)
        except Exception:
            return None

    nw = get("num_workers")
    s["num_workers"] = nw if isinstance(nw, int) else None
    bs = get("batch_size")
    if bs is None:  # a batch_sampler was given (accelerate's shards, HF's samplers): its batch size
        bs = getattr(get("batch_sampler"), "batch_size", None)
    s["batch_size"] = bs if isinstance(bs, int) and not isinstance(bs, bool) else None
    pf = get("prefetch_factor")
    s["prefetch_factor"] = pf if isinstance(pf, int) else None
    for attr in ("pin_memory", "persistent_workers", "drop_last"):
        v = get(attr)
        s[attr] = bool(v) if v is not None else None
    to = get("timeout")
    s["timeout"] = float(to) if isinstance(to, (int, float)) else None
    s["multiprocessing_context"] = _mp_context_name(get("multiprocessing_context")) if nw else None
    bsamp = get("batch_sampler")
    s["collated"] = bsamp is not None
    kind = get("_dataset_kind")
    s["dataset_kind"] = {0: "map", 1: "iterable"}.get(kind) if isinstance(kind, int) else None
    ds = get("dataset")
    s["dataset"] = type(ds).__name__ if ds is not None else None
    ls.settings = s
    if isinstance(nw, int) and nw > len(ls.per_worker):
        ls.per_worker.extend([0] * (nw - len(ls.per_worker)))


def _attach(it: Any, loader: Any) -> _IterState | None:
    """Create the iterator's preallocated state (loader None: the iterator predates the hooks).

    None, and never again for this iterator, when it cannot carry the state (``_dlmon_st``
    refused) or when there are too many live loaders already.
    """
    new_ls: _LoaderState | None = None
    try:
        if loader is not None:
            ls = _loader_state_for(loader)
            _read_loader_settings(ls, loader)  # num_workers etc. may have been changed since
            _iter_built(ls, loader)
            ls = _continue_dead_twin(ls, loader)
        else:
            ls = new_ls = _new_loader_state()
            _set_site(ls, _user_site(), "first_iterated")
            _read_iter_settings(ls, it)
            ls.iterated = True
        with R.lock:
            serial = R.next_iter_serial
            R.next_iter_serial += 1
        st = _IterState(ls, serial, id(it), ls.settings.get("batch_size"))
        if not ls.settings.get("collated", True):
            st.mode = M_CONST
            st.bs = 1
        it._dlmon_st = st  # first: nothing is registered for an iterator that refuses it
    except Exception:
        if new_ls is not None:
            R.loaders.pop(new_ls.serial, None)
        _remember_attach_failure(it)
        return None
    with contextlib.suppress(TypeError):
        st.wref = weakref.ref(it, _iter_died(ls.serial, serial, id(it)))
    ls.iters[serial] = st
    if ls.settings.get("num_workers"):
        R.by_key[id(it)] = st  # so _set_worker_pids(id(it), ...) finds it
    if loader is None:
        _iter_constructed(it, st)
    return st


def _continue_dead_twin(ls: _LoaderState, loader: Any) -> _LoaderState:
    """A loader first iterated that was built at the same place, for the same role, as one that
    died (a DataLoader built anew every epoch) or, with the role from the framework, one whose
    iterators are all gone (HF Trainer's eval loader at each evaluation, which accelerate keeps
    alive): it goes on in that one's row, its counters continuing, instead of a new row each time."""
    try:
        if ls.iters or ls.file is None or not ls.tracked:
            return ls
        key = id(loader)
        if R.by_loader_id.get(key) is not ls:
            return ls
        for old in list(R.loaders.values()):
            if old is ls or old.iters or not old.iterated or old.replaced_by is not None:
                continue
            if old.alive and ls.role_source != "framework":
                continue  # two live loaders from one helper function stay two rows
            if (old.file, old.line, old.role, old.framework) != (ls.file, ls.line, ls.role, ls.framework):
                continue
            R.loader_refs[key] = weakref.ref(loader, _loader_died(old.serial, key))
            R.by_loader_id[key] = old
            old.settings = ls.settings
            if len(ls.per_worker) > len(old.per_worker):
                old.per_worker.extend([0] * (len(ls.per_worker) - len(old.per_worker)))
            old.alive = True
            old.dead_ns = None
            old.tracked = True
            R.loaders.pop(ls.serial, None)
            return old
    except Exception:
        pass
    return ls


def _iter_built(ls: _LoaderState, loader: Any) -> None:
    """A new iterator of ``ls``: an epoch of an older one still running was stopped by length;
    the framework's state tells the loader's role (Lightning's stage)."""
    with contextlib.suppress(Exception):
        ls.iterated = True
        for older in list(ls.iters.values()):
            if older.in_epoch:
                _epoch_stopped_by_length(older)
        _note_context(ls, *_framework_context())
        if ls.framework is None:
            _note_context(ls, _loader_class_framework(loader), None)


def _read_iter_settings(ls: _LoaderState, it: Any) -> None:
    s: dict[str, Any] = {}
    nw = getattr(it, "_num_workers", None)
    s["num_workers"] = nw if isinstance(nw, int) else None
    bs = getattr(getattr(it, "_index_sampler", None), "batch_size", None)
    s["batch_size"] = bs if isinstance(bs, int) else None
    pf = getattr(it, "_prefetch_factor", None)
    s["prefetch_factor"] = pf if isinstance(pf, int) else None
    s["pin_memory"] = bool(getattr(it, "_pin_memory", False))
    s["persistent_workers"] = bool(getattr(it, "_persistent_workers", False))
    s["drop_last"] = getattr(it, "_drop_last", None)
    s["timeout"] = getattr(it, "_timeout", None)
    s["multiprocessing_context"] = None
    s["collated"] = bool(getattr(it, "_auto_collation", True))
    s["dataset_kind"] = None
    ds = getattr(it, "_dataset", None)
    s["dataset"] = type(ds).__name__ if ds is not None else None
    ls.settings = s
    if isinstance(nw, int) and nw > len(ls.per_worker):
        ls.per_worker.extend([0] * (nw - len(ls.per_worker)))


def _iter_constructed(it: Any, st: _IterState) -> None:
    """After the iterator's __init__: fall back to _workers for pids; drop the pid-table entry if none.

    The fallback also serves iterators built before the hooks (their pids were set before the
    worker-pid hook existed), whatever the state of that hook.
    """
    if not st.pids and not getattr(it, "_shutdown", False):
        workers = getattr(it, "_workers", None)
        if workers:
            pids = tuple(int(w.pid) for w in workers if getattr(w, "pid", None))
            st.pids = pids
            if pids:
                R.by_key[st.key] = st
    if not st.pids and R.by_key.get(st.key) is st:
        R.by_key.pop(st.key, None)
    eff = getattr(it, "_pin_memory", None)
    if eff is not None:
        st.loader.settings["pin_memory_effective"] = bool(eff)
    sample_num_threads()


def _iter_died(loader_serial: int, serial: int, key: int) -> Callable[[Any], None]:
    def cb(_ref: Any) -> None:
        try:
            ls = R.loaders.get(loader_serial)
            st = ls.iters.pop(serial, None) if ls is not None else None
            if st is not None and st.in_epoch:  # abandoned mid-epoch: the loop stopped by length
                _epoch_stopped_by_length(st)
            if st is not None and R.by_key.get(key) is st:
                R.by_key.pop(key, None)
            if ls is not None and not ls.tracked and not ls.iters:
                ls.alive = False  # known only through its iterators, and the last one is gone
                ls.dead_ns = time.monotonic_ns()
        except Exception:
            pass

    return cb


def prune_loaders() -> None:
    """Forget loaders that died long ago (or too many dead ones); live ones are always kept."""
    try:
        loaders = list(R.loaders.values())
        if len(loaders) <= MAX_DEAD_LOADERS:
            return
        now = time.monotonic_ns()
        dead = [ls for ls in loaders if not ls.alive and not ls.iters]
        excess = max(0, len(dead) - MAX_DEAD_LOADERS, len(loaders) - MAX_LOADERS)
        for i, ls in enumerate(dead):
            if i < excess or (ls.dead_ns is not None and now - ls.dead_ns > DEAD_LOADER_KEEP_NS):
                R.loaders.pop(ls.serial, None)
    except Exception:
        pass
