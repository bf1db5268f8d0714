"""Shared by the export tests: start dlmon on a real DataLoader job, read what it printed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from support.paths import TESTS

LOADER_JOB = str(TESTS / "scenarios" / "loader_job.py")
PORT_LINE = re.compile(r"serving Prometheus metrics on http://(\S+?):(\d+)/metrics")


def dlmon_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dlmon", *args]


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, every: float = 0.1) -> Any:
    """The first truthy value of ``predicate`` within ``timeout`` seconds, else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """Kill ``proc``'s process group and every process below it: `dlmon run` starts the training
    in a session of its own, which a group kill alone would leave running."""
    tree = descendants(proc.pid) if proc.poll() is None else []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


@contextlib.contextmanager
def dlmon_serving(args: list[str], stderr_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """Start dlmon (own process group) with ``--prometheus 127.0.0.1:0`` among ``args``; yield it
    and the port it printed. Everything is killed at the end."""
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            dlmon_cmd(*args), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
    try:
        match = wait_for(lambda: PORT_LINE.search(stderr_path.read_text()), timeout=60)
        assert match, f"dlmon printed no metrics address: {stderr_path.read_text()!r}"
        yield proc, int(match.group(2))
    finally:
        kill_group(proc)


def parse_exposition(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] from the text format (enough for dlmon's output)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, rest = head.partition("{")
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))
        out.setdefault(name, []).append((labels, float(value)))
    return out


def read_snapshots(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("type") == "snapshot":
                records.append(record)
    return records


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc), children before grandchildren."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        children = [c for c, p in parents.items() if p == frontier[0]]
        frontier = frontier[1:] + children
        found += children
    return found
