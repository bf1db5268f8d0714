"""The lifeline (dlmon/launch/lifeline.py) stops a training only when dlmon's end of a real pipe
closes: a stray ``$DLMON_LIFELINE_FD`` naming no pipe must neither stop nor crash the training."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import os, time
from dlmon.launch.lifeline import hold_from_env
held = hold_from_env(on_cut=lambda: print("cut", flush=True))
time.sleep(1.5)  # long enough for the watcher's read to have returned
print("alive", held, flush=True)
"""


def run_child(fd_text: str, pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DLMON_LIFELINE_FD": fd_text}
    return subprocess.run(
        [sys.executable, "-c", CHILD], env=env, pass_fds=pass_fds, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("target", ["/dev/null", "file"])
def test_an_fd_that_is_not_a_pipe_is_no_lifeline(target: str, tmp_path: Path) -> None:
    path = "/dev/null" if target == "/dev/null" else str(tmp_path / "empty")
    if target == "file":
        open(path, "w").close()
    fd = os.open(path, os.O_RDONLY)
    try:
        out = run_child(str(fd), (fd,))
    finally:
        os.close(fd)
    assert out.returncode == 0 and "cut" not in out.stdout, out.stdout + out.stderr
    assert "alive False" in out.stdout


def test_a_closed_fd_is_no_lifeline_and_no_traceback() -> None:
    out = run_child("987")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "alive False" in out.stdout


def test_a_pipe_whose_write_end_closes_stops_the_training() -> None:
    """The same child with a real lifeline: dlmon's end closes, the training stops."""
    read_end, write_end = os.pipe()
    os.close(write_end)
    try:
        out = run_child(str(read_end), (read_end,))
    finally:
        os.close(read_end)
    assert "cut" in out.stdout and "alive" not in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(
    "bad", [{"command": 5}, {"left_at": "noon"}, {"why": ["x"]}, {"log_path": 3}, {"watcher_pid": "1"}]
)
def test_a_badly_typed_job_note_is_dropped_not_a_traceback(
    bad: dict[str, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job note naming a live process (this one) whose fields are of the wrong type."""
    import json
    import tempfile

    from dlmon.launch import unwatched

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    me = os.getpid()
    note = {
        "pid": me,
        "started": unwatched.start_ticks(me),
        "command": "python train.py",
        "log_path": None,
        "watcher_pid": None,
        "watcher_started": None,
        "left_at": None,
        "why": "",
        **bad,
    }
    path = Path(unwatched.jobs_dir()) / f"{me}.json"
    path.write_text(json.dumps(note))
    assert unwatched.remind() == []
    assert not path.exists()
