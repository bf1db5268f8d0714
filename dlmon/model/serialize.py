"""Snapshot <-> plain JSON-ready dicts. JSON only: no pickle in any format dlmon writes."""

from __future__ import annotations

import dataclasses
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
            kwargs[f.name] = _convert(hints[f.name], data[f.name])
    return cls(**kwargs)


def _convert(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(inner[0], value) if len(inner) == 1 else value
    if origin is tuple:
        (item_hint, _ellipsis) = typing.get_args(hint)
        return tuple(_convert(item_hint, v) for v in value)
    if origin is not None and issubclass(origin, Mapping):
        return types.MappingProxyType(dict(value))
    if dataclasses.is_dataclass(hint):
        return _build(hint, value)  # type: ignore[arg-type]
    if hint is float and isinstance(value, int):
        return float(value)
    return value
