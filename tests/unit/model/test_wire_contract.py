"""The agent's wire protocol, both ends at once, without torch or a socket.

Every message is built with the agent's own builders (dlmon/agent/wire.py) from representative
state, then decoded by the client (dlmon/collect/agent_decode.py) through dicts that record each
key it reads. The keys read must be exactly the keys written, less the ones listed in
NOT_DECODED: a key added on one side only (a builder's new key nobody decodes, a decoder's key,
or typo, that no builder writes) fails here instead of turning into None on the screen.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from dlmon.agent import wire
from dlmon.collect.agent_client import AgentClient
from dlmon.collect.agent_decode import check_reply, main_stack, parse_reply
from support.agent import counters_reply, loader_reply

# Keys the agent sends that the dashboard does not decode: for `dlmon.agent.counters()`, tests and
# people reading the socket by hand. Decode a key, or list it here, when a builder gains one.
NOT_DECODED = frozenset(
    {
        "unix_time",
        "python",
        "torch_imported",
        "hooks_patched",
        "hooks",
        "cuda_initialized",
        "num_threads_time_ns",
        "loaders[].function",
        "loaders[].site",
        "loaders[].pin_memory_effective",
        "loaders[].drop_last",
        "loaders[].timeout",
        "loaders[].dataset",
        "loaders[].dataset_kind",
        "loaders[].iterators[].id",
        "loaders[].iterators[].worker_pids",
        "worker_deaths[].iterator_id",
        "worker_deaths[].core_dumped",
        "worker_deaths[].time_ns",
        "rank.source",
    }
)
NOT_DECODED_STACKS = frozenset({"unix_time"})

# Values that are free-form maps, not protocol shapes: their keys are data (hook names).
FREE_FORM = frozenset({"degraded"})


class Recorder(dict[str, Any]):
    """A dict that notes every key read through ``get`` or ``[]`` (``in`` tests are not reads)."""

    def __init__(self, path: str, items: dict[str, Any], reads: set[str]) -> None:
        super().__init__(items)
        self._path = path
        self._reads = reads

    def _note(self, key: object) -> None:
        self._reads.add(f"{self._path}{key}")

    def get(self, key: str, default: Any = None) -> Any:
        self._note(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self._note(key)
        return super().__getitem__(key)


def recording(value: Any, reads: set[str], path: str = "") -> Any:
    if isinstance(value, dict) and path.rstrip(".") not in FREE_FORM:
        return Recorder(path, {k: recording(v, reads, f"{path}{k}.") for k, v in value.items()}, reads)
    if isinstance(value, list):
        return [recording(v, reads, f"{path.rstrip('.')}[].") for v in value]
    return value


def written(value: Any, path: str = "") -> set[str]:
    """Every key path of a message, as :class:`Recorder` names them."""
    out: set[str] = set()
    if isinstance(value, dict) and path.rstrip(".") not in FREE_FORM:
        for k, v in value.items():
            out.add(f"{path}{k}")
            out |= written(v, f"{path}{k}.")
    elif isinstance(value, list):
        for v in value:
            out |= written(v, f"{path.rstrip('.')}[].")
    return out


def _through_json(msg: Any) -> Any:
    return json.loads(json.dumps(msg))


def representative_counters(time_ns: int, batches: int, wait: int) -> wire.CountersReply:
    """Every shape present at least once, every optional part filled, every branch of the
    decoder taken (a call in progress, start-up pending, a rank, a death, pinned memory)."""
    iterator = wire.iterator_wire(id=1, worker_pids=[100, 101], in_call_ns=5_000)
    loader = loader_reply(
        batches_total=batches,
        samples_total=8 * batches,
        wait_ns_total=wait,
        compute_ns_total=3 * wait,
        startup_wait_ns_total=50,
        end_wait_ns_total=7,
        epochs=1,
        wait_ns_pending=10,
        startup_wait_ns_pending=20,
        compute_ns_pending=30,
        iterators=[iterator],
        role="train",
        role_source="framework",
        framework="Lightning",
    )
    death = wire.worker_death_wire(
        pid=100,
        worker_id=0,
        loader_id=1,
        iterator_id=1,
        signal=9,
        signal_name="SIGKILL",
        exit_code=None,
        core_dumped=False,
        time_ns=time_ns,
        unix_time=1.7e9,
        loader_name="train.py:10",
    )
    device = wire.cuda_device_wire(
        device=0, allocated=10, reserved=20, peak_allocated=15, name="H200", uuid="GPU-abc"
    )
    return counters_reply(
        time_ns=time_ns,
        hooks=["iter_next", "sigchld"],
        degraded={"sigchld": "why"},
        loaders=[loader],
        worker_deaths=[death],
        cuda_initialized=True,
        cuda=[device],
        pinned=wire.pinned_wire(
            bytes=4096, in_use=1024, source="torch.cuda.host_memory_stats:allocated_bytes.current"
        ),
        num_threads=8,
        num_threads_time_ns=time_ns,
        rank=wire.rank_wire(rank=1, local_rank=1, world_size=2, node_rank=0, source="env"),
    )


def representative_stacks() -> wire.StacksReply:
    threads = [
        wire.thread_wire(name="MainThread", main=True, frames=[["/job/train.py", 3, "main"]]),
        wire.thread_wire(name="pin", main=False, frames=[]),
    ]
    return wire.stacks_reply(pid=42, unix_time=1.7e9, threads=threads)


def _decode_counters(first: Any, second: Any) -> set[str]:
    """The keys the client reads decoding two readings of one agent (rates need both)."""
    reads: set[str] = set()
    client = AgentClient()
    for msg in (first, second):
        rec = recording(_through_json(msg), reads)
        assert check_reply(rec, 42) is rec
        reading = client.convert({42: rec})
        assert reading.pids == (42,)
    return reads


def test_the_client_decodes_every_key_the_agent_writes() -> None:
    first = representative_counters(1_000_000_000, 10, 100)
    second = representative_counters(2_000_000_000, 30, 400)
    reads = _decode_counters(first, second)
    sent = written(second)
    assert len(reads) > 60  # the check is not vacuous
    assert sent >= NOT_DECODED, "NOT_DECODED lists keys no builder writes"
    assert sorted(reads - sent) == [], "the client reads keys the agent never writes"
    assert sorted(sent - NOT_DECODED - reads) == [], "the agent writes keys the client never reads"
    assert sorted(reads & NOT_DECODED) == [], "NOT_DECODED lists keys the client now reads"


def test_the_client_decodes_every_key_of_a_stacks_reply() -> None:
    reads: set[str] = set()
    rec = recording(_through_json(representative_stacks()), reads)
    assert check_reply(rec, 42) is rec
    assert main_stack(rec) == ("MainThread", [("/job/train.py", 3, "main")])
    sent = written(rec)
    assert sent >= NOT_DECODED_STACKS
    assert sorted(reads - sent) == [], "the client reads keys the agent never writes"
    assert sorted(sent - NOT_DECODED_STACKS - reads) == [], "the agent writes keys the client never reads"
    assert sorted(reads & NOT_DECODED_STACKS) == [], "NOT_DECODED_STACKS lists keys the client now reads"


def test_the_agents_own_replies_are_of_the_wire_shapes() -> None:
    """What the agent really sends (not the test's builders): a key set outside a builder
    (``reply["x"] = ...``) would reach no decoder and no contract. Without torch imported, the
    agent's counters carry no loaders, but every top-level key."""
    from dlmon.agent import _server

    reply = _server.build_counters(None)
    assert set(reply) == set(wire.CountersReply.__annotations__)


def test_builders_write_exactly_their_shapes() -> None:
    shapes: list[tuple[Any, Any]] = [
        (representative_counters(1, 1, 1), wire.CountersReply),
        (loader_reply(), wire.LoaderWire),
        (wire.iterator_wire(id=1, worker_pids=[], in_call_ns=0), wire.IteratorWire),
        (representative_counters(1, 1, 1)["worker_deaths"][0], wire.WorkerDeathWire),
        (representative_counters(1, 1, 1)["cuda"][0], wire.CudaDeviceWire),
        (wire.pinned_wire(bytes=1, in_use=None, source="s"), wire.PinnedWire),
        (
            wire.rank_wire(rank=0, local_rank=None, world_size=None, node_rank=None, source="env"),
            wire.RankWire,
        ),
        (representative_stacks(), wire.StacksReply),
        (representative_stacks()["threads"][0], wire.ThreadWire),
        (wire.error_reply("x"), wire.ErrorReply),
    ]
    for msg, shape in shapes:
        assert set(msg) == set(shape.__annotations__), shape.__name__
    assert representative_stacks()["v"] == representative_counters(1, 1, 1)["v"] == wire.WIRE_VERSION


def test_requests_are_the_wire_modules() -> None:
    assert json.loads(wire.COUNTERS_REQUEST) == {wire.GET: wire.COUNTERS}
    assert json.loads(wire.STACKS_REQUEST) == {wire.GET: wire.STACKS}
    assert wire.COUNTERS_REQUEST.endswith(b"\n") and wire.COUNTERS_REQUEST.count(b"\n") == 1


@pytest.mark.parametrize("other", [wire.WIRE_VERSION + 1, 0, "1", True, 1.0, None])
def test_an_agent_of_another_version_gets_one_note_and_no_decoding(other: Any) -> None:
    msg: dict[str, Any] = _through_json(representative_counters(1_000_000_000, 10, 100))
    msg["v"] = other
    msg["loaders"] = "a shape this client does not know"  # would be dropped as malformed otherwise
    line = json.dumps(msg).encode() + b"\n"
    parsed = parse_reply(line, 42)
    assert parsed is not None, "a reply of another version is a reply, not silence"
    reads: set[str] = set()
    client = AgentClient()
    reading = client.convert({42: recording(parsed, reads)})
    assert reading.pids == () and reading.loaders == ()
    assert reads <= {"v", "pid"}, "fields of another version were decoded"
    note = client.note()
    assert note is not None and "pid 42" in note, note
    assert f"speaks wire protocol version {json.dumps(other)}, this dlmon speaks 1" in note, (
        note
    )  # "1" is not 1

    assert client.unanswered_note() is None  # it answered: it is not "not answering"
    # stacks of that agent are not decoded either
    stacks: dict[str, Any] = _through_json(representative_stacks())
    stacks["v"] = other
    assert main_stack(stacks) is None
    # the same agent speaking this version again: decoded, and the note goes
    ok = _through_json(representative_counters(2_000_000_000, 20, 200))
    assert client.convert({42: ok}).pids == (42,)
    assert client.note() is None
