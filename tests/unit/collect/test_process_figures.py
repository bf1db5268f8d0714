"""Every per-process figure the model declares is read by the collector: a field added to
``ProcessSample`` without its read in ``dlmon/collect/processes.py`` (its /proc key not in
``STATUS_KEYS``/``IO_KEYS``, or left out of ``_build``) would show a dash for ever and export
nothing, and no other test would notice."""

from __future__ import annotations

import dataclasses
import time

from conftest import Spawn
from dlmon.collect.processes import IO_KEYS, STATUS_KEYS, Cadence, ProcessTracker
from dlmon.collect.smaps_budget import SmapsBudget
from dlmon.model import ProcessSample

# Figures that come from elsewhere than the process's own /proc files, and where.
NOT_FROM_PROC = {
    "worker_id": "the in-process agent",
    "torch_threads": "the in-process agent",
    "rank": "the in-process agent",
    "local_rank": "the in-process agent",
    "node_rank": "the in-process agent",
    "gpu_memory_bytes": "NVML",
}

BUSY = """
    import os, time
    held = bytearray(8 * 1024 * 1024)
    for i in range(0, len(held), 4096):
        held[i] = 1
    print("READY", flush=True)
    fd = os.open("/tmp", os.O_TMPFILE | os.O_WRONLY)
    end = time.time() + 120
    while time.time() < end:  # CPU, writes that reach the block layer, sleeps (voluntary switches)
        os.write(fd, b"x" * 65536)
        os.fsync(fd)
        time.sleep(0.001)
"""


def test_every_figure_of_a_process_is_read_from_proc(spawn: Spawn) -> None:
    proc = spawn(BUSY)
    tracker = ProcessTracker(
        proc.pid,
        SmapsBudget(unlimited=True),
        cadence=Cadence(unmoved_refresh_s=0.0, fd_refresh_s=0.0),
    )
    rows: list[ProcessSample] = []
    try:
        for _ in range(4):
            rows += [s for s in tracker.sample() if s.pid == proc.pid]
            time.sleep(0.3)
    finally:
        tracker.close()
    names = [f.name for f in dataclasses.fields(ProcessSample)]
    assert set(NOT_FROM_PROC) <= set(names), "NOT_FROM_PROC names a field the model no longer has"
    never = [n for n in names if n not in NOT_FROM_PROC and all(getattr(r, n) is None for r in rows)]
    assert never == [], f"figures no tick read for a live, busy process: {never}"


def test_the_counters_keep_counts_and_say_when_io_moved() -> None:
    from dlmon.collect.processes import Counters

    status = {"VmLck": 4096, "nonvoluntary_ctxt_switches": 30}
    before = Counters(nonvoluntary_ctxt_switches=10, read_bytes=100)
    counts = Counters.read(status, {"read_bytes": 100})
    rates = counts.rates(before, 2.0)
    assert (counts.nonvoluntary_ctxt_switches, counts.read_bytes) == (30, 100)
    assert (rates.nonvoluntary_ctxt_switches_per_s, rates.read_bytes_per_s) == (10.0, 0.0)
    assert not counts.io_moved_since(before)
    assert Counters.read(status, {"read_bytes": 164}).io_moved_since(before)  # bytes read since: moved
    unmoved = Counters.read(status, {}).unmoved()  # not read again this tick
    assert unmoved.nonvoluntary_ctxt_switches_per_s == 0.0 and unmoved.read_bytes_per_s is None


# Each figure's line in /proc/PID/status or io, written out here apart from the collector: a
# figure reading the wrong key (RssFile for rss_anon_bytes) passes every test that only asks
# whether a figure is read.
FROM_STATUS = {
    "rss_anon_bytes": "RssAnon",
    "rss_file_bytes": "RssFile",
    "shmem_bytes": "RssShmem",
    "locked_bytes": "VmLck",
    "pinned_bytes": "VmPin",
    "voluntary_ctxt_switches": "voluntary_ctxt_switches",
    "nonvoluntary_ctxt_switches": "nonvoluntary_ctxt_switches",
}
FROM_IO = {"read_bytes": "read_bytes", "write_bytes": "write_bytes"}

STILL = """
    import ctypes, mmap, os, time
    anon = bytearray(24 * 1024 * 1024)
    for i in range(0, len(anon), 4096):
        anon[i] = 1
    shared = mmap.mmap(-1, 4 * 1024 * 1024)
    shared.write(b"x" * len(shared))
    page = mmap.mmap(-1, 4096)
    page.write(b"y" * 4096)
    where = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    assert ctypes.CDLL(None).mlock(where, 4096) == 0  # VmLck: 4 kB, VmPin: 0
    fd = os.open("/tmp", os.O_TMPFILE | os.O_WRONLY)
    os.write(fd, b"z" * 262144)
    os.fsync(fd)
    print("READY", flush=True)
    time.sleep(120)
"""


def _proc_values(pid: int, name: str) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/{name}") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def test_each_figure_is_its_own_line_of_status_and_io(spawn: Spawn) -> None:
    proc = spawn(STILL)
    time.sleep(0.3)  # past its last write: a sleeping process's lines stay as they are
    tracker = ProcessTracker(proc.pid, SmapsBudget(unlimited=True))
    try:
        status, io = _proc_values(proc.pid, "status"), _proc_values(proc.pid, "io")
        row = next(s for s in tracker.sample() if s.pid == proc.pid)
    finally:
        tracker.close()
    # VmRSS, VmSwap and FDSize are read for what the row makes of them, not as they are
    figure_keys = set(STATUS_KEYS) - {"VmRSS", "VmSwap", "FDSize"}
    assert figure_keys == set(FROM_STATUS.values()), "a status line this test does not check"
    assert set(IO_KEYS) == set(FROM_IO.values()), "an io line this test does not check"
    figures = [*FROM_STATUS, *FROM_IO]
    read = {name: getattr(row, name) for name in figures}
    expected = {name: status[key] for name, key in FROM_STATUS.items()}
    expected |= {name: io[key] for name, key in FROM_IO.items()}
    assert read == expected
    assert len({read["rss_anon_bytes"], read["rss_file_bytes"], read["shmem_bytes"]}) == 3
    assert read["write_bytes"] != read["read_bytes"] and read["locked_bytes"] != read["pinned_bytes"]
