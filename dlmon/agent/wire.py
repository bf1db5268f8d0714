"""The agent's wire protocol: what dlmon asks its in-process agent, and what the agent answers.

Transport (``dlmon.agent._server``): the client connects to the agent's Unix socket, sends one
request line (``{"get": "counters"}`` or ``{"get": "stacks"}``), reads one JSON line, and the
agent closes the connection. A peer with another uid is closed without a word.

Every answer carries ``v``, the protocol version. A client that reads another version does not
decode it: it says so once instead (``dlmon.collect.agent_client``). Adding a key that older
clients may ignore keeps the version; renaming, removing or changing the meaning of one bumps it.

Counters are cumulative since the agent started; ``*_ns`` are ``time.perf_counter_ns``
durations, ``time_ns`` is ``time.monotonic_ns()`` when the reply was built. ``*_pending`` are what
a loader call still in progress (the training waits for a batch right now) will add to the
matching ``*_total`` when it returns, measured up to ``time_ns``: a client adds them to see a
stall while it lasts. ``in_call_ns`` is how long the iterator's current call has been running.

Each shape is a TypedDict and each message has one builder here: the agent builds every message
with them, and tests/unit/model/test_wire_contract.py checks that the client decodes every key a builder
writes (or is listed there as not for the dashboard). Standard library only: the agent imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypedDict

WIRE_VERSION = 1

# -- requests ---------------------------------------------------------------------------------

GET = "get"
COUNTERS = "counters"
STACKS = "stacks"


def request(what: str) -> bytes:
    """One request line: ``{"get": what}``."""
    return json.dumps({GET: what}).encode("utf-8") + b"\n"


COUNTERS_REQUEST = request(COUNTERS)
STACKS_REQUEST = request(STACKS)


def encode(message: object) -> bytes:
    """A message as the one JSON line the agent sends."""
    return json.dumps(message).encode("utf-8") + b"\n"


# -- answers ----------------------------------------------------------------------------------


class ErrorReply(TypedDict):
    error: str


class IteratorWire(TypedDict):
    id: int
    worker_pids: list[int]
    in_call_ns: int


class LoaderWire(TypedDict):
    id: int
    name: str
    file: str | None
    line: int | None
    function: str | None
    site: str  # "constructed" | "first_iterated" | "unknown"
    alive: bool
    num_workers: int | None
    batch_size: int | None
    prefetch_factor: int | None
    pin_memory: bool | None
    pin_memory_effective: bool | None
    persistent_workers: bool | None
    drop_last: bool | None
    timeout: float | None
    multiprocessing_context: str | None
    dataset: str | None  # the dataset's class name
    dataset_kind: str | None  # "map" | "iterable"
    batches_total: int
    samples_total: int
    wait_ns_total: int
    compute_ns_total: int
    startup_wait_ns_total: int
    end_wait_ns_total: int
    epochs: int
    epochs_started: int
    wait_ns_pending: int
    startup_wait_ns_pending: int
    compute_ns_pending: int
    worker_pids: list[int]
    batches_per_worker: list[int]
    iterators: list[IteratorWire]
    role: str | None  # "train" | "validation" | "test" | "other"
    role_source: str | None  # "framework" | "pattern"
    framework: str | None  # "Lightning" | "HF Trainer" | "accelerate" | "torchdata"
    iterated: bool
    replaced_by: int | None  # the id of the loader a framework re-created this one as


class WorkerDeathWire(TypedDict):
    """Also one line of the agent's death journal (``<pid>.deaths``), which outlives it."""

    pid: int
    worker_id: int
    loader_id: int
    iterator_id: int
    signal: int | None
    signal_name: str | None
    exit_code: int | None
    core_dumped: bool
    time_ns: int
    unix_time: float
    loader_name: str


class CudaDeviceWire(TypedDict):
    device: int
    allocated: int | None
    reserved: int | None
    peak_allocated: int | None
    name: str | None
    uuid: str | None


class PinnedWire(TypedDict):
    bytes: int  # the pinned pool: blocks torch's caching host allocator holds, in use or cached
    in_use: int | None  # the part handed out (None where the running torch does not say)
    source: str


class RankWire(TypedDict):
    rank: int
    local_rank: int | None
    world_size: int | None
    node_rank: int | None
    source: str  # "env" | "slurm"


class CountersReply(TypedDict):
    """The answer to ``{"get": "counters"}``."""

    v: int
    pid: int
    agent_id: str | None  # random per agent: a new one behind the same pid means pid reuse
    time_ns: int
    unix_time: float
    python: str
    torch_imported: bool
    torch_version: str | None
    hooks_patched: bool
    hooks: list[str]  # the hooks that work
    degraded: dict[str, str]  # hook -> why it does not
    loaders: list[LoaderWire]
    worker_deaths: list[WorkerDeathWire]
    cuda_initialized: bool
    cuda: list[CudaDeviceWire]
    pinned: PinnedWire | None
    num_threads: int | None
    num_threads_time_ns: int | None
    rank: RankWire | None
    # Unix time the agent was loaded into this process while it ran (``attach --inject``): every
    # count begins then. None when it started with the process (``dlmon run``, ``start()``).
    injected_unix_time: float | None


class ThreadWire(TypedDict):
    name: str
    main: bool
    frames: list[list[Any]]  # [file, line, function], innermost call last


class StacksReply(TypedDict):
    """The answer to ``{"get": "stacks"}``."""

    v: int
    pid: int
    unix_time: float
    threads: list[ThreadWire]


# -- builders ---------------------------------------------------------------------------------


def error_reply(message: str) -> ErrorReply:
    return {"error": message}


def iterator_wire(*, id: int, worker_pids: list[int], in_call_ns: int) -> IteratorWire:
    return {"id": id, "worker_pids": worker_pids, "in_call_ns": in_call_ns}


def loader_wire(
    *,
    id: int,
    name: str,
    file: str | None,
    line: int | None,
    function: str | None,
    site: str,
    alive: bool,
    settings: dict[str, Any],
    batches_total: int,
    samples_total: int,
    wait_ns_total: int,
    compute_ns_total: int,
    startup_wait_ns_total: int,
    end_wait_ns_total: int,
    epochs: int,
    epochs_started: int,
    wait_ns_pending: int,
    startup_wait_ns_pending: int,
    compute_ns_pending: int,
    worker_pids: list[int],
    batches_per_worker: list[int],
    iterators: list[IteratorWire],
    role: str | None,
    role_source: str | None,
    framework: str | None,
    iterated: bool,
    replaced_by: int | None,
) -> LoaderWire:
    """``settings``: what the agent read from the DataLoader (missing ones are sent as null)."""
    s = settings
    return {
        "id": id,
        "name": name,
        "file": file,
        "line": line,
        "function": function,
        "site": site,
        "alive": alive,
        "num_workers": s.get("num_workers"),
        "batch_size": s.get("batch_size"),
        "prefetch_factor": s.get("prefetch_factor"),
        "pin_memory": s.get("pin_memory"),
        "pin_memory_effective": s.get("pin_memory_effective"),
        "persistent_workers": s.get("persistent_workers"),
        "drop_last": s.get("drop_last"),
        "timeout": s.get("timeout"),
        "multiprocessing_context": s.get("multiprocessing_context"),
        "dataset": s.get("dataset"),
        "dataset_kind": s.get("dataset_kind"),
        "batches_total": batches_total,
        "samples_total": samples_total,
        "wait_ns_total": wait_ns_total,
        "compute_ns_total": compute_ns_total,
        "startup_wait_ns_total": startup_wait_ns_total,
        "end_wait_ns_total": end_wait_ns_total,
        "epochs": epochs,
        "epochs_started": epochs_started,
        "wait_ns_pending": wait_ns_pending,
        "startup_wait_ns_pending": startup_wait_ns_pending,
        "compute_ns_pending": compute_ns_pending,
        "worker_pids": worker_pids,
        "batches_per_worker": batches_per_worker,
        "iterators": iterators,
        # what the loader is for and who built it (older clients ignore these keys)
        "role": role,
        "role_source": role_source,
        "framework": framework,
        "iterated": iterated,
        "replaced_by": replaced_by,
    }


def worker_death_wire(
    *,
    pid: int,
    worker_id: int,
    loader_id: int,
    iterator_id: int,
    signal: int | None,
    signal_name: str | None,
    exit_code: int | None,
    core_dumped: bool,
    time_ns: int,
    unix_time: float,
    loader_name: str,
) -> WorkerDeathWire:
    return {
        "pid": pid,
        "worker_id": worker_id,
        "loader_id": loader_id,
        "iterator_id": iterator_id,
        "signal": signal,
        "signal_name": signal_name,
        "exit_code": exit_code,
        "core_dumped": core_dumped,
        "time_ns": time_ns,
        "unix_time": unix_time,
        "loader_name": loader_name,
    }


def cuda_device_wire(
    *,
    device: int,
    allocated: int | None,
    reserved: int | None,
    peak_allocated: int | None,
    name: str | None,
    uuid: str | None,
) -> CudaDeviceWire:
    return {
        "device": device,
        "allocated": allocated,
        "reserved": reserved,
        "peak_allocated": peak_allocated,
        "name": name,
        "uuid": uuid,
    }


def pinned_wire(*, bytes: int, in_use: int | None, source: str) -> PinnedWire:
    return {"bytes": bytes, "in_use": in_use, "source": source}


def rank_wire(
    *, rank: int, local_rank: int | None, world_size: int | None, node_rank: int | None, source: str
) -> RankWire:
    return {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "node_rank": node_rank,
        "source": source,
    }


def counters_reply(
    *,
    pid: int,
    agent_id: str | None,
    time_ns: int,
    unix_time: float,
    python: str,
    torch_imported: bool,
    torch_version: str | None,
    hooks_patched: bool,
    hooks: list[str],
    degraded: dict[str, str],
    loaders: list[LoaderWire],
    worker_deaths: list[WorkerDeathWire],
    cuda_initialized: bool,
    cuda: list[CudaDeviceWire],
    pinned: PinnedWire | None,
    num_threads: int | None,
    num_threads_time_ns: int | None,
    rank: RankWire | None,
    injected_unix_time: float | None,
) -> CountersReply:
    return {
        "v": WIRE_VERSION,
        "pid": pid,
        "agent_id": agent_id,
        "time_ns": time_ns,
        "unix_time": unix_time,
        "python": python,
        "torch_imported": torch_imported,
        "torch_version": torch_version,
        "hooks_patched": hooks_patched,
        "hooks": hooks,
        "degraded": degraded,
        "loaders": loaders,
        "worker_deaths": worker_deaths,
        "cuda_initialized": cuda_initialized,
        "cuda": cuda,
        "pinned": pinned,
        "num_threads": num_threads,
        "num_threads_time_ns": num_threads_time_ns,
        "rank": rank,
        "injected_unix_time": injected_unix_time,
    }


def thread_wire(*, name: str, main: bool, frames: list[list[Any]]) -> ThreadWire:
    return {"name": name, "main": main, "frames": frames}


def stacks_reply(*, pid: int, unix_time: float, threads: list[ThreadWire]) -> StacksReply:
    return {"v": WIRE_VERSION, "pid": pid, "unix_time": unix_time, "threads": threads}


_UNSAID = object()


def version_of(reply: object) -> object:
    """The version a reply says it speaks (``"v"``, whatever its type, null included); a reply
    without the key says none (agents have always sent one, so only hand-made replies lack it,
    and they are read as this version)."""
    return reply.get("v", _UNSAID) if isinstance(reply, Mapping) else _UNSAID


def speaks_this_version(reply: object) -> bool:
    v = version_of(reply)
    return v is _UNSAID or (type(v) is int and v == WIRE_VERSION)
