"""What the DataLoader hooks record, and the bookkeeping every hook module shares.

Standard library only. ``R`` is the one registry: written by the hooks in the training's threads,
read by the serving thread (``_server``) without locking (see ``_hooks`` for why that is safe).
The counter slots (``B_*``) index each loader's cumulative counters, ``c``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from dlmon.agent import wire

_pc = time.perf_counter_ns

# Counter slots in _LoaderState.c (cumulative, monotonic):
B_BATCHES = 0  # batches returned by __next__ (every batch, the first of an epoch included)
B_SAMPLES = 1  # samples in them
B_WAIT = 2  # ns spent inside __next__ for steady-state batches (not the first of an epoch)
B_COMPUTE = 3  # ns between a __next__ return and the next __next__ call, within an epoch
B_STARTUP = 4  # ns inside the first __next__ of an epoch and building the iterator (worker start-up)
B_END = 5  # ns spent inside the __next__ call that raised StopIteration
B_EPOCHS = 6  # epochs ended (StopIteration seen)
B_EPOCHS_STARTED = 7  # epochs started (first batch of an epoch returned, or an empty epoch ended)
N_COUNTERS = 8

# How the sample count of a batch is found (_IterState.mode).
M_PROBE = 0  # not decided yet: look at the next batch
M_SHAPE = 1  # batch.shape[0]
M_SEQ = 2  # batch[0].shape[0]  (tuple/list of tensors)
M_MAP = 3  # first value's .shape[0]  (dict of tensors)
M_CONST = 4  # a constant: batch_size when collated, 1 when not


class _LoaderState:
    """One DataLoader object (or, for an iterator created before the hooks, that iterator)."""

    __slots__ = (
        "alive",
        "c",
        "created_ns",
        "dataset_ref",
        "dead_ns",
        "file",
        "framework",
        "function",
        "iterated",
        "iters",
        "line",
        "name",
        "per_worker",
        "replaced_by",
        "role",
        "role_source",
        "serial",
        "settings",
        "site_kind",
        "tracked",
    )

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self.name = f"loader-{serial}"
        self.file: str | None = None
        self.line: int | None = None
        self.function: str | None = None
        self.site_kind = "unknown"  # "constructed" | "first_iterated" | "unknown"
        self.settings: dict[str, Any] = {}
        self.c: list[int] = [0] * N_COUNTERS
        self.per_worker: list[int] = []
        self.iters: dict[int, _IterState] = {}
        self.alive = True
        self.tracked = False  # a weak reference to the DataLoader tells when it dies
        self.dead_ns: int | None = None
        self.created_ns = time.monotonic_ns()
        # what the user is told about it (computed at construction and iterator creation, never
        # on the hot path): "train" | "validation" | "test" | "other" | None, and from where
        self.role: str | None = None
        self.role_source: str | None = None  # "framework" | "pattern"
        self.framework: str | None = None  # "Lightning" | "HF Trainer" | "accelerate" | "torchdata"
        self.iterated = False  # an iterator was ever built (a loader never iterated is not listed)
        self.replaced_by: int | None = None  # the serial of the loader a framework re-created it as
        self.dataset_ref: weakref.ref[Any] | None = None


class _IterState:
    """Per-iterator state, preallocated when the iterator is built; the hot path only adds."""

    __slots__ = (
        "__weakref__",
        "bs",
        "c",
        "in_epoch",
        "key",
        "last_ret",
        "loader",
        "mode",
        "others_at_start",
        "per_worker",
        "pids",
        "serial",
        "t_in",
        "wref",
    )

    def __init__(self, loader: _LoaderState, serial: int, key: int, batch_size: int | None) -> None:
        self.loader = loader
        self.c = loader.c
        self.per_worker = loader.per_worker
        self.serial = serial
        self.key = key  # id(iterator), the key torch uses for its worker-pid table
        self.last_ret = 0
        self.in_epoch = False
        self.mode = M_PROBE
        self.bs = batch_size if batch_size is not None else 1
        self.pids: tuple[int, ...] = ()
        self.wref: weakref.ref[Any] | None = None
        self.t_in = 0  # perf_counter_ns at the entry of a call in progress (or of __init__); 0: none
        # at this iterator's epoch start: (loader, its batches) of the other loaders then mid-epoch
        self.others_at_start: tuple[tuple[_LoaderState, int], ...] = ()


class _Registry:
    """Everything the hooks record; read by the serving thread."""

    def __init__(self) -> None:
        self.loaders: dict[int, _LoaderState] = {}  # serial -> state, in creation order
        self.by_loader_id: dict[int, _LoaderState] = {}  # id(DataLoader) -> state, while it lives
        self.loader_refs: dict[int, weakref.ref[Any]] = {}
        self.by_key: dict[int, _IterState] = {}  # id(iterator) -> state, while it has worker pids
        self.deaths: list[wire.WorkerDeathWire] = []
        self.dead_pids: dict[int, wire.WorkerDeathWire] = {}
        self.next_serial = 1
        self.next_iter_serial = 1
        self.hooks: dict[str, bool] = {}
        self.degraded: dict[str, str] = {}
        self.num_threads: int | None = None
        self.num_threads_ns: int | None = None
        self.patched = False
        self.torch_dir: str | None = None
        self.lock = threading.Lock()  # only for creating loaders; never taken on the hot path
        # called once, at the first iterator built in this process (dlmon.agent.arm())
        self.on_first_iter: Callable[[], None] | None = None
        # torch's SIGCHLD handler was there when the hooks were installed off the main thread (the
        # agent loaded into a running job): the observer goes in at the main thread's next batch
        self.sigchld_deferred = False
        self.injected_unix_time: float | None = None  # loaded into the running process then


R = _Registry()


def _fail(hook: str, exc: BaseException | str) -> None:
    reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    R.hooks[hook] = False
    R.degraded[hook] = reason[:300]


def _ok(hook: str) -> None:
    R.hooks[hook] = True
    R.degraded.pop(hook, None)


# ---------------------------------------------------------------------------------------------
# marking hooks: what dlmon installed, and what it wraps


def _mark(fn: Any, orig: Any, kind: str = "") -> Any:
    fn.__dlmon_orig__ = orig
    fn.__dlmon_kind__ = kind
    fn.__wrapped__ = orig
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        with contextlib.suppress(Exception):
            setattr(fn, attr, getattr(orig, attr))
    return fn


def _is_ours(fn: Any) -> bool:
    return getattr(fn, "__dlmon_orig__", None) is not None


def _has_hook(fn: Any, kind: str) -> bool:
    """True if ``fn`` or one of the functions it wraps is dlmon's hook of this kind."""
    for _ in range(16):
        if fn is None:
            return False
        if getattr(fn, "__dlmon_kind__", None) == kind:
            return True
        fn = getattr(fn, "__dlmon_orig__", None)
    return False


# ---------------------------------------------------------------------------------------------
# torch intra-op threads


def sample_num_threads() -> None:
    """torch.get_num_threads() read in the calling thread (OpenMP's value is per thread).

    Called from the training thread at iterator creation and at each epoch start, never from the
    serving thread, whose own OpenMP setting would be the wrong one.
    """
    try:
        torch_mod = sys.modules.get("torch")
        get = getattr(torch_mod, "get_num_threads", None)
        if get is None:
            return
        n = get()
        if isinstance(n, int):
            R.num_threads = n
            R.num_threads_ns = time.monotonic_ns()
    except Exception:
        pass
