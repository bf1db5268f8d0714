"""The dashboard in a real terminal (tmux) on a real process tree: real pids, real memory, and a
clean exit that gives the terminal back to the shell."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from conftest import Spawn
from support.terminal import Tmux

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]

TREE = """
import ctypes, os, signal, sys
data = bytearray(48 * 1024 * 1024)
for i in range(0, len(data), 4096):
    data[i] = 1
libc = ctypes.CDLL(None)
for _ in range(2):
    if os.fork() == 0:
        libc.prctl(15, b"pt_data_worker", 0, 0, 0)
        private = bytearray(16 * 1024 * 1024)
        for i in range(0, len(private), 4096):
            private[i] = 1
        signal.pause()
        os._exit(0)
import time
time.sleep(0.5)
print("READY", flush=True)
signal.pause()
"""
LAUNCHER = (
    "from dlmon.ui import run_dashboard; from dlmon.flow.sources import LiveSource; "
    "run_dashboard(LiveSource({pid}))"
)


_SESSIONS = itertools.count()


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    t = Tmux(f"ui{next(_SESSIONS)}")  # a server per test: a dying one never refuses the next
    env = {**os.environ, "PS1": "$ ", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    subprocess.run(
        [
            "tmux",
            "-L",
            t.socket,
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            "120",
            "-y",
            "40",
            "bash --norc --noprofile",
        ],
        check=True,
        env=env,
    )
    yield t
    subprocess.run(["tmux", "-L", t.socket, "kill-server"], capture_output=True)


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as fh:
        return [int(p) for p in fh.read().split()]


def test_real_terminal_shows_the_tree_and_quits_cleanly(spawn: Spawn, tmux: Tmux) -> None:
    tree = spawn(TREE)
    workers = children(tree.pid)
    assert len(workers) == 2
    tmux("send-keys", "-t", "t", f"{sys.executable} -c '{LAUNCHER.format(pid=tree.pid)}'", "Enter")

    # each worker gets a row with its real pid and non-zero memory figures
    row = re.compile(rf"worker\s+\S+\s+{workers[1]}\s")
    screen = tmux.wait_for(row)
    screen = tmux.wait_for(re.compile(rf"worker\s+\S+\s+{workers[0]}\s"))
    for pid in workers:
        line = next(li for li in screen.splitlines() if re.search(rf"\s{pid}\s", li) and "worker" in li)
        sizes = re.findall(r"(\d+(?:\.\d+)?)([KMG])\b", line)
        assert sizes, line
        assert all(float(v) > 0 for v, _ in sizes), line
        assert any(unit == "M" and float(v) >= 16 for v, unit in sizes), line  # its 16 MiB + shared 48 MiB
    assert f"pid {tree.pid}" in screen and "dlmon" in screen
    # the wheel and clicks reach the dashboard: it asked the terminal for mouse reports
    assert tmux("display-message", "-p", "-t", "t", "#{mouse_any_flag}").strip() == "1"

    tmux("send-keys", "-t", "t", "q")
    tmux.wait_for(re.compile(r"\n\S*[#$]\s*\Z"), timeout=20)  # the shell's prompt is back, last
    tmux("send-keys", "-t", "t", "echo status=$?", "Enter")
    after = tmux.wait_for("status=0", timeout=10)
    assert "status=0" in after
    # the terminal is the shell's again: no alternate screen, no mouse reporting, a visible cursor
    flags = tmux(
        "display-message", "-p", "-t", "t", "#{alternate_on} #{mouse_any_flag} #{cursor_flag}"
    ).split()
    assert flags == ["0", "0", "1"], flags


@pytest.mark.parametrize("answer", ["Enter", "l"])
def test_dlmon_demo_quit_stops_the_synthetic_training_by_default(tmux: Tmux, answer: str) -> None:
    """The whole product in a real terminal: `dlmon demo` shows the demo's workers and its loader;
    q asks whether to stop the training; the default (Enter) ends the synthetic training, `l`
    leaves it running and says how to re-attach."""
    pytest.importorskip("torch")
    tmux("send-keys", "-t", "t", f"{sys.executable} -m dlmon demo --workers 2 --duration 120", "Enter")
    screen = tmux.wait_for(re.compile(r"worker\s+1\s+\d+"), timeout=60)  # ids come from the agent
    tmux.wait_for(re.compile(r"\d+\s*batch/s"), timeout=30)
    assert "dlmon.demo" in screen
    training_pid = int(re.findall(r"pid (\d+)", tmux.screen())[0])
    tmux("send-keys", "-t", "t", "q")
    tmux.wait_for(re.compile(r"(?i)stop the training \(enter\)"), timeout=10)
    tmux("send-keys", "-t", "t", answer)
    try:
        if answer == "Enter":
            tmux.wait_for(re.compile(r"\n\S*[#$]\s*\Z"), timeout=60)  # the prompt is back
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _alive(training_pid):
                time.sleep(0.2)
            assert not _alive(training_pid), "the demo training outlived dlmon"
            return
        after = tmux.wait_for(re.compile(r"dlmon attach (\d+)"), timeout=20)
        assert int(re.findall(r"dlmon attach (\d+)", after)[-1]) == training_pid
        time.sleep(1.0)
        assert _alive(training_pid), "the training died with the dashboard"
        assert len(children(training_pid)) == 2  # and its workers with it
    finally:
        if _alive(training_pid):
            os.killpg(training_pid, 9)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
