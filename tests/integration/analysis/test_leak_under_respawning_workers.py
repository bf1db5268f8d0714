"""A leak in the trainer under workers respawned every epoch (benchmarks/soak.py's job): caught.

tests/faults/job.py with persistent_workers=False: its 2 DataLoader workers die and respawn every
epoch (~1-2 s), each new one forked from the trainer (its RssAnon counts the trainer's
copy-on-write pages whole) and gone before its PSS is read. The job's totals are a sawtooth, or
never complete, while the trainer keeps 4 MiB per epoch (~100-150 MiB/min). Before the trainer's
own RssAnon was a signal, no memory_growth was raised at all (the soak's 5-minute run, and 180 s
of this job). Both jobs run side by side, each watched by the real Sampler and a strict Analyzer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from conftest import Background
from dlmon.model import Alert
from faults.support import Job
from integration.analysis.test_analysis_scenarios import Watch

pytest.importorskip("torch")

MIB = 1024 * 1024
LEAK_FROM_S = 20.0  # job seconds after its start line
LEAK_MIB_PER_EPOCH = 4
CAUGHT_WITHIN_S = 90.0  # of the leak's start
SOAK_JOB: dict[str, Any] = {
    "workers": 2, "persistent": False, "epochs": 0, "batches": 40, "batch": 16, "sample_sleep_s": 0.004,
    "io_burst_every": 7, "io_burst_mb": 64,
}  # fmt: skip


def _started(job: Job, timeout: float = 120.0) -> float:
    """The job's start line's monotonic time (the same clock as ours: CLOCK_MONOTONIC)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = job.events.get(timeout=max(0.01, deadline - time.monotonic()))
        if ev["ev"] == "start":
            return float(ev["t"])
    raise AssertionError(f"the job did not start: {''.join(job.stderr)[-500:]}")


def _growth(w: Watch) -> list[Alert]:
    return [a for s in w.snapshots for a in s.alerts if a.kind == "memory_growth"]


@dataclass
class LeakRun:
    """Both jobs watched side by side, in a thread: started by the session (conftest) with the
    suite's first long window (test_analysis_scenarios.py's jobs), read by the test."""

    found: float | None = None
    leak_from: float = 0.0
    leaky_pid: int = 0
    ends: list[float] = field(default_factory=list)
    watches: list[Watch] = field(default_factory=list)
    error: BaseException | None = None
    thread: threading.Thread | None = None
    stopping: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        def body() -> None:
            try:
                self._watch()
            except BaseException as exc:  # re-raised in the test
                self.error = exc

        self.thread = threading.Thread(target=body, name="trainer-leak", daemon=True)
        self.thread.start()

    def result(self, timeout: float = 400.0) -> LeakRun:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"not over within {timeout} s"
        if self.error is not None:
            raise self.error
        return self

    def _watch(self) -> None:
        leak_cfg = {**SOAK_JOB, "leak_mb_per_epoch": LEAK_MIB_PER_EPOCH, "leak_from_s": LEAK_FROM_S}
        with Job(leak_cfg) as leaky, Job(SOAK_JOB) as quiet:
            self.leaky_pid = leaky.pid
            self.leak_from = _started(leaky) + LEAK_FROM_S
            _started(quiet)
            leaky.wait_batches(5)
            quiet.wait_batches(5)
            self.watches = [Watch(leaky.pid), Watch(quiet.pid)]
            try:
                deadline = self.leak_from + CAUGHT_WITHIN_S
                # both watched to the end, whenever it is caught (or the session is ending)
                while time.monotonic() < deadline and not self.stopping.is_set():
                    for w in self.watches:
                        w.tick()
                    if self.found is None and _growth(self.watches[0]):
                        self.found = time.monotonic()
            finally:
                for w in self.watches:
                    w.close()
            self.ends = _epoch_lines(leaky)


@pytest.mark.slow
def test_trainer_leak_under_respawning_workers_is_caught_and_the_churn_alone_is_not(
    trainer_leak_run: Background,
) -> None:
    leak_run: LeakRun = trainer_leak_run.get()
    run = leak_run.result()
    found, leak_from, ends, watches = run.found, run.leak_from, run.ends, run.watches
    assert found is not None, (
        f"no memory_growth within {CAUGHT_WITHIN_S:.0f} s of the trainer's leak "
        f"({len(ends)} epochs; alerts: {sorted(watches[0].kinds_seen())})"
    )
    alert = _growth(watches[0])[0]
    print(f"caught {found - leak_from:.1f} s after the leak's start: {alert.message}")  # pytest -s
    assert alert.evidence["cause"] == "main_process", alert.message
    assert alert.evidence["signal"] == "trainer RssAnon", alert.message
    assert "The trainer's anonymous memory" in alert.message, alert.message
    assert f"in the main (pid {run.leaky_pid})" in alert.message, alert.message
    assert "main (pid" in str(alert.evidence["top_process"])
    rate = alert.evidence["rate_bytes_per_s"]
    assert isinstance(rate, float)
    kept = [t for t in ends if leak_from <= t <= found]
    leaked_per_s = LEAK_MIB_PER_EPOCH * MIB * len(kept) / (found - leak_from)
    assert 0.5 * leaked_per_s <= rate <= 2.0 * leaked_per_s, (rate, leaked_per_s, alert.message)
    assert not _growth(watches[1]), [a.message for a in _growth(watches[1])][:1]
    assert watches[1].elapsed() >= watches[0].elapsed() - 5.0


def _epoch_lines(job: Job) -> list[float]:
    """The times of the job's epoch lines not read yet (each follows the end of the epoch before
    it, where the leak keeps its 4 MiB)."""
    times: list[float] = []
    while not job.events.empty():
        ev = job.events.get()
        if ev["ev"] == "epoch":
            times.append(float(ev["t"]))
    return times
