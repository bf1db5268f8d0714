"""The tune agent inside a real training process: a malformed DLMON_TUNE never breaks the training."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dlmon.agent.sitecustomize_hook import env_with_agent

SCRIPT = """
import torch
from torch.utils.data import DataLoader, TensorDataset
loader = DataLoader(TensorDataset(torch.arange(20.0)), batch_size=4, num_workers=0)
sizes = [len(x) for (x,) in loader]
print("ran", loader.num_workers, loader.batch_size, sizes[0], flush=True)
"""


def run_script(tmp_path: Path, tune: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    env = env_with_agent()
    env["DLMON_TUNE"] = tune
    env["DLMON_TUNE_STATUS"] = str(tmp_path / "status.json")
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, env=env)


def test_a_well_formed_config_is_applied(tmp_path: Path) -> None:
    done = run_script(tmp_path, json.dumps({"num_workers": 1, "batch_size": 5}))
    assert done.returncode == 0, done.stderr
    assert "ran 1 5 5" in done.stdout


@pytest.mark.parametrize(
    "tune",
    [
        "[" * 100_000,  # json.loads raises RecursionError, not ValueError
        json.dumps({"num_workers": "2"}),
        json.dumps({"num_workers": -1}),
        json.dumps({"batch_size": 0}),
        json.dumps({"batch_size": "big"}),
        json.dumps({"prefetch_factor": -2, "num_workers": 1}),
    ],
    ids=["deep-json", "workers-str", "workers-neg", "batch-zero", "batch-str", "prefetch-neg"],
)
def test_a_malformed_config_leaves_the_training_running(tmp_path: Path, tune: str) -> None:
    done = run_script(tmp_path, tune)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ran" in done.stdout
