"""The headless sampling loop shared by ``attach`` (before the dashboard), ``record`` and
``run --headless``: ticks on a fixed monotonic schedule, stops cleanly on SIGINT/SIGTERM,
when the target exits, or after a duration."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from types import FrameType

from dlmon.collect.sampler import Sampler
from dlmon.flow.agent_note import AgentNote
from dlmon.flow.recording import (
    END_DURATION,
    END_INTERRUPTED,
    END_TARGET_EXITED,
    RecordWriter,
)
from dlmon.model import Snapshot
from dlmon.model.format import children_left

ORPHAN_WATCH_S = 15.0


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


def describe_error(exc: BaseException) -> str:
    """One line for an exception: its type and message, never a traceback."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Faults:
    """dlmon's own failures during a watch: counted, reported once, never fatal to the watch.

    ``report`` receives one line the first time something fails (headless: stderr); the
    counts stay readable for the dashboard and the record file's end line.
    """

    def __init__(
        self,
        report: Callable[[str], None] | None = None,
        on_record_failure: Callable[[], None] | None = None,
    ) -> None:
        self._report = report
        self._on_record_failure = on_record_failure
        self._lock = threading.Lock()
        self.failed_samples = 0
        self.first_failure: str | None = None
        self.last_failure: str | None = None
        self.record_stopped: str | None = None  # why the record file stopped early

    def say(self, line: str) -> None:
        """Pass one line to the user (headless: stderr); nothing when there is nowhere to say it."""
        if self._report is not None:
            self._report(line)

    def sample_failed(self, exc: BaseException) -> None:
        with self._lock:
            self.failed_samples += 1
            self.last_failure = describe_error(exc)
            first = self.first_failure is None
            if first:
                self.first_failure = self.last_failure
        if first and self._report is not None:
            self._report(
                f"a sample failed: {self.last_failure}; sampling goes on "
                "(failures are counted; the count is given at the end)"
            )

    def record_failed(self, path: str, exc: BaseException) -> None:
        self.record_stopped = f"cannot write {path}: {describe_error(exc)}"
        if self._on_record_failure is not None:  # the caller stops and says it, in one line
            self._on_record_failure()
            return
        if self._report is not None:
            self._report(
                f"recording stopped: {self.record_stopped}; the file holds whole lines up to there, "
                "and monitoring goes on"
            )

    def summary(self) -> str | None:
        """One line for the end of a watch, or None when nothing failed."""
        if not self.failed_samples:
            return None
        plural = "s" if self.failed_samples != 1 else ""
        return f"{self.failed_samples} sample{plural} failed during the watch (first: {self.first_failure})"

    def end_fields(self) -> dict[str, object]:
        """What the record file's end line notes about the failures (nothing when none)."""
        if not self.failed_samples:
            return {}
        return {"failed_samples": self.failed_samples, "first_failure": self.first_failure}


@dataclass
class Pipeline:
    """What happens to each snapshot after sampling, in every mode: the analyzer adds alerts, the
    record file gets the line, then the consumers (dashboard, stdout, alert log) see it.

    A record file that cannot be written (ENOSPC, EIO) is reported once through ``faults`` and
    closed: the consumers go on getting snapshots.
    """

    analyzer: Callable[[Snapshot], Snapshot] | None = None
    writer: RecordWriter | None = None
    sinks: tuple[Callable[[Snapshot], None], ...] = ()
    faults: Faults = field(default_factory=Faults)
    agent_note: Callable[[Snapshot], Snapshot] | None = None  # default: AgentNote, reporting via faults

    def __post_init__(self) -> None:
        if self.agent_note is None:
            self.agent_note = AgentNote(self.faults.say)

    def __call__(self, snapshot: Snapshot) -> None:
        if self.agent_note is not None:
            snapshot = self.agent_note(snapshot)
        if self.analyzer is not None:
            snapshot = self.analyzer(snapshot)
        if self.writer is not None:
            try:
                self.writer.write(snapshot)
            except OSError as exc:
                self._drop_writer(exc)
        for sink in self.sinks:
            sink(snapshot)

    def _drop_writer(self, exc: OSError) -> None:
        writer, self.writer = self.writer, None
        if writer is None:
            return
        with suppress(OSError):
            writer.close()
        self.faults.record_failed(writer.path, exc)

    def finish(self, reason: str) -> None:
        """The record file's last line says why it ended (and notes dlmon's own failures)."""
        if self.writer is not None:
            try:
                self.writer.end(reason, **self.faults.end_fields())
                self.writer.close()
            except OSError as exc:
                self._drop_writer(exc)
            self.writer = None


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sample_until_done(
    sampler: Sampler,
    interval: float,
    on_snapshot: Callable[[Snapshot], None],
    stop: threading.Event,
    duration: float | None = None,
    *,
    faults: Faults | None = None,
    target_alive: Callable[[], bool] | None = None,
) -> str:
    """Sample every ``interval`` seconds; returns why it stopped (a recording END_* reason).

    A tick that raises (an OSError reading /proc, a bug in a sink) is counted in ``faults``
    (default: ``on_snapshot``'s, when it is a :class:`Pipeline`) and sampling goes on; while
    ticks fail, ``target_alive`` (default: the pid still exists) decides when the target is gone.
    """
    if faults is None:
        faults = on_snapshot.faults if isinstance(on_snapshot, Pipeline) else Faults()
    alive = target_alive or (lambda: pid_exists(sampler.pid))
    start = time.monotonic()
    tick = 0
    target_gone_at: float | None = None
    while True:
        try:
            sampled = sampler.sample()
            on_snapshot(sampled)
            snapshot: Snapshot | None = sampled
        except Exception as exc:  # dlmon's own failure must not end the watch
            faults.sample_failed(exc)
            snapshot = None
        if snapshot is None:
            if not alive():
                return END_TARGET_EXITED
        elif not snapshot.target.alive:
            # Workers orphaned by a killed trainer linger for seconds, holding memory (and VRAM):
            # keep watching them, for a while, rather than stop at the moment they matter.
            now = time.monotonic()
            target_gone_at = target_gone_at or now
            if not children_left(snapshot) or now - target_gone_at >= ORPHAN_WATCH_S:
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
