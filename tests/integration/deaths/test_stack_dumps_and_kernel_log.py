"""Second-reader regressions for the death/stall machinery that runs in the training process
and the collectors that read it (issue 9): each one failed before its fix."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlmon.collect import kernel, stacks
from dlmon.collect.agent_client import AgentClient
from dlmon.collect.kernel import KernelLog
from dlmon.collect.stacks import StallProbe
from support.agent import private_agent_env
from support.paths import ROOT, TESTS

OOM_LINE = (
    "6,1234,{usec},-;Out of memory: Killed process {pid} (python) total-vm:278712kB, "
    "anon-rss:65280kB, file-rss:6612kB, shmem-rss:0kB, UID:0 pgtables:196kB oom_score_adj:0\n"
)


def _append_record(path: Path, pid: int) -> None:
    usec = int(time.monotonic() * 1e6)
    with open(path, "a") as f:
        f.write(OOM_LINE.format(usec=usec, pid=pid))


def test_kernel_log_keeps_a_kill_of_a_job_pid_and_drops_one_of_a_reused_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pid the job used long ago may be another process's now: its OOM kill is not the job's.

    (Before: any pid ever seen in the tree, up to 8192 of them, counted as the job's for ever, and
    an OOM kill of an unrelated process that got a reused pid became a 'worker OOM-killed'.)"""
    kmsg = tmp_path / "kmsg"  # a regular file read one record per tick, like /dev/kmsg
    kmsg.write_text("")
    # a real process of the "job" that has ended: its pid is free for reuse
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(kernel, "SEEN_GRACE_S", 0.5, raising=False)
    log = KernelLog(str(kmsg))
    assert log.unavailable is None
    log.sample([os.getpid(), gone.pid])
    _append_record(kmsg, os.getpid())  # killed while in the tree: the job's
    events = log.sample([os.getpid()])
    assert [e.pid for e in events] == [os.getpid()]
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        log.sample([os.getpid()])
        time.sleep(0.1)
    _append_record(kmsg, gone.pid)  # long after it left the tree: someone else's process now
    events = log.sample([os.getpid()])
    assert gone.pid not in [e.pid for e in events], events
    log.close()


# -- the stack signal and the crash dump in workers -----------------------------------------------

SCRIPT = str(TESTS / "agent_scripts" / "rt_signal.py")


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    with private_agent_env("dlmon-deaths-agent-") as e:
        yield e


def _start(env: dict[str, str], cfg: dict[str, Any]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, json.dumps(cfg)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("@@ "):
            return proc, json.loads(line[3:])
    proc.kill()
    raise AssertionError(f"no pids line: {proc.communicate(timeout=30)[1][-2000:]}")


def _stop(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(OSError, ValueError):
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.close()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def test_a_program_that_handles_the_stack_signal_never_gets_it_from_dlmon(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The program's own SIGRTMIN+7 handler (a "checkpoint now", say) is the program's: dlmon must
    neither trigger it nor steal it. (Before: the worker chained faulthandler in front of it, wrote
    its stack file, and dlmon's stack request ran the program's handler in the worker.)"""
    marker = tmp_path / "marker"
    proc, got = _start(env, {"mode": "user_handler", "marker": str(marker)})
    try:
        client = AgentClient()
        deadline = time.monotonic() + 60
        while client.stack_dir(got["pid"]) is None and time.monotonic() < deadline:
            client.poll([got["pid"]])
            time.sleep(0.2)
        assert client.stack_dir(got["pid"]) is not None, "the trainer's agent never answered"
        probe = StallProbe(client)
        probe._worker_stacks([(got["pid"], wid, wpid) for wid, wpid in enumerate(got["workers"])])
        time.sleep(0.5)
        assert not marker.exists(), f"dlmon's stack signal ran the program's handler in {marker.read_text()}"
        for wpid in got["workers"]:
            os.kill(wpid, 0)  # alive
    finally:
        _stop(proc)


def test_the_stack_file_header_appears_only_once_the_handler_is_in_place(tmp_path: Path) -> None:
    """The header is dlmon's licence to send the signal, whose default action kills: written
    before faulthandler.register, a request in between would have killed the worker. Checked in a
    child process (a real fork, like a worker): at register time the file holds no header yet."""
    code = f"""
import faulthandler, os, sys
from dlmon.agent import _journal
_journal._dir = {str(tmp_path)!r}
path = os.path.join(_journal._dir, f"{{os.getpid()}}{{_journal.STACK_SUFFIX}}")
real = faulthandler.register
def register(*a, **k):
    with open(path) as f:
        if f.read():
            sys.exit(3)
    return real(*a, **k)
faulthandler.register = register
_journal.register_worker_stack_dump(0)
with open(path) as f:
    sys.exit(0 if f.read().startswith(_journal.STACK_HEADER) else 4)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DLMON_AGENT_DISABLE", None)
    rc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode
    assert rc == 0, {3: "the header was there before the handler", 4: "no header at all"}.get(rc, rc)


def test_a_stuck_workers_stack_file_stays_bounded_over_many_dumps(
    env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stuck for days gets a dump every 30 s: its file (in a tmpfs, often) must not grow
    without end, and each request must still give its stack. (Before: every dump was appended
    for the life of the worker.)"""
    monkeypatch.setattr(stacks, "MAX_STACK_FILE", 8 * 1024, raising=False)
    proc, got = _start(env, {"mode": "idle"})
    try:
        client = AgentClient()
        deadline = time.monotonic() + 60
        while client.stack_dir(got["pid"]) is None and time.monotonic() < deadline:
            client.poll([got["pid"]])
            time.sleep(0.2)
        d = client.stack_dir(got["pid"])
        assert d is not None, "the trainer's agent never answered"
        wpid = got["workers"][0]
        path = Path(d) / f"{wpid}.stack"
        probe = StallProbe(client)
        sizes = []
        for _ in range(40):
            took = probe._worker_stacks([(got["pid"], 0, wpid)])
            assert took and took[0].frames, "no stack from the worker"
            sizes.append(path.stat().st_size)
        one_dump = sizes[0]  # the header and one dump
        assert max(sizes) <= 8 * 1024 + 2 * one_dump, sizes
        assert path.read_text().startswith("dlmon-stack "), "the header survives the cut"
        os.kill(wpid, 0)
    finally:
        _stop(proc)
