"""The headless sampling loop shared by ``attach`` (before the dashboard), ``record`` and
``run --headless``: ticks on a fixed monotonic schedule, stops cleanly on SIGINT/SIGTERM,
when the target exits, or after a duration."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

from dlmon.collect.sampler import Sampler
from dlmon.flow.recording import END_DURATION, END_INTERRUPTED, END_TARGET_EXITED, RecordWriter
from dlmon.model import Snapshot

ORPHAN_WATCH_S = 15.0


def _orphans(snapshot: Snapshot) -> bool:
    return any(p.pid != snapshot.target.pid and p.state not in ("Z", "X") for p in snapshot.processes)


@contextmanager
def handle_signals(
    handler: Callable[[int, FrameType | None], None], *signals: signal.Signals
) -> Iterator[None]:
    """Install ``handler`` for ``signals`` for the duration of the block, then restore the old ones."""
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` instead of raising mid-write."""
    with handle_signals(lambda signum, frame: stop.set(), signal.SIGINT, signal.SIGTERM):
        yield


@dataclass
class Pipeline:
    """What happens to each snapshot after sampling, in every mode: the analyzer adds alerts, the
    record file gets the line, then the consumers (dashboard, stdout, alert log) see it."""

    analyzer: Callable[[Snapshot], Snapshot] | None = None
    writer: RecordWriter | None = None
    sinks: tuple[Callable[[Snapshot], None], ...] = ()

    def __call__(self, snapshot: Snapshot) -> None:
        if self.analyzer is not None:
            snapshot = self.analyzer(snapshot)
        if self.writer is not None:
            self.writer.write(snapshot)
        for sink in self.sinks:
            sink(snapshot)

    def finish(self, reason: str) -> None:
        """The record file's last line says why it ended."""
        if self.writer is not None:
            self.writer.end(reason)
            self.writer.close()
            self.writer = None


def sample_until_done(
    sampler: Sampler,
    interval: float,
    on_snapshot: Callable[[Snapshot], None],
    stop: threading.Event,
    duration: float | None = None,
) -> str:
    """Sample every ``interval`` seconds; returns why it stopped (a recording END_* reason)."""
    start = time.monotonic()
    tick = 0
    target_gone_at: float | None = None
    while True:
        snapshot = sampler.sample()
        on_snapshot(snapshot)
        if not snapshot.target.alive:
            # Workers orphaned by a killed trainer linger for seconds, holding memory (and VRAM):
            # keep watching them, for a while, rather than stop at the moment they matter.
            now = time.monotonic()
            target_gone_at = target_gone_at or now
            if not _orphans(snapshot) or now - target_gone_at >= ORPHAN_WATCH_S:
                return END_TARGET_EXITED
        tick += 1
        next_time = start + tick * interval
        now = time.monotonic()
        if next_time < now:  # we fell behind (a suspended terminal): skip, do not burst
            tick = int((now - start) / interval) + 1
            next_time = start + tick * interval
        if duration is not None and next_time - start > duration + 1e-9:
            return END_DURATION
        if stop.wait(max(0.0, next_time - now)):
            return END_INTERRUPTED
