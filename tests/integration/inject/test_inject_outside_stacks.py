"""A DataLoader training started without dlmon whose worker hangs *before* the agent is loaded:
the worker was forked without the agent's stack handler, so its stack is read from outside
(py-spy ``--nonblocking``, else gdb's ``py-bt``), never signalled, and the record and the stall
verdict show it with the way it was taken."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from dlmon.collect.outside_stacks import (
    SOURCE_GDB,
    SOURCE_NONE,
    SOURCE_PY_SPY,
    gdb_extension,
    parse_py_bt,
    parse_py_spy,
    read_stack,
)
from dlmon.model.format import STACK_TAKEN
from integration.inject.test_inject_midflight import clean_env, clean_environment
from support.paths import ROOT

__all__ = ["clean_env"]  # a fixture, used by name

needs_gdb = pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
gdb_python = pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14+ injects with sys.remote_exec")

# Two fork workers built before any agent; the item at HANG_AT hangs its worker for good. The
# trainer logs its batch count, so the test knows the hang came before the load.
TRAINER = """
import sys, threading, time
import torch
from torch.utils.data import DataLoader, Dataset

HANG_AT = 40

def hang_here():
    threading.Event().wait()

class Items(Dataset):
    def __len__(self):
        return 1_000_000
    def __getitem__(self, i):
        if i == HANG_AT:
            hang_here()
        return torch.tensor([float(i)])

LOG = sys.argv[1]
loader = DataLoader(Items(), batch_size=4, num_workers=2)
print("READY", flush=True)
with open(LOG, "w", buffering=1) as log:
    for n, batch in enumerate(loader, 1):
        log.write(f"{n}\\n")
"""


def wait_hung(log: Path) -> int:
    """The batch count once it has stopped moving for 2 s (the trainer waits for the hung worker)."""
    deadline = time.monotonic() + 60
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        n = len(text.splitlines())
        if n != last:
            last, since = n, time.monotonic()
        elif n > 0 and time.monotonic() - since > 2.0:
            return n
        time.sleep(0.2)
    raise AssertionError(f"the trainer never hung ({last} batches)")


@dataclass(frozen=True)
class HungRun:
    """What the hung-before-the-load scenario left for its test to check."""

    hung_after: int  # batches before the hang
    returncode: int  # of `dlmon record --inject`
    stderr: str
    alive_after: bool  # the training after the recording: never signalled
    out: Path  # the record


def can_run_hung_before_load() -> bool:
    return (
        shutil.which("gdb") is not None
        and shutil.which("py-spy") is not None
        and sys.version_info < (3, 14)
        and importlib.util.find_spec("torch") is not None
    )


def run_hung_before_load(base: Path) -> HungRun:
    """A training started without dlmon, in an environment of its own (as ``clean_env``), whose
    worker hangs before the load; then 75 s of `dlmon record --inject` (the loader's first stall
    reading comes at 60 s of the call, timed from the load). Mostly asleep: the package's
    conftest starts it early, beside other tests, so the suite does not wait the 75 s alone."""
    d, env = clean_environment()
    log = base / "log"
    wrapper = f"import sys; sys.argv = ['-c', {str(log)!r}]; exec(compile({TRAINER!r}, '<trainer>', 'exec'))"
    proc = subprocess.Popen(
        [sys.executable, "-c", wrapper],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline().strip() == "READY"
        hung_after = wait_hung(log)
        out = base / "rec.jsonl"
        cmd = [sys.executable, "-m", "dlmon", "record", str(proc.pid), "--inject", "-o", str(out)]
        got = subprocess.run(
            [*cmd, "--duration", "75", "--interval", "1"],
            capture_output=True,
            text=True,
            timeout=200,
            cwd=ROOT,
            env=env,
        )
        return HungRun(hung_after, got.returncode, got.stderr, proc.poll() is None, out)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


@needs_gdb
@gdb_python
@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed (pip install py-spy)")
def test_a_worker_hung_before_the_load_has_its_stack_read_from_outside(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    pytest.importorskip("torch")
    from integration.inject.conftest import hung_before_load

    run = hung_before_load(tmp_path_factory).result(timeout=400)
    assert run.hung_after < 40 // 4 + 1  # batch 10 (items 40..43) never came: hung before the load
    assert run.returncode == 0, run.stderr
    assert run.alive_after  # never signalled: the handler-less worker would have died of it
    out = run.out
    snaps = [x for x in map(json.loads, out.read_text().splitlines()) if x.get("type") == "snapshot"]
    workers = set(snaps[-1]["loaders"][0]["worker_pids"])
    stacks = [st for s in snaps for st in s["stacks"] if st["pid"] in workers]
    hung = [st for st in stacks if any(f["function"] == "hang_here" for f in st["frames"])]
    assert hung, stacks
    assert {st["source"] for st in hung} == {SOURCE_PY_SPY}, hung
    idle = [st for st in stacks if st not in hung]
    assert idle and all(st["source"] == SOURCE_PY_SPY for st in idle)  # the other worker, read too

    stalls = [a for s in snaps for a in s["alerts"] if a["kind"] == "stall"]
    assert stalls, [s["alerts"] for s in snaps[-3:]]
    ev = stalls[-1]["evidence"]
    assert ev["pid"] == hung[0]["pid"] and "hang_here" in ev["stack"], ev
    assert ev["stack_taken"] == STACK_TAKEN[SOURCE_PY_SPY]
    assert f"worker 0 (pid {ev['pid']}) is stuck in" in stalls[-1]["message"]
    assert STACK_TAKEN[SOURCE_PY_SPY] in stalls[-1]["message"]

    # the worker's detail screen (Enter on its row): the stack, and how it was taken
    from dlmon.flow.records import iter_records
    from dlmon.model import Snapshot
    from dlmon.ui.state import DashboardState
    from dlmon.ui.views import detail_lines, text_of

    state = DashboardState()
    for record in iter_records(str(out)):
        if isinstance(record, Snapshot):
            state.ingest(record)
    assert state.latest is not None
    (row,) = [r for r in state.rows.values() if r.process.pid == ev["pid"]]
    detail = "\n".join(text_of(x) for x in detail_lines(row, state.latest, 200))
    assert STACK_TAKEN[SOURCE_PY_SPY] in detail and "in hang_here" in detail, detail


def hanging(python: str) -> subprocess.Popen[str]:
    code = (
        "import threading\ndef hang_here():\n    print('READY', flush=True)\n"
        "    threading.Event().wait()\nhang_here()\n"
    )
    proc = subprocess.Popen([python, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    return proc


@needs_gdb
def test_gdb_py_bt_reads_a_stack_where_py_spy_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback: gdb with the target's own python3.X-gdb.py (pyenv installs it)."""
    proc = hanging(sys.executable)
    try:
        if gdb_extension(proc.pid) is None:
            pytest.skip("this Python ships no python3.X-gdb.py")
        real_which = shutil.which
        monkeypatch.setattr(shutil, "which", lambda name: None if name == "py-spy" else real_which(name))
        got = read_stack(proc.pid)
        assert got.source == SOURCE_GDB and "hang_here" in [f.function for f in got.frames], got
        with open(f"/proc/{proc.pid}/status") as fh:
            status = fh.read()
        assert "TracerPid:\t0" in status and "State:\tS" in status  # detached and running
    finally:
        proc.kill()
        proc.wait()


def test_without_py_spy_nor_gdb_the_stack_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    got = read_stack(os.getpid())
    assert got.source == SOURCE_NONE and got.frames == ()
    assert "pip install py-spy" in STACK_TAKEN[SOURCE_NONE]


def test_py_spy_json_is_read_outermost_first_choosing_the_worker_loop() -> None:
    threads = [
        {"thread_name": "Thread-1", "frames": [{"name": "wait", "filename": "/t.py", "line": 3}]},
        {
            "thread_name": "MainThread",
            "frames": [
                {"name": "hang_here", "filename": "/d.py", "line": 9},
                {"name": "_worker_loop", "filename": "/worker.py", "line": 300},
            ],
        },
    ]
    name, frames = parse_py_spy(json.dumps(threads), "_worker_loop") or (None, ())
    assert name == "MainThread" and [f.function for f in frames] == ["_worker_loop", "hang_here"]
    assert parse_py_spy("Error: no such process", "_worker_loop") is None


def test_py_bt_is_read_outermost_first() -> None:
    text = (
        "Traceback (most recent call first):\n"
        '  File "/d.py", line 9, in hang_here\n'
        "    threading.Event().wait()\n"
        '  File "/w.py", line 300, in _worker_loop\n'
    )
    assert [(f.function, f.line) for f in parse_py_bt(text)] == [("_worker_loop", 300), ("hang_here", 9)]


def lone_worker_history(stack_source: str, frames: tuple[str, ...]) -> list[object]:
    """Worker 1 finishes nothing for 3 minutes, asleep, while the loader goes on; its stacks were
    taken the way ``stack_source`` says."""
    import dataclasses

    from dlmon.analysis import Analyzer
    from dlmon.model.snapshot import ProcessStack, StackFrame
    from support.snapshots import MAIN_PID, loader, proc, snap

    workers = [proc(MAIN_PID + 1 + i, worker_id=i, cpu=50.0 if i == 0 else 0.0) for i in range(2)]
    stack = ProcessStack(
        pid=MAIN_PID + 2,
        role="worker",
        worker_id=1,
        time=0.0,
        thread="MainThread",
        frames=tuple(StackFrame("/job/data.py", 9, f) for f in frames),
        state="S",
        source=stack_source,
    )
    history = []
    for k in range(200):
        ls = dataclasses.replace(
            loader(worker_pids=[p.pid for p in workers], num_workers=2),
            batches_total=2 * k,
            batches_per_s=2.0,
            in_call_s=0.0,
            batches_per_worker=(2 * k, 0),
        )
        s = snap(k, workers, loaders=[ls])
        history.append(dataclasses.replace(s, stacks=(stack,) if k % 30 == 29 else ()))
    a = Analyzer(cores=2, strict=True)
    return [a(s) for s in history]


def test_a_worker_whose_stack_could_not_be_read_is_not_called_stuck_alone() -> None:
    """Without a stack, one quiet worker looks like one whose shard ran out: 'none' is no stack."""
    outs = lone_worker_history(SOURCE_NONE, ())
    assert not [a for s in outs for a in s.alerts if a.kind == "stall"]  # type: ignore[attr-defined]


def test_a_worker_stuck_alone_says_its_stack_was_read_from_outside() -> None:
    outs = lone_worker_history(SOURCE_PY_SPY, ("_worker_loop", "hang_here"))
    stalls = [a for s in outs for a in s.alerts if a.kind == "stall"]  # type: ignore[attr-defined]
    assert stalls and stalls[-1].evidence["stack_taken"] == STACK_TAKEN[SOURCE_PY_SPY], stalls[-1:]
    assert STACK_TAKEN[SOURCE_PY_SPY] in stalls[-1].message


def test_a_stack_read_from_outside_never_holds_up_the_sampling_tick(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """py-spy takes ~0.1 s a read and gdb a second or more (up to its 15 s bound), once per worker
    forked before the agent: the read ran in the sampler's tick and held the whole sample up. It now
    runs on a thread of its own, and the stack comes with a later tick."""
    import threading

    from dlmon.collect import stacks
    from dlmon.collect.agent_client import AgentClient

    if shutil.which("py-spy") is None and (shutil.which("gdb") is None or sys.version_info >= (3, 14)):
        pytest.skip("neither py-spy nor gdb here")

    class NoStackFiles(AgentClient):  # the trainer's agent: its private directory has no <pid>.stack
        def stack_dir(self, pid: int) -> str | None:
            return str(tmp_path)

    sampling = threading.current_thread()
    release = threading.Event()
    readers: list[threading.Thread] = []
    from dlmon.collect.outside_stacks import read_stack as real_read

    def read_when_released(pid: int, prefer: str = "_worker_loop") -> object:
        readers.append(threading.current_thread())
        if threading.current_thread() is not sampling:
            release.wait(30)  # the tick must not wait for this
        return real_read(pid, prefer)

    monkeypatch.setattr(stacks, "read_stack", read_when_released)
    proc = hanging(sys.executable)
    try:
        probe = stacks.StallProbe(NoStackFiles())
        assert probe._worker_stacks([(os.getpid(), 0, proc.pid)]) == []
        assert probe.probe(None, []) == ()  # the read still waits: nothing yet, and no wait for it
        release.set()
        got: tuple[object, ...] = ()
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            time.sleep(0.1)
            got = probe.probe(None, [])
        assert readers and all(t is not sampling for t in readers), readers
        (stack,) = got
        assert stack.pid == proc.pid and stack.worker_id == 0  # type: ignore[attr-defined]
        assert "hang_here" in [f.function for f in stack.frames], stack  # type: ignore[attr-defined]
        assert probe.probe(None, []) == ()  # handed over once
    finally:
        release.set()
        proc.kill()
        proc.wait()


def test_a_read_asked_for_a_pid_taken_by_another_process_is_dropped(tmp_path: Path) -> None:
    """The read may come long after the ask (gdb reads of other workers first): by then the worker
    may be gone and its pid another process's, which must not be read (nor resumed) in its place."""
    import threading

    from dlmon.collect.outside_stacks import BackgroundReads
    from dlmon.collect.stacks import _outside_stack, _start_time

    proc = hanging(sys.executable)
    try:
        start = _start_time(proc.pid)
        assert start is not None
        assert _outside_stack(0, proc.pid, start + 1) is None
        gate = threading.Event()

        def read(wid: int, pid: int, st: int | None) -> tuple[int, int] | None:
            gate.wait(30)
            return (wid, pid) if st == start else None

        reads = BackgroundReads(read)
        reads.ask(0, proc.pid, start)
        reads.ask(0, proc.pid, start)  # asked again while it waits or runs: read once
        reads.ask(0, proc.pid, start + 1)  # another process by now
        gate.set()
        deadline = time.monotonic() + 30
        done: list[tuple[int, int]] = []
        while not done and time.monotonic() < deadline:
            time.sleep(0.02)
            done += reads.take()
        time.sleep(0.2)
        assert done + reads.take() == [(0, proc.pid)]
    finally:
        proc.kill()
        proc.wait()


def test_a_gdb_killed_at_its_bound_mid_attach_leaves_the_worker_running(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """gdb killed at its bound after its attach's SIGSTOP but before it took that stop in: the
    kernel hands the SIGSTOP back to the worker as the tracer dies, and the worker stops a moment
    later, after the check for a stopped worker had found it still running: a hung (or healthy)
    worker left stopped for good. The "gdb" here attaches and never waits, to be killed there."""
    from dlmon.collect import outside_stacks

    fake = tmp_path / "gdb"
    fake.write_text(
        f"#!{sys.executable}\nimport ctypes, sys, time\n"
        "pid = int(sys.argv[sys.argv.index('-p') + 1])\n"
        "assert ctypes.CDLL(None, use_errno=True).ptrace(16, pid, None, None) == 0  # PTRACE_ATTACH\n"
        "time.sleep(60)\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(outside_stacks, "GDB_TIMEOUT_S", 1.0)
    for _ in range(3):  # the stop came after the look at the worker in about a third of the tries
        proc = hanging(sys.executable)
        try:
            assert outside_stacks._py_bt(str(fake), "/nonexistent-gdb.py", proc.pid) is None
            time.sleep(0.5)  # the worker's own stop, had the SIGSTOP stayed with it
            with open(f"/proc/{proc.pid}/status") as fh:
                status = fh.read()
            assert "TracerPid:\t0" in status and "State:\tS" in status, status
        finally:
            os.kill(proc.pid, 18)  # SIGCONT, whatever happened
            proc.kill()
            proc.wait()


def test_a_reader_thread_that_could_not_start_is_started_at_the_next_ask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "can't start new thread" (a process at its thread limit) left the reader marked as running:
    no read was ever made again for that sampler."""
    import threading

    from dlmon.collect.outside_stacks import BackgroundReads

    real_start = threading.Thread.start
    refused: list[str] = []

    def start_once_refused(self: threading.Thread) -> None:
        if self.name == "dlmon-outside-stacks" and not refused:
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_refused)
    reads: BackgroundReads[int] = BackgroundReads(lambda wid, pid, start: pid)
    reads.ask(0, 101, 1)
    assert refused and reads.take() == []
    reads.ask(0, 101, 1)  # the same read, asked again at the next stall reading
    deadline = time.monotonic() + 30
    done: list[int] = []
    while not done and time.monotonic() < deadline:
        time.sleep(0.02)
        done += reads.take()
    assert done == [101]
