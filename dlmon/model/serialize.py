"""Snapshot <-> plain JSON-ready dicts. JSON only: no pickle in any format dlmon writes."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, TypeVar, cast

from dlmon.model.snapshot import SCHEMA_VERSION, Snapshot

T = TypeVar("T")


class SnapshotFormatError(ValueError):
    """A record that is not a snapshot this version of dlmon can read."""


def to_dict(obj: Any) -> Any:
    """A dataclass tree as dicts, lists and scalars, with the dataclasses' field names."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(item) for item in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


def snapshot_to_dict(snapshot: Snapshot) -> dict[str, Any]:
    data: dict[str, Any] = {"type": "snapshot"}
    data.update(to_dict(snapshot))
    return data


def snapshot_from_dict(data: Mapping[str, Any]) -> Snapshot:
    """Rebuild a Snapshot; unknown keys are ignored, missing optional keys take defaults."""
    schema = data.get("schema")
    if not isinstance(schema, int) or schema > SCHEMA_VERSION:
        raise SnapshotFormatError(f"unsupported snapshot schema {schema!r}")
    try:
        return _build(Snapshot, data)
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise SnapshotFormatError(f"malformed snapshot: {exc}") from exc


@cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type[T], data: Mapping[str, Any]) -> T:
    return cast(T, _builder(cast(Any, cls))(data))


# Converters are compiled once per type (a closure per dataclass field, union, tuple...): walking
# the type hints for every value cost ~1 ms per snapshot line, ten times its json.loads.
Converter = Callable[[Any], Any]


def _plain(hint: Any) -> type | None:
    """int, float, str or bool when ``hint`` is one of them (or it | None): values of exactly that class
    (a finite float) pass as they are, without a call."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = inner[0] if len(inner) == 1 else None
    return hint if hint in (int, float, str, bool) else None


@cache
def _builder(cls: Any) -> Converter:
    hints = _hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        nullable = hint is Any or _allows_none(hint)
        fields.append((f.name, _converter(hint), nullable, _bounds(f.name), _plain(hint)))
    name = cls.__name__

    def build(data: Any) -> Any:
        if data.__class__ is not dict and not isinstance(data, Mapping):
            raise TypeError(f"{name} must be an object, not {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        for key, conv, nullable, bound, plain in fields:
            if key not in data:
                continue
            raw: Any = data[key]
            try:
                if raw is None:
                    if not nullable:
                        raise TypeError("null where a value is required")
                    kwargs[key] = None
                    continue
                if raw.__class__ is plain and (plain is not float or math.isfinite(cast(float, raw))):
                    value: Any = raw
                    if bound is not None and plain in (int, float) and not bound[0] <= value <= bound[1]:
                        _check_range(value, bound)
                else:
                    value = conv(raw)
                    if bound is not None:
                        _check_range(value, bound)
                kwargs[key] = value
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{key}: {exc}") from exc
        return cls(**kwargs)

    return build


@cache
def _converter(hint: Any) -> Converter:
    """``_convert(hint, ·)`` compiled for one hint (same rules, same errors)."""
    core = _core_converter(hint)
    nullable = hint is Any or _allows_none(hint)

    def convert(value: Any) -> Any:
        if value is None:
            if nullable:
                return None
            raise TypeError("null where a value is required")
        return core(value)

    return convert


def _core_converter(hint: Any) -> Converter:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return _converter(inner[0])
        options = [(a, _converter(a)) for a in inner]

        def union(value: Any) -> Any:
            kind = type(value)
            for _, conv in [o for o in options if o[0] is kind] + options:  # 3 stays an int
                try:
                    return conv(value)
                except (TypeError, ValueError):
                    continue
            raise TypeError(f"{_show(value)} fits none of {hint}")

        return union
    if origin is typing.Literal:
        allowed = typing.get_args(hint)

        def literal(value: Any) -> Any:
            if value not in allowed:
                raise ValueError(f"{_show(value)} is not one of {allowed}")
            return value

        return literal
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            item = _converter(args[0])

            def variadic(value: Any) -> Any:
                if not isinstance(value, list):
                    raise TypeError(f"expected a list, got {_show(value)}")
                return tuple([item(v) for v in value])

            return variadic
        items = [_converter(a) for a in args]

        def fixed(value: Any) -> Any:
            if not isinstance(value, list):
                raise TypeError(f"expected a list, got {_show(value)}")
            if len(items) != len(value):
                raise ValueError(f"expected {len(items)} items, got {len(value)}")
            return tuple([c(v) for c, v in zip(items, value, strict=True)])

        return fixed
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        key_hint, value_hint = typing.get_args(hint) or (Any, Any)
        value_conv = _converter(value_hint)

        def mapping(value: Any) -> Any:
            if not isinstance(value, Mapping):
                raise TypeError(f"expected an object, got {_show(value)}")
            return types.MappingProxyType({_map_key(key_hint, k): value_conv(v) for k, v in value.items()})

        return mapping
    if dataclasses.is_dataclass(hint):
        return _builder(cast(Any, hint))
    return _scalar_converter(hint)


def _scalar_converter(hint: Any) -> Converter:
    if hint is Any:
        return lambda value: value
    if hint is int:

        def whole(value: Any) -> Any:
            if value.__class__ is int:
                return value
            return _scalar(int, value)

        return whole
    if hint is float:

        def number(value: Any) -> Any:
            if value.__class__ is float and value - value == 0.0:  # finite (inf - inf and nan are nan)
                return value
            return _scalar(float, value)

        return number
    if hint is str:

        def text(value: Any) -> Any:
            if value.__class__ is str:
                return value
            return _scalar(str, value)

        return text
    return lambda value: _scalar(hint, value)


def _convert(hint: Any, value: Any) -> Any:
    """``value`` as the type ``hint`` says; raises TypeError/ValueError for a value of another type,
    so a line with ``"time": "abc"`` is skipped at the reader instead of crashing the dashboard."""
    return _converter(hint)(value)


# What a field's name says it can hold, checked like its type: a negative byte count, 10^30 bytes,
# a negative worker count or 1e300 samples/s is no measurement, and would be printed as one.
MAX_BYTES = float(1 << 60)  # 1 EiB
MAX_RATE = 1e12  # per second (bytes/s have MAX_BYTES)
MAX_COUNT = float(1 << 53)
MAX_SECONDS = 1e9  # ~32 years
_COUNT_NAMES = frozenset(
    {
        "batch_size", "epochs", "epochs_started", "prefetch_factor", "pss_missing", "oom_kill_count",
        "queue_depth", "num_fds", "num_threads", "num_workers", "fd_limit", "job_segments",
        "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches", "processes_in_rotation",
        "processes_without_held_fds", "rotation_ticks", "target_cores", "analysis_errors",
    }
)  # fmt: skip
# Shares of one whole (GPM's SMs busy, warps resident): never above 100.
_SHARE_PERCENT_NAMES = frozenset({"sm_active_percent", "sm_occupancy_percent"})


@cache
def _bounds(name: str) -> tuple[float, float] | None:
    """(least, most) a field of this name may hold; None: no rule (exit codes, signals, ids...)."""
    if name.endswith("_bytes_per_s") or name.endswith("_bytes") or name == "bytes":
        return 0.0, MAX_BYTES
    if name.endswith("_per_s"):
        return 0.0, MAX_RATE
    if name.endswith("_fraction"):
        return 0.0, 1.0
    if name in _SHARE_PERCENT_NAMES:
        return 0.0, 100.0
    if name.endswith("_percent"):
        return 0.0, 1e6  # a process on many cores passes 100
    if name.endswith("_w"):
        return 0.0, 1e6  # watts
    if name.endswith("_total") and not name.endswith("_s_total"):
        return 0.0, MAX_COUNT
    if name.endswith("_s") or name.endswith("_s_total") or name.endswith("_ms"):
        return 0.0, MAX_SECONDS * (1000 if name.endswith("_ms") else 1)
    if name in _COUNT_NAMES:
        return 0.0, MAX_COUNT
    return None


def _check_range(value: Any, bound: tuple[float, float]) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if not bound[0] <= value <= bound[1]:
        raise ValueError(f"{value!r} is out of range ({bound[0]:g} to {bound[1]:g})")


def _allows_none(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _map_key(hint: Any, key: str) -> Any:
    """JSON object keys are strings; an int-keyed mapping (per pid) gets its ints back."""
    if hint is int:
        try:
            return int(key)
        except ValueError as exc:
            raise ValueError(f"key {key[:40]!r} is not a whole number") from exc
    return key


def _scalar(hint: Any, value: Any) -> Any:
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected true/false, got {_show(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected a whole number, got {_show(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"expected a number, got {_show(value)}")
        try:  # a JSON integer of 400 digits is valid JSON but no float: OverflowError
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ValueError(f"expected a finite number, got {_show(value)}")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {_show(value)}")
        return value
    if isinstance(hint, type) and not isinstance(value, hint):
        raise TypeError(f"expected {hint.__name__}, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}"
