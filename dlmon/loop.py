"""The headless sampling loop shared by ``attach`` (before the dashboard), ``record`` and
``run --headless``: ticks on a fixed monotonic schedule, stops cleanly on SIGINT/SIGTERM,
when the target exits, or after a duration."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from dlmon.collect.sampler import Sampler
from dlmon.model import Snapshot
from dlmon.recording import END_DURATION, END_INTERRUPTED, END_TARGET_EXITED


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` instead of raising mid-write."""

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


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
    while True:
        snapshot = sampler.sample()
        on_snapshot(snapshot)
        if not snapshot.target.alive:
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
