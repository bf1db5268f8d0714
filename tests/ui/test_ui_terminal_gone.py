"""The terminal goes away under a dashboard (an SSH drop, ``tmux kill-session``): ``dlmon demo``'s
synthetic training goes with it, a real training under ``dlmon run`` stays, and dlmon says in the
training's log and on the next dlmon command how to find it again."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.agent import alive

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]

GONE_WITHIN_S = 60.0  # generous: the demo's clean stop usually takes about a second


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def poll(predicate: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


class Session:
    """One tmux server running one command as its only pane, at 120x40."""

    def __init__(self, name: str, command: str, env: dict[str, str]) -> None:
        self.socket = f"dlmon-hup-{os.getpid()}-{name}"
        environ = {**os.environ, **env, "TERM": "xterm-256color"}
        environ.pop("NO_COLOR", None)
        geometry = ["-x", "120", "-y", "40"]
        subprocess.run(
            ["tmux", "-L", self.socket, "new-session", "-d", "-s", "t", *geometry, command],
            check=True,
            env=environ,
        )

    def screen(self) -> str:
        out = subprocess.run(
            ["tmux", "-L", self.socket, "capture-pane", "-p", "-t", "t"], capture_output=True, text=True
        )
        return out.stdout

    def wait_for(self, pattern: re.Pattern[str], timeout: float = 60.0) -> str:
        last = [""]

        def seen() -> bool:
            last[0] = self.screen()
            return pattern.search(last[0]) is not None

        if poll(seen, timeout):
            return last[0]
        raise AssertionError(f"never saw {pattern.pattern!r}:\n{last[0]}")

    def kill_session(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-session", "-t", "t"], capture_output=True)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.fixture
def private_tmp(tmp_path: Path) -> Iterator[dict[str, str]]:
    """dlmon's per-user directory (logs, job notes) of this test only: TMPDIR."""
    yield {"TMPDIR": str(tmp_path), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}


def dlmon(*args: str) -> str:
    return " ".join([sys.executable, "-m", "dlmon", *args])


def logs(tmp: dict[str, str]) -> list[Path]:
    return sorted(Path(tmp["TMPDIR"]).glob(f"dlmon-{os.getuid()}/logs/*.log"))


def test_closing_the_terminal_ends_the_demos_training(private_tmp: dict[str, str]) -> None:
    pytest.importorskip("torch")
    session = Session("demo", dlmon("demo", "--workers", "2", "--duration", "600"), private_tmp)
    training = 0
    workers: list[int] = []
    try:
        screen = session.wait_for(re.compile(r"worker\s+1\s+\d+"), timeout=90)
        training = int(re.findall(r"pid (\d+)", screen)[0])
        workers = children(training)
        assert len(workers) == 2
        session.kill_session()
        gone = poll(lambda: not any(alive(p) for p in (training, *workers)), GONE_WITHIN_S)
        assert gone, "the demo's training outlived its terminal"
        (log,) = logs(private_tmp)
        assert "the demo stops with it" in log.read_text()
    finally:
        session.close()
        if training and alive(training):
            os.killpg(training, signal.SIGKILL)


def test_the_demos_training_ends_when_dlmon_is_sigkilled(private_tmp: dict[str, str]) -> None:
    """Any death of dlmon, not only SIGHUP: the lifeline is the pipe, not a signal."""
    pytest.importorskip("torch")
    dl = subprocess.Popen(
        [sys.executable, "-m", "dlmon", "demo", "--headless", "--workers", "1", "--duration", "600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **private_tmp},
        text=True,
    )
    training = 0
    try:
        assert dl.stdout is not None
        assert "dlmon demo: scenario" in dl.stdout.readline()
        (training,) = children(dl.pid)
        assert poll(lambda: len(children(training)) == 1, 60), "the demo's worker never started"
        worker = children(training)[0]
        dl.kill()
        dl.wait()
        assert poll(lambda: not alive(training) and not alive(worker), GONE_WITHIN_S)
    finally:
        if training and alive(training):
            os.killpg(training, signal.SIGKILL)


TRAINING = """
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
while True:
    time.sleep(0.2)
"""


def test_closing_the_terminal_leaves_a_real_training_running_and_says_where(
    private_tmp: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINING)
    pid_file = tmp_path / "pid"
    session = Session("run", dlmon("run", str(script), str(pid_file)), private_tmp)
    training = 0
    try:
        session.wait_for(re.compile(r"pid \d+"), timeout=60)
        assert poll(pid_file.exists, 30)
        training = int(pid_file.read_text())
        session.kill_session()
        (log,) = logs(private_tmp)
        said = f"dlmon attach {training}"
        assert poll(lambda: said in log.read_text(), GONE_WITHIN_S), log.read_text()
        assert "the dashboard's terminal closed (SIGHUP)" in log.read_text()
        time.sleep(1.0)
        assert alive(training), "the training died with its dashboard"

        # the next dlmon command says it too, until the training is found again
        env = {**os.environ, **private_tmp}
        other = subprocess.run(
            [sys.executable, "-m", "dlmon", "attach", str(os.getpid()), "--once"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert f"pid {training} " in other.stderr and said in other.stderr, other.stderr
        again = subprocess.run(
            [sys.executable, "-m", "dlmon", "attach", str(training), "--once"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert again.returncode == 0 and said not in again.stderr, again.stderr
        after = subprocess.run(
            [sys.executable, "-m", "dlmon", "attach", str(os.getpid()), "--once"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert said not in after.stderr
    finally:
        session.close()
        if training and alive(training):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(training, signal.SIGKILL)


# ---- the Trend line on the real demo: the memory_growth rule's reading, not the warm-up -------------
def trend_line(screen: str) -> str:
    return next((line for line in screen.splitlines() if "Trend" in line), "")


@pytest.fixture(scope="module")
def trend_demos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Session]]:
    """The healthy and the leaking demo, started together: each test watches its own for about
    two minutes, and side by side the module waits for the longer watch, not the sum."""
    pytest.importorskip("torch")
    commands = {
        "healthy": dlmon("demo", "--workers", "2", "--duration", "600"),
        "leak": dlmon("demo", "--scenario", "leak", "--workers", "4", "--duration", "600"),
    }
    sessions: dict[str, Session] = {}
    try:
        for name, command in commands.items():
            env = {
                "TMPDIR": str(tmp_path_factory.mktemp(name)),
                "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
            }
            sessions[name] = Session(name, command, env)
        yield sessions
    finally:
        for session in sessions.values():
            session.close()


def test_the_healthy_demo_shows_no_trend_through_its_warm_up(trend_demos: dict[str, Session]) -> None:
    """The healthy demo's start-up (torch imports, the dataset, the workers) once read as
    "Trend PSS +152.3 MiB/min · limit in ~2h29m" after a minute."""
    session = trend_demos["healthy"]
    seen: list[str] = []
    session.wait_for(re.compile(r"worker\s+1\s+\d+"), timeout=90)
    up = re.compile(r"up (?:(\d+)m)?(\d+)s")
    elapsed = 0
    while elapsed < 135:  # past the rule's 2-minute warm-up
        screen = session.screen()
        line = trend_line(screen)
        found = up.search(screen)
        if found:
            elapsed = int(found.group(1) or 0) * 60 + int(found.group(2))
        if line:
            seen.append(line)
            assert "/min" not in line, line
        time.sleep(2.0)
    assert any("none yet (warm-up" in line for line in seen), seen
    assert "no growth" in seen[-1], seen[-1]


def test_the_leaking_demo_shows_its_trend(trend_demos: dict[str, Session]) -> None:
    screen = trend_demos["leak"].wait_for(re.compile(r"Trend\s+PSS \+\d+(?:\.\d+)? [KMG]iB/min"), timeout=300)
    line = trend_line(screen)
    assert "limit in ~" in line or "levels off below the limit" in line, line
