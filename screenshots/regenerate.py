"""Regenerate the screenshots: real `dlmon demo` runs (healthy and the copy-on-read leak) in tmux,
saved with the dashboard's own screenshot key (``s``).

Run from the repository root (the dashboard saves into ``screenshots/`` when it exists)::

    python screenshots/regenerate.py                 # ~4 minutes
    python screenshots/regenerate.py --seconds 30    # shorter runs, shorter charts

Writes ``demo-healthy-160x50.svg``, ``demo-healthy-80x24.svg``, ``demo-leak-160x50.svg`` and
``demo-leak-worker-detail.svg``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def tmux(socket: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True).stdout


def newest_svg(after: float) -> Path | None:
    found = [p for p in HERE.glob("dlmon-*.svg") if p.stat().st_mtime >= after]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def shoot(command: str, size: tuple[int, int], seconds: float, keys: list[str], name: str) -> None:
    """Run ``command`` (a dlmon dashboard) in tmux, wait, press ``keys``, save with ``s``, quit."""
    socket = f"dlmon-shots-{os.getpid()}-{Path(name).stem}"  # one server per shot: no reuse race
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    geometry = ["-x", str(size[0]), "-y", str(size[1])]
    subprocess.run(
        ["tmux", "-L", socket, "new-session", "-d", "-s", "s", *geometry, f"{command}; sleep 30"],
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
        for key in ("escape", "q", "Enter"):  # back to the overview, quit: the demo stops its training
            tmux(socket, "send-keys", "-t", "s", key)
            time.sleep(1.0)
        time.sleep(1.0)
        pids = re.findall(r"dlmon attach (\d+)", tmux(socket, "capture-pane", "-p", "-t", "s"))
        for pid in pids[-1:]:
            os.killpg(int(pid), signal.SIGKILL)  # a demo training still there (older dlmon left it running)
    finally:
        tmux(socket, "kill-server")
        # whatever the screen said, no demo training outlives its shot
        subprocess.run(["pkill", "-9", "-f", "dlmon.demo --scenario"], capture_output=True)


def demo(scenario: str) -> str:
    return f"{sys.executable} -m dlmon demo --scenario {scenario} --workers 4 --duration 900"


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--seconds", type=float, default=45.0, help="data to collect before each shot")
    parser.add_argument("--only", action="append", choices=["healthy", "leak"], help="one scenario only")
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        raise SystemExit("needs tmux")
    only = set(args.only or ["healthy", "leak"])
    if "healthy" in only:
        shoot(demo("healthy"), (160, 50), args.seconds, [], "demo-healthy-160x50.svg")
        shoot(demo("healthy"), (80, 24), args.seconds / 2, [], "demo-healthy-80x24.svg")
    if "leak" in only:  # long enough for the staircase to be called a leak
        shoot(demo("leak"), (160, 50), args.seconds * 2, [], "demo-leak-160x50.svg")
        shoot(demo("leak"), (160, 50), args.seconds, ["down", "down", "enter"], "demo-leak-worker-detail.svg")


if __name__ == "__main__":
    main()
