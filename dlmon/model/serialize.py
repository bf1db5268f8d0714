"""Snapshot <-> plain JSON-ready dicts. JSON only: no pickle in any format dlmon writes."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
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
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls.__name__} must be an object, not {type(data).__name__}")
    hints = _hints(cast(Any, cls))
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in data:
            try:
                value = _convert(hints[f.name], data[f.name])
                bound = _bounds(f.name)
                if bound is not None and value is not None:
                    _check_range(value, bound)
                kwargs[f.name] = value
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{f.name}: {exc}") from exc
    return cls(**kwargs)


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


@cache
def _bounds(name: str) -> tuple[float, float] | None:
    """(least, most) a field of this name may hold; None: no rule (exit codes, signals, ids...)."""
    if name.endswith("_bytes_per_s") or name.endswith("_bytes") or name == "bytes":
        return 0.0, MAX_BYTES
    if name.endswith("_per_s"):
        return 0.0, MAX_RATE
    if name.endswith("_fraction"):
        return 0.0, 1.0
    if name.endswith("_percent"):
        return 0.0, 1e6  # a process on many cores passes 100
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


def _convert(hint: Any, value: Any) -> Any:
    """``value`` as the type ``hint`` says; raises TypeError/ValueError for a value of another type,
    so a line with ``"time": "abc"`` is skipped at the reader instead of crashing the dashboard."""
    if value is None:
        if hint is Any or _allows_none(hint):
            return None
        raise TypeError("null where a value is required")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return _convert(inner[0], value)
        exact = [a for a in inner if a is type(value)]  # 3 stays an int in float | int | str
        for option in exact + inner:  # else the first member the value fits
            try:
                return _convert(option, value)
            except (TypeError, ValueError):
                continue
        raise TypeError(f"{_show(value)} fits none of {hint}")
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise ValueError(f"{_show(value)} is not one of {typing.get_args(hint)}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise TypeError(f"expected a list, got {_show(value)}")
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v) for v in value)
        if len(args) != len(value):
            raise ValueError(f"expected {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v) for a, v in zip(args, value, strict=True))
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        if not isinstance(value, Mapping):
            raise TypeError(f"expected an object, got {_show(value)}")
        key_hint, value_hint = typing.get_args(hint) or (Any, Any)
        return types.MappingProxyType(
            {_map_key(key_hint, k): _convert(value_hint, v) for k, v in value.items()}
        )
    if dataclasses.is_dataclass(hint):
        return _build(hint, value)  # type: ignore[arg-type]
    return _scalar(hint, value)


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
