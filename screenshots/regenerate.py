"""Regenerate the screenshots: a real (healthy) CPU torch training with a 2-worker DataLoader,
watched by the dashboard in tmux, saved with the dashboard's own screenshot key (``s``).

Run from the repository root (the dashboard saves into ``screenshots/`` when it exists)::

    python screenshots/regenerate.py                 # ~2 minutes: 160x50 and 80x24
    python screenshots/regenerate.py --seconds 30    # shorter charts

Writes ``screenshots/attach-160x50.svg``, ``attach-80x24.svg`` and ``attach-worker-detail.svg``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRAINING = """
import dlmon.agent
dlmon.agent.start()
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

class Images(Dataset):
    def __init__(self):
        self.data = torch.randn(2048, 3, 64, 64)  # ~100 MB shared with the forked workers
        self.labels = torch.randint(0, 10, (2048,))
    def __len__(self):
        return len(self.data)
    def __getitem__(self, i):
        x = self.data[i]
        return torch.flip(x, dims=[2]) * 0.5 + 0.1, self.labels[i]

torch.set_num_threads(1)
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(Images(), batch_size=32, shuffle=True, num_workers=2, persistent_workers=True)
print("READY", flush=True)
while True:
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
"""
LAUNCHER = (
    "from dlmon.ui import run_dashboard; from dlmon.sources import LiveSource; "
    "run_dashboard(LiveSource({pid}))"
)


def tmux(socket: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True).stdout


def newest_svg(after: float) -> Path | None:
    found = [p for p in HERE.glob("dlmon-*.svg") if p.stat().st_mtime >= after]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def shoot(pid: int, size: tuple[int, int], seconds: float, keys: list[str], name: str) -> None:
    socket = f"dlmon-shots-{os.getpid()}"
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    command = f"exec {sys.executable} -c '{LAUNCHER.format(pid=pid)}'"
    geometry = ["-x", str(size[0]), "-y", str(size[1])]
    subprocess.run(
        ["tmux", "-L", socket, "new-session", "-d", "-s", "s", *geometry, command],
        check=True,
        env=env,
        cwd=ROOT,
    )
    try:
        time.sleep(seconds)
        for key in keys:
            tmux(socket, "send-keys", "-t", "s", key)
            time.sleep(1.5)
        started = time.time()
        tmux(socket, "send-keys", "-t", "s", "s")
        deadline = time.monotonic() + 10
        svg = None
        while svg is None and time.monotonic() < deadline:
            time.sleep(0.2)
            svg = newest_svg(started - 1)
        if svg is None:
            screen = tmux(socket, "capture-pane", "-p", "-t", "s")
            raise SystemExit(f"no screenshot appeared for {name}:\n{screen}")
        target = HERE / name
        svg.replace(target)
        print(f"wrote {target.relative_to(ROOT)}")
        tmux(socket, "send-keys", "-t", "s", "q")
        time.sleep(1)
    finally:
        tmux(socket, "kill-server")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--seconds", type=float, default=45.0, help="data to collect before each shot")
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        raise SystemExit("needs tmux")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(TRAINING)
        training = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True, cwd=tmp
        )
        try:
            assert training.stdout is not None
            if training.stdout.readline().strip() != "READY":
                raise SystemExit("the training did not start")
            time.sleep(3)  # let the workers start
            shoot(training.pid, (160, 50), args.seconds, [], "attach-160x50.svg")
            shoot(training.pid, (80, 24), args.seconds / 3, [], "attach-80x24.svg")
            shoot(training.pid, (160, 50), args.seconds / 3, ["down", "enter"], "attach-worker-detail.svg")
        finally:
            os.killpg(training.pid, signal.SIGKILL)
            training.wait()


if __name__ == "__main__":
    main()
