"""Whether a record line's dict reads as a Snapshot as it is, told without building one.

``dlmon report`` reads every line of a recording, and building the typed Snapshot of a line cost
several times its ``json.loads``. :func:`reads_as_is` answers "would
:func:`~dlmon.model.serialize.snapshot_from_dict` accept this dict, with every value kept exactly
as it is?" by the same rules (each field's type, its range by name, finite floats), compiled once
per dataclass and per combination of value types met, so a line costs a few C-level passes
(``map(type, ...)``, ``min``/``max``/``sum`` of a group) instead of a call per value.

It answers True only for a dict that the full reader accepts and that holds every field of every
dataclass, in field order, with no int standing in for a float (the reader would widen it). It
answers False for everything else, including dicts the full reader accepts (an older recording
missing a field, keys in another order): the caller then takes the full reader, which also words
why a line is skipped. So "skipped line N: ..." reports come from one place only.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from functools import cache
from operator import itemgetter
from typing import Any

from dlmon.model.serialize import _allows_none, _bounds, _hints, _plain
from dlmon.model.snapshot import SCHEMA_VERSION, Snapshot

Check = Callable[[Any], bool]
Plan = Callable[[tuple[Any, ...]], bool]

# Value-type combinations remembered per dataclass: a real recording meets a handful (a field
# null or not); a hostile file cannot grow this without bound.
MAX_PLANS = 256
# Bounds at least this wide (bytes, counts, rates: serialize._bounds) are checked together against
# it first: a value under it is under each of them.
WIDE = 1e12
_NONE = type(None)


def reads_as_is(data: Any) -> bool:
    """True when ``snapshot_from_dict(data)`` (``data`` a record line's top-level object, its
    ``"type"`` first) builds a Snapshot whose values are exactly those of ``data``. False: not
    known, ask the full reader."""
    schema = data.get("schema") if data.__class__ is dict else None
    return schema.__class__ is int and schema <= SCHEMA_VERSION and _top_check(data)


def _getter(positions: list[int]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """A C-level getter that always returns a tuple (itemgetter of one index returns the item)."""
    if len(positions) == 1:
        return itemgetter(slice(positions[0], positions[0] + 1))
    return itemgetter(*positions)


def _items_check(hint: Any) -> Check | None:
    """The check of all the items of a ``tuple[X, ...]`` (a JSON list) or all the values of a
    mapping, given as an iterable; None: a kind of item this module leaves to the full reader."""
    if dataclasses.is_dataclass(hint):
        each = _checker(typing.cast(Any, hint))
        return lambda items: all(map(each, items))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        allowed = frozenset(typing.get_args(hint))
    else:
        allowed = frozenset((hint,))
    if not allowed <= {int, float, str, bool, _NONE}:
        return None
    if float not in allowed:
        return lambda items: set(map(type, items)) <= allowed

    def with_floats(items: Any) -> bool:
        found = [v for v in items if v.__class__ is float]
        total = sum(found)
        return total - total == 0.0 and set(map(type, items)) <= allowed

    return with_floats


DICT, LIST, MAP = 0, 1, 2


def _field_check(hint: Any, value_type: type) -> tuple[int, Check] | bool | None:
    """For a field holding a dict or a list: how to check it (DICT: the dict itself, LIST: its
    items, MAP: its values), True when any value passes, None when the full reader must judge."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not _NONE]
        if len(inner) != 1:
            return None
        hint = inner[0]
    if hint is Any:
        return True
    if dataclasses.is_dataclass(hint):
        return (DICT, _checker(typing.cast(Any, hint))) if value_type is dict else None
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and value_type is list:
        items = _items_check(args[0])
        return None if items is None else (LIST, items)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        if value_type is not dict or not args or args[0] is not str:
            return None
        values = _items_check(args[1])
        return None if values is None else (MAP, values)
    return None


@cache
def _checker(cls: Any, leading: tuple[str, ...] = ()) -> Check:
    """The check of a dict meant for dataclass ``cls``: every field, in order, after ``leading``
    keys the caller judges (a record's ``"type"``)."""
    hints = _hints(cls)
    fields = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
    keys = (*leading, *(name for name, _ in fields))
    skip = len(leading)
    plans: dict[tuple[type, ...], Plan | None] = {}

    def plan_for(kinds: tuple[type, ...]) -> Plan | None:
        groups: dict[tuple[float, float], list[int]] = {}
        floats: list[int] = []
        nested: list[tuple[int, int, Check]] = []
        for i, ((name, hint), kind) in enumerate(zip(fields, kinds[skip:], strict=True), start=skip):
            if kind is _NONE:
                if not (hint is Any or _allows_none(hint)):
                    return None
                continue
            plain = _plain(hint)
            if plain is not None:
                if kind is not plain:
                    return None  # an int for a float, a bool for an int: the full reader decides
                bound = _bounds(name)
                if bound is not None and plain in (int, float):
                    groups.setdefault(bound, []).append(i)
                if plain is float:
                    floats.append(i)
                continue
            check = _field_check(hint, kind)
            if check is None:
                return None
            if check is not True:
                how, inner = typing.cast(tuple[int, Check], check)
                nested.append((i, how, inner))
        # every bound starts at 0 (serialize._bounds): one min over all, then one max per bound
        bounded = _getter(sorted(i for at in groups.values() for i in at)) if groups else None
        lows = {low for low, _ in groups}
        # the wide bounds share one max against WIDE, which real values stay far below; only past
        # it is each one's own bound asked
        wide = sorted(i for (_, high), at in groups.items() if high >= WIDE for i in at)
        wide_get = _getter(wide) if wide else None
        wide_tops = [(high, _getter(at)) for (_, high), at in groups.items() if high >= WIDE]
        tops = [(high, _getter(at)) for (_, high), at in groups.items() if high < WIDE]
        finite = _getter(floats) if floats else None
        if lows - {0.0}:
            return None  # a rule this plan does not know: the full reader judges

        def plan(values: tuple[Any, ...]) -> bool:
            if bounded is not None:
                if min(bounded(values)) < 0:
                    return False
                if wide_get is not None and max(wide_get(values)) > WIDE:
                    for high, get in wide_tops:
                        if max(get(values)) > high:
                            return False
                for high, get in tops:
                    if max(get(values)) > high:
                        return False
            if finite is not None:
                total = sum(finite(values))
                if total - total != 0.0:  # a nan or an infinity among them (or an overflowing sum)
                    return False
            for i, how, inner in nested:
                value = values[i]
                if how == DICT:
                    if not inner(value):
                        return False
                elif value and not inner(value if how == LIST else value.values()):
                    return False
            return True

        return plan

    def check(data: Any) -> bool:
        if data.__class__ is not dict or tuple(data) != keys:
            return False
        values = tuple(data.values())
        kinds = tuple(map(type, values))
        try:
            plan = plans[kinds]
        except KeyError:
            if len(plans) >= MAX_PLANS:
                plans.clear()  # a damaged file's endless combinations: bounded, and today's kept
            plan = plans[kinds] = plan_for(kinds)
        return plan is not None and plan(values)

    return check


_top_check = _checker(Snapshot, ("type",))
