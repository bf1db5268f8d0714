"""Epochs and batches off the fast path of ``__next__``: epoch ends and starts, the roles that
show in their pattern (a validation burst in a pause of the training loader), and how the
samples of a batch are counted.

Standard library only. ``_hooks._make_next`` calls these at most once an epoch, on the way out
of a call that raised, or while it has not decided how to count a batch's samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dlmon.agent._registry import (
    B_BATCHES,
    B_EPOCHS,
    B_EPOCHS_STARTED,
    M_CONST,
    M_MAP,
    M_SEQ,
    M_SHAPE,
    R,
    _IterState,
    _LoaderState,
    _pc,
    sample_num_threads,
)


def _call_ended(st: Any) -> None:
    try:  # noqa: SIM105
        st.t_in = 0
    except Exception:
        pass


def _on_stop(st: _IterState, t0: int, first: bool) -> None:
    try:
        t1 = _pc()
        st.t_in = 0
        c = st.c
        if st.in_epoch or first:
            c[5] += t1 - t0  # B_END
            lr = st.last_ret
            if lr:
                c[3] += t0 - lr  # the step on the last batch is compute too
            c[6] += 1  # B_EPOCHS
            if first and not st.in_epoch:
                c[7] += 1  # an empty epoch started and ended here
            _epoch_ended(st)
        st.in_epoch = False
        st.last_ret = 0
    except Exception:
        pass


def _epoch_stopped_by_length(st: _IterState) -> None:
    """The iterator's epoch is over without a StopIteration from it: the loop stopped by length
    (Lightning's CombinedLoader raises StopIteration itself, ``limit_*_batches``, ``break``), and
    now the iterator starts again (``_reset`` of persistent workers, or its first batch again)
    or another iterator of the same loader is built. Counted as an ended epoch."""
    try:
        if not st.in_epoch:
            return
        st.in_epoch = False
        st.last_ret = 0
        st.c[B_EPOCHS] += 1
        _epoch_ended(st)
    except Exception:
        pass


def _epoch_started(st: _IterState) -> None:
    """First batch of an epoch returned (once an epoch, off the per-batch path)."""
    sample_num_threads()
    try:
        ls = st.loader
        if ls.role_source != "framework":
            _confirm_pattern_role(ls)
            st.others_at_start = tuple(
                (other, other.c[B_BATCHES])
                for other in list(R.loaders.values())
                if other is not ls and other.alive and other.c[B_EPOCHS_STARTED] > 0
            )
    except Exception:
        pass


# The loaders each loader's last epoch ran "between the batches of", and their batch counts then:
# candidates, one confirmed at its next epoch start when that loader has moved on since.
_pattern_candidates: dict[int, tuple[tuple[_LoaderState, int], ...]] = {}


def _epoch_ended(st: _IterState) -> None:
    """An epoch of ``st`` ended: did it run in a pause of a bigger loader (a validation burst)?

    The other loader made no batch during this epoch and has made more batches than this one in
    all: a candidate, confirmed when the other loader has made batches again by this loader's
    next epoch start (so a second training phase after the first is not taken for validation).
    """
    try:
        others = st.others_at_start
        st.others_at_start = ()
        ls = st.loader
        if ls.role_source == "framework":
            return
        mine = ls.c[B_BATCHES]
        paused = tuple((o, b) for o, b in others if o.c[B_BATCHES] == b and b > mine)
        if paused:
            _pattern_candidates[ls.serial] = paused
        else:
            _pattern_candidates.pop(ls.serial, None)
    except Exception:
        pass


def _confirm_pattern_role(ls: _LoaderState) -> None:
    for other, batches in _pattern_candidates.pop(ls.serial, ()):
        if other.c[B_BATCHES] > batches and other.c[B_BATCHES] > ls.c[B_BATCHES]:
            ls.role = "validation"
            ls.role_source = "pattern"
            if other.role is None:
                other.role = "train"
                other.role_source = "pattern"
            return


def _probe_samples(st: _IterState, data: Any) -> int:
    """Decide how to count the samples of a batch (once per iterator, again if the shape changes)."""
    try:
        if st.mode == M_CONST and st.bs >= 1:
            return st.bs
        if not st.loader.settings.get("collated", True):
            st.mode = M_CONST
            st.bs = 1
            return 1
        n = _first_dim(data)
        if n is not None:
            st.mode = M_SHAPE
            return n
        if type(data) in (tuple, list) and data:
            n = _first_dim(data[0])
            if n is not None:
                st.mode = M_SEQ
                return n
        if isinstance(data, Mapping) and data:
            n = _first_dim(next(iter(data.values())))
            if n is not None:
                st.mode = M_MAP
                return n
        st.mode = M_CONST
        return st.bs
    except Exception:
        st.mode = M_CONST
        return st.bs


def _first_dim(x: Any) -> int | None:
    shape = getattr(x, "shape", None)
    if shape is None:
        return None
    try:
        if len(shape) < 1:
            return None
        n = shape[0]
    except Exception:
        return None
    return n if isinstance(n, int) and n >= 0 else None
