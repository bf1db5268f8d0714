"""What the fault tests share: a real training job that reports its own batches/s, dlmon record as a
child, process measurements, and generous waits (these tests run on loaded 2-core machines)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("job.py")


def env_with_dlmon(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(step)


class Job:
    """tests/faults/job.py as a child in its own process group; its ``@@`` events are collected."""

    def __init__(self, cfg: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.p = subprocess.Popen(
            [sys.executable, str(JOB), json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env or env_with_dlmon(),
            start_new_session=True,
        )
        self.pid = self.p.pid
        self.progress: list[tuple[float, int]] = []  # (monotonic, batches so far)
        self.epochs = 0
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._pump_err, daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if not line.startswith("@@ "):
                continue
            ev = json.loads(line[3:])
            if ev["ev"] == "progress":
                self.progress.append((ev["t"], ev["batches"]))
            elif ev["ev"] == "epoch":
                self.epochs = ev["epoch"]
            self.events.put(ev)

    def _pump_err(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.stderr.append(line)
            del self.stderr[:-50]

    def wait_batches(self, n: int, timeout: float = 120.0) -> None:
        why = f"{n} batches (stderr: {''.join(self.stderr)[-500:]})"
        wait_until(lambda: self.batches() >= n, timeout, why)

    def wait_epochs(self, n: int, timeout: float = 240.0) -> None:
        wait_until(lambda: self.epochs >= n or self.p.poll() is not None, timeout, f"epoch {n}")

    def batches(self) -> int:
        return self.progress[-1][1] if self.progress else 0

    def rate(self, t0: float, t1: float) -> float | None:
        """The job's own batches/s between two monotonic times (its progress lines)."""
        inside = [(t, b) for t, b in self.progress if t0 <= t <= t1]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def measure(self, seconds: float) -> float:
        t0 = time.monotonic()
        time.sleep(seconds)
        rate = self.rate(t0, time.monotonic())
        assert rate is not None, f"no progress from the job in {seconds}s: {''.join(self.stderr)[-500:]}"
        return rate

    def worker_pids(self) -> list[int]:
        return children_of(self.pid)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.p.wait()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def children_of(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out += [int(c) for c in fh.read().split()]
    return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        rest = fh.read().rsplit(b")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def dlmon_record(pid: int, path: Path, interval: float = 0.2, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``dlmon record PID -o PATH`` as a child; SIGINT at exit unless the test killed it already."""
    command = [sys.executable, "-m", "dlmon", "record", str(pid), "-o", str(path)]
    proc = subprocess.Popen(
        [*command, "--interval", str(interval), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_with_dlmon(),
    )
    try:
        yield proc
        if proc.poll() not in (None, 0, -signal.SIGKILL):
            raise AssertionError(f"dlmon record failed: {proc.stderr.read() if proc.stderr else ''}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def record_lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def tree_of_sleepers(n: int, comm: str = "pt_data_worker") -> str:
    """Python code for ``spawn``: a parent with ``n`` forked children named ``comm``, all asleep."""
    return f"""
        import ctypes, os, signal, time
        libc = ctypes.CDLL(None)
        for _ in range({n}):
            if os.fork() == 0:
                libc.prctl(15, {comm.encode()!r}, 0, 0, 0)
                signal.pause()
                os._exit(0)
        time.sleep(0.2)
        print("READY", flush=True)
        signal.pause()
    """
