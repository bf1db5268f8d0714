"""`dlmon run` and `dlmon demo` as a user runs them: real children, real signals, real exit codes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlmon.launch.runner import log_name
from support.agent import alive


def dlmon_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dlmon", *args]


def wait_for(predicate: object, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(("shell", "expected"), [("exit 0", 0), ("exit 3", 3), ("kill -9 $$", 128 + 9)])
def test_exit_status_is_the_trainings(shell: str, expected: int) -> None:
    result = subprocess.run(dlmon_cmd("run", "--headless", "--", "sh", "-c", shell), timeout=60)
    assert result.returncode == expected


def test_script_mode_uses_this_python_and_passes_output_and_args_through(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('args', sys.argv[1:], sys.executable)\nsys.exit(4)\n")
    result = subprocess.run(
        dlmon_cmd("run", "--headless", str(script), "--epochs", "3", "--", "x"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 4, result.stderr
    assert f"args ['--epochs', '3', '--', 'x'] {sys.executable}" in result.stdout


def test_the_agent_is_on_the_trainings_path(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text("import sys\nprint('agent' if 'dlmon.agent' in sys.modules else 'none')\n")
    result = subprocess.run(
        dlmon_cmd("run", "--headless", str(script)), capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "agent", result.stderr


@pytest.mark.parametrize(
    ("command", "name"),
    [
        ([sys.executable, "-m", "dlmon.demo", "--workers", "2"], "dlmon.demo"),
        ([sys.executable, "-u", "/data/train.py", "--epochs", "3"], "train.py"),
        (["/usr/bin/torchrun", "--nproc_per_node", "2", "train.py"], "torchrun"),
    ],
)
def test_log_files_are_named_after_what_runs(command: list[str], name: str) -> None:
    assert log_name(command) == name


def test_missing_script_and_missing_command_are_one_line_errors() -> None:
    for args in (["run", "/nonexistent/train.py"], ["run", "--headless", "--", "/nonexistent-cmd"]):
        result = subprocess.run(dlmon_cmd(*args), capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


INTERRUPTIBLE = """
import signal, sys, time
stubborn = len(sys.argv) > 1
if stubborn:
    signal.signal(signal.SIGINT, lambda *a: print("ignoring SIGINT", flush=True))
try:
    print("started", flush=True)
    time.sleep(120)
except KeyboardInterrupt:
    print("clean stop", flush=True)
    sys.exit(7)
"""


def start_headless(tmp_path: Path, *script_args: str) -> subprocess.Popen[str]:
    script = tmp_path / "train.py"
    script.write_text(INTERRUPTIBLE)
    proc = subprocess.Popen(
        dlmon_cmd("run", "--headless", "--interval", "0.2", str(script), *script_args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    return proc


def test_ctrl_c_is_forwarded_once_as_sigint(tmp_path: Path) -> None:
    proc = start_headless(tmp_path)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert "clean stop" in out, (proc.returncode, err)
    assert proc.returncode == 7, err  # the training's own exit status


def test_repeated_ctrl_c_escalates_to_sigterm(tmp_path: Path) -> None:
    proc = start_headless(tmp_path, "stubborn")
    proc.send_signal(signal.SIGINT)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ignoring SIGINT"
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM


def test_training_survives_dlmon_being_sigkilled(tmp_path: Path) -> None:
    marker = tmp_path / "still-training"
    script = tmp_path / "train.py"
    script.write_text(
        "import os, time\n"
        "print(os.getpid(), flush=True)\n"
        f"time.sleep(1.5)\nopen({str(marker)!r}, 'w').write('alive')\n"
    )
    dl = subprocess.Popen(
        dlmon_cmd("run", "--headless", str(script)),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert dl.stdout is not None
    training_pid = int(dl.stdout.readline())
    dl.kill()
    dl.wait()
    assert alive(training_pid)
    assert wait_for(marker.exists), "the training died with dlmon"


def test_headless_record_has_the_training_tree_and_its_exit_code(tmp_path: Path) -> None:
    out = tmp_path / "rec.jsonl"
    script = tmp_path / "train.py"
    script.write_text(
        "import os, subprocess, time\n"
        "child = subprocess.Popen(['sleep', '30'])\n"
        "time.sleep(1.2)\nchild.kill(); child.wait()\nraise SystemExit(5)\n"
    )
    result = subprocess.run(
        dlmon_cmd("run", "--headless", "--interval", "0.2", "--record", str(out), str(script)), timeout=60
    )
    assert result.returncode == 5
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[-1] == {**records[-1], "type": "end", "reason": "target_exited"}
    last = records[-2]
    assert last["target"]["alive"] is False and last["target"]["exit_code"] == 5
    assert any(len(r["processes"]) == 2 for r in records[:-1])  # the training and its child


@pytest.mark.slow
def test_demo_headless_runs_the_bundled_training(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "demo.jsonl"
    result = subprocess.run(
        dlmon_cmd(
            "demo",
            "--headless",
            "--workers",
            "2",
            "--duration",
            "4",
            "--interval",
            "0.5",
            "--record",
            str(out),
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "scenario healthy, 2 workers" in result.stdout
    snapshots = [json.loads(line) for line in out.read_text().splitlines()][:-1]
    assert max(sum(p["role"] == "worker" for p in s["processes"]) for s in snapshots) == 2


@pytest.mark.slow
def test_run_records_the_loaders_seen_from_inside(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(
        """
import time, torch
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __len__(self): return 10_000
    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.zeros(8)

loader = DataLoader(Slow(), batch_size=8, num_workers=2, persistent_workers=True)
end = time.monotonic() + 4
while time.monotonic() < end:
    for batch in loader:
        time.sleep(0.004)  # the "training step"
        if time.monotonic() >= end:
            break
"""
    )
    out = tmp_path / "rec.jsonl"
    result = subprocess.run(
        dlmon_cmd("run", "--headless", "--interval", "0.5", "--record", str(out), str(script)), timeout=120
    )
    assert result.returncode == 0
    snapshots = [json.loads(line) for line in out.read_text().splitlines()][:-1]
    with_loader = [s for s in snapshots if s["loaders"] and s["loaders"][0]["batches_per_s"]]
    assert len(with_loader) >= 3
    loader = with_loader[-1]["loaders"][0]
    assert loader["name"].endswith("train.py:11") and loader["num_workers"] == 2 and loader["batch_size"] == 8
    # two workers x 8 samples x 2 ms = 8 ms per batch in parallel vs 4 ms of step: input-bound
    assert 40 < loader["batches_per_s"] < 200
    assert 0.2 < loader["data_wait_fraction"] < 0.9
    workers = {p["pid"]: p for p in with_loader[-1]["processes"] if p["role"] == "worker"}
    assert set(workers) == set(loader["worker_pids"])
    assert sorted(p["worker_id"] for p in workers.values()) == [0, 1]


@pytest.mark.slow
def test_torchrun_ranks_each_show_up_with_their_own_workers(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "ddp.py"
    script.write_text(
        """
import os, time, torch, torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
dist.init_process_group("gloo")
data = TensorDataset(torch.zeros(100_000, 4))
loader = DataLoader(data, batch_size=16, num_workers=1, persistent_workers=True)
end = time.monotonic() + 7
while time.monotonic() < end:
    for (batch,) in loader:
        time.sleep(0.002)
        if time.monotonic() >= end:
            break
dist.destroy_process_group()
"""
    )
    out = tmp_path / "rec.jsonl"
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    cmd = dlmon_cmd("run", "--headless", "--interval", "0.25", "--record", str(out), "--")
    cmd += [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    cmd += [str(script)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    snapshots = [json.loads(line) for line in out.read_text().splitlines()][:-1]
    # both ranks' loaders, then their workers: a worker just forked is not named pt_data_worker yet
    best = max(
        snapshots, key=lambda s: (len(s["loaders"]), sum(p["role"] == "worker" for p in s["processes"]))
    )
    assert len(best["loaders"]) == 2
    rank_pids = {loader["pid"] for loader in best["loaders"]}
    assert len(rank_pids) == 2 and best["target"]["pid"] not in rank_pids  # torchrun is the target
    workers = [p for p in best["processes"] if p["role"] == "worker"]
    assert {p["ppid"] for p in workers} == rank_pids  # one worker under each rank
    assert all(p["worker_id"] == 0 for p in workers)
