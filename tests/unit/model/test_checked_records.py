"""The record reader's fast path (issue 26): a snapshot line that reads as it stands is vouched
for by a check of its JSON object (dlmon.model.checked), not built into a typed Snapshot.

It must take the same lines as the full reader and skip the same ones with the same words: value by
value over every field of every dataclass at each of its bounds, and by hypothesis.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dlmon.flow.records import CheckedSnapshot, parse_line, parse_line_checked
from dlmon.model.serialize import MAX_BYTES, MAX_COUNT, MAX_RATE, MAX_SECONDS, _hints, snapshot_to_dict
from dlmon.model.snapshot import (
    SCHEMA_VERSION,
    KernelEvent,
    PinnedMemory,
    Pressure,
    ProcessStack,
    Snapshot,
    StackFrame,
    TrainingException,
    WorkerDeath,
)
from support.ui import MAIN_PID, T0, WORKER_PIDS, make_snapshot
from unit.model.test_fuzz import mutated_snapshot_lines


def full_snapshot(t: float = T0) -> Snapshot:
    """make_snapshot with every dataclass of the model in it (deaths, stacks, kernel events, ...)."""
    s = make_snapshot(t, gpus=2)
    return dataclasses.replace(
        s,
        pinned=PinnedMemory(512 << 20, "torch.cuda.host_memory_stats:allocated_bytes.current", 1 << 20),
        pressure=Pressure(1.5, 0.2, 0.0, 0.0, 12.5),
        worker_deaths=(
            WorkerDeath(WORKER_PIDS[1], 1, "loader-1", 9, None, t - 30.0, "SIGKILL", MAIN_PID, "train.py:88"),
        ),
        kernel_events=(
            KernelEvent("oom_kill", WORKER_PIDS[1], "pt_data_worker", t - 31.0, "cgroup", "/job", 10, 20),
        ),
        stacks=(
            ProcessStack(
                MAIN_PID, "main", None, t - 1.0, "MainThread", (StackFrame("train.py", 88, "main"),), "S"
            ),
        ),
        exceptions=(
            TrainingException(MAIN_PID, "next", "RuntimeError", "DataLoader worker killed", t - 29.0, line=3),
        ),
    )


def line_of(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def exact(data: Any) -> str:
    """The JSON text, which tells 1 from 1.0 (== does not)."""
    return json.dumps(data, allow_nan=True)


def assert_agree(raw: bytes) -> bool:
    """The fast and the full reader agree on one line; True when the fast one vouched for it."""
    full, fast = parse_line(7, raw), parse_line_checked(7, raw)
    if isinstance(fast, CheckedSnapshot):
        assert isinstance(full, Snapshot), (raw[:300], full)
        assert fast.snapshot() == full and fast.time == full.time
        assert exact(fast.data) == exact(snapshot_to_dict(full))  # the values the summary reads
        return True
    assert fast == full
    return False


def scalar_paths(data: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(data, dict):
        for key, value in data.items():
            yield from scalar_paths(value, (*path, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from scalar_paths(value, (*path, i))
    else:
        yield path


def container_paths(data: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(data, dict | list):
        yield path
        for key, value in data.items() if isinstance(data, dict) else enumerate(data):
            yield from container_paths(value, (*path, key))


def replaced(data: Any, path: tuple[Any, ...], value: Any) -> Any:
    out = json.loads(json.dumps(data))
    where = out
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    return out


# Each bound of serialize._bounds at, just past and below it; wrong types; a time past the reader's.
EDGES: list[Any] = [
    None, 0, 0.0, -0.0, 1, 1.0, 1.5, -1, -1e-9, 999_999.0, 1_000_001.0, MAX_SECONDS, MAX_SECONDS + 1.0,
    MAX_RATE, MAX_RATE * 2, MAX_COUNT, MAX_COUNT + 2, int(MAX_BYTES), int(MAX_BYTES) + 1, 1e11, 1e18,
    10**400, math.inf, -math.inf, math.nan, True, False, "x", "", [], [1], {}, {"a": 1},
]  # fmt: skip


def test_the_fast_reader_vouches_for_a_whole_snapshot_and_refuses_what_the_full_reader_skips() -> None:
    base = snapshot_to_dict(full_snapshot())
    assert assert_agree(line_of(base))
    vouched = refused = 0
    for path in scalar_paths(base):
        for value in EDGES:
            if assert_agree(json.dumps(replaced(base, path, value), allow_nan=True).encode()):
                vouched += 1
            else:
                refused += 1
    for path in container_paths(base):
        if not path:
            continue
        for value in (None, [], {}, "x", 0):
            vouched += assert_agree(json.dumps(replaced(base, path, value)).encode())
    # both ways are taken: a check that refused everything would agree too, but read nothing fast
    assert vouched > 2000 and refused > 2000, (vouched, refused)


def test_a_missing_or_unknown_key_or_another_order_takes_the_full_reader() -> None:
    base = snapshot_to_dict(full_snapshot())
    for path in container_paths(base):
        here = base
        for key in path:
            here = here[key]
        if not isinstance(here, dict) or not here or path[-1:] in (("unavailable",), ("evidence",)):
            continue  # not a dataclass's object (those two are free-form mappings)
        first = next(iter(here))
        shorter = {k: v for k, v in here.items() if k != first}
        longer = {**here, "a_key_of_tomorrow": 1}
        turned = dict(reversed(list(here.items())))
        for variant in (shorter, longer, turned):
            data = replaced(base, path, variant) if path else variant
            assert not isinstance(parse_line_checked(1, line_of(data)), CheckedSnapshot), path
            assert_agree(line_of(data))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_snapshot_lines())
def test_fast_and_full_reader_agree_on_any_damage(raw: bytes) -> None:
    assert_agree(raw)


# --- snapshots drawn from the model's type hints -------------------------------------------------
# The tests above change one value of one snapshot at a time, so each dataclass is met in the few
# null patterns make_snapshot has. The check is compiled per combination of value types, so here
# every object of every dataclass gets its own (each optional field null or not, each list 0 to 2
# long), and then up to four values anywhere are set to an edge at once (a figure past its bound
# among others of its group, a bool for an int, ...).

TIME_NAMES = frozenset({"time", "since", "start_unix_time"})


def values_of(hint: Any, name: str = "") -> st.SearchStrategy[Any]:
    """JSON values for a field of type ``hint`` named ``name``, as dlmon writes them."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        options = st.one_of(*(values_of(a, name) for a in inner))
        return st.one_of(st.none(), options) if len(inner) < len(typing.get_args(hint)) else options
    if dataclasses.is_dataclass(hint):
        hints, names = _hints(hint), [f.name for f in dataclasses.fields(hint)]
        objects = st.fixed_dictionaries({name: values_of(hints[name], name) for name in names})
        return objects.map(lambda drawn: {name: drawn[name] for name in names})  # in field order
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        return st.lists(values_of(args[0]), max_size=2)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return st.dictionaries(st.sampled_from(["cause", "io", "a"]), values_of(args[1]), max_size=2)
    if hint is float:
        return st.floats(0.0, 1e10) if name in TIME_NAMES else st.floats(0.0, 1.0)
    if name == "schema":
        return st.integers(0, SCHEMA_VERSION)
    kinds: dict[Any, st.SearchStrategy[Any]] = {bool: st.booleans(), str: st.text(max_size=3)}
    return kinds.get(hint, st.integers(0, 3000))


@st.composite
def snapshot_lines_from_hints(draw: st.DrawFn) -> bytes:
    data = {"type": "snapshot", **draw(values_of(Snapshot))}
    paths = list(scalar_paths(data))[1:]  # not the type
    for _ in range(draw(st.integers(0, 4))):
        data = replaced(data, draw(st.sampled_from(paths)), draw(st.sampled_from(EDGES)))
    return json.dumps(data, allow_nan=True).encode()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snapshot_lines_from_hints())
def test_fast_and_full_reader_agree_on_snapshots_drawn_from_the_type_hints(raw: bytes) -> None:
    event("vouched" if assert_agree(raw) else "full reader")  # --hypothesis-show-statistics: both occur
