"""How ``dlmon demo``'s dashboard ends decides whether its training may outlive it: only the
user's "leave it running" releases the lifeline; a dashboard that ended any other way (the
terminal gone under it, an error: ``quit_by_user`` False) stops the demo's training."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from dlmon import cli, ui
from dlmon.launch.runner import launch
from dlmon.ui.result import DashboardResult
from support.agent import alive

TRAINING = """
import time
from dlmon.launch.lifeline import hold_from_env
assert hold_from_env()
while True:
    time.sleep(0.2)
"""


@pytest.mark.parametrize("quit_by_user", [False, True])
def test_only_the_user_leaves_the_demos_training_running(
    quit_by_user: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # logs and job notes of this test only
    script = tmp_path / "train.py"
    script.write_text(TRAINING)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    training = launch([sys.executable, str(script)], to_log=True, env=env, lifeline=True)

    def dashboard_ends(source: Any, **kw: Any) -> DashboardResult:
        source.stop()  # the one seam: the terminal's part, which cannot be made to fail here
        return DashboardResult(
            quit_by_user=quit_by_user, target_exited=False, exit_code=None, stop_training=False
        )

    monkeypatch.setattr(ui, "run_dashboard", dashboard_ends)
    try:
        cli._run_dashboard(training, 0.5, None, stop_by_default=True)
        assert alive(training.pid) == quit_by_user, training.log_path and Path(training.log_path).read_text()
    finally:
        if alive(training.pid):
            os.killpg(training.pid, 9)
            training.popen.wait()
