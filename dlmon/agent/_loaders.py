"""Construction: loader and iterator states, the hooks on their classes' ``__init__`` and
``_reset``, a loader's settings, and forgetting loaders that died long ago.

Standard library only, and never on the per-batch path (``_late_attach`` runs once, for an
iterator built before the hooks). The limits are read here, as module globals: a test that
lowers ``MAX_LIVE_LOADERS`` sets it on this module.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import FunctionType
from typing import Any

from dlmon.agent import _tune
from dlmon.agent._epochs import _epoch_stopped_by_length, _probe_samples
from dlmon.agent._registry import (
    B_STARTUP,
    M_CONST,
    R,
    _is_ours,
    _IterState,
    _LoaderState,
    _mark,
    _pc,
    sample_num_threads,
)
from dlmon.agent._sites import (
    _built_by_library,
    _framework_context,
    _loader_class_framework,
    _note_context,
    _set_site,
    _tune_site,
    _user_site,
)
from dlmon.agent._workers import install_deferred_sigchld_observer

MAX_LOADERS = 256  # live + retained dead loaders in the report
MAX_LIVE_LOADERS = 256  # beyond this many live loaders, new ones are not measured (degraded)
MAX_DEAD_LOADERS = 32
DEAD_LOADER_KEEP_NS = 300 * 1_000_000_000


class _TooManyLoaders(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# iterators that refuse the state, and those built before the hooks


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


def _late_attach(it: Any, data: Any, t0: int, t1: int, first: bool) -> None:
    """An iterator built before the hooks were installed: attach state now and count this batch."""
    try:
        if _attach_refused(it):
            return
        with _ADOPT_LOCK:  # not while the load thread adopts it (once per iterator: off the batch path)
            st = _adopted(it) or _attach(it, None)
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
    if R.sigchld_deferred:
        install_deferred_sigchld_observer()


# iterators adopted in the middle of a call at the load, until their next batch (id -> state)
_ADOPTED: dict[int, _IterState] = {}
# held by the load thread's adoption of an iterator and by the training thread's _late_attach of
# one: a batch that ended inside the adoption attached a second state (a ghost loader) otherwise
_ADOPT_LOCK = threading.Lock()


def adopt_calls_in_progress() -> int:
    """Loaded into a running job: iterators whose ``__next__`` is running in some thread now (a
    trainer waiting for a worker that hung before the load) are attached at once, their call timed
    from the load (its true start is unknown, so the wait is a lower bound). Without this such a
    loader stays unknown for as long as the hang lasts. The number adopted; never raises."""
    base = getattr(sys.modules.get("torch.utils.data.dataloader"), "_BaseDataLoaderIter", None)
    if not isinstance(base, type):
        return 0
    adopted = 0
    now = _pc()
    try:
        frames = list(sys._current_frames().values())
    except Exception:
        return 0
    for top in frames:
        f: Any = top
        depth = 0
        while f is not None and depth < 64:
            depth += 1
            if f.f_code.co_name == "__next__":  # another iterator's (a generator's) is walked past
                try:
                    it = f.f_locals.get("self")
                    if isinstance(it, base):
                        if _adopt(it, f.f_back, now):
                            adopted += 1
                        break
                except Exception:
                    break
            f = f.f_back
    return adopted


def _adopt(it: Any, caller: Any, now: int) -> bool:
    with _ADOPT_LOCK:
        prev = _ADOPTED.get(id(it))
        if prev is not None and prev.wref is not None and prev.wref() is it:
            return False  # found in two threads' frames
        if getattr(it, "_dlmon_st", None) is not None or _attach_refused(it):
            return False  # attached by its own batch since the frames were read
        return _adopt_locked(it, caller, now)


def _adopt_locked(it: Any, caller: Any, now: int) -> bool:
    st = _attach(it, None)
    if st is None:
        return False
    if caller is not None:  # the line iterating it, not the load thread's
        code = caller.f_code
        _set_site(st.loader, (code.co_filename, caller.f_lineno, code.co_name), "first_iterated")
    st.in_epoch = True
    st.t_in = now
    # served from now on, but its next batch must still pass through _late_attach: the main
    # thread installs the deferred SIGCHLD observer there (the load thread cannot)
    _ADOPTED[id(it)] = st
    with contextlib.suppress(AttributeError):
        del it._dlmon_st
    return True


def _adopted(it: Any) -> _IterState | None:
    st = _ADOPTED.pop(id(it), None)
    if st is None or st.wref is None or st.wref() is not it:
        return None
    setattr(it, "_dlmon_st", st)  # noqa: B010 (mypy narrowed it through the identity check)
    st.t_in = 0
    return st


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
                if ls.iters:
                    # `for batch in DataLoader(...)`: the loader object is gone at once, its
                    # iterator goes on; the row lives until the last iterator dies
                    ls.tracked = False
                else:
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
    # the loader is out of reach: its workers' Process class says how they were started (a
    # context's ForkProcess...), or the plain Process class the default start method
    workers = getattr(it, "_workers", None) or ()
    method = getattr(type(workers[0]), "_start_method", None) if workers else None
    s["multiprocessing_context"] = (
        method if isinstance(method, str) else _mp_context_name(None) if workers else None
    )
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
