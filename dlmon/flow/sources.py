"""Where snapshots come from: live attach, ``dlmon run`` (live plus the child's log), replay.

All three sit behind one small protocol and feed the same render path. A live source samples on
its own thread and keeps sampling (and recording) whatever the consumer does: a paused or busy
dashboard loses no data. No UI imports here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from dlmon.collect.sampler import ExitCodeProvider, Sampler
from dlmon.flow.loop import Faults, Pipeline, sample_until_done
from dlmon.flow.recording import RecordWriter
from dlmon.flow.records import RecordEnd, RecordProblem, iter_records
from dlmon.model import Snapshot

SnapshotSink = Callable[[Snapshot], None]
EndSink = Callable[[str], None]  # receives why the source ended (a recording END_* reason)
Analyzer = Callable[[Snapshot], Snapshot]  # adds alerts; dlmon.analysis provides the real one

REPLAY_FINISHED = "replay_finished"
PR_SET_NAME = 15


def name_this_thread(name: bytes) -> None:
    """The OS-level name of the calling thread (Linux; at most 15 bytes). Best effort."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Source(Protocol):
    """What the dashboard (or any consumer) needs from a stream of snapshots."""

    @property
    def description(self) -> str:
        """One line for the header: the command and pid, or the record file."""
        ...

    @property
    def log_path(self) -> str | None:
        """The training's output file (``dlmon run``), else None."""
        ...

    @property
    def live(self) -> bool: ...

    def start(self, on_snapshot: SnapshotSink, on_end: EndSink) -> None:
        """Begin delivering snapshots, from another thread; returns at once."""
        ...

    def stop(self) -> None:
        """Stop delivering; safe to call more than once."""
        ...


class LiveSource:
    """Samples a running process on a daemon thread, every ``interval`` seconds."""

    def __init__(
        self,
        pid: int,
        interval: float = 1.0,
        *,
        record_path: str | None = None,
        analyzer: Analyzer | None = None,
        exit_code: ExitCodeProvider | None = None,
        log_path: str | None = None,
        sampler: Sampler | None = None,
        faults: Faults | None = None,
    ) -> None:
        # Created here, not on the thread: "no such process" must surface before any UI starts.
        self.sampler = sampler or Sampler(pid, exit_code=exit_code)
        #: dlmon's own failures (failed ticks, a record that stopped): counted, never fatal.
        self.faults = faults or Faults()
        self.writer: RecordWriter | None = None
        if record_path:  # opened once the target is known, so an error path never clobbers it
            try:
                self.writer = RecordWriter(record_path)
            except OSError as exc:
                self.faults.record_failed(record_path, exc)
        self._exit_code = exit_code
        self.interval = interval
        self.analyzer = analyzer
        self._log_path = log_path
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        cmd = self.sampler.cmdline or f"pid {pid}"
        self._description = f"{cmd} (pid {pid})"

    @property
    def description(self) -> str:
        return self._description

    @property
    def log_path(self) -> str | None:
        return self._log_path

    @property
    def live(self) -> bool:
        return True

    def start(self, on_snapshot: SnapshotSink, on_end: EndSink) -> None:
        pipeline = Pipeline(self.analyzer, self.writer, (on_snapshot,), self.faults)
        exit_code = self._exit_code

        def body() -> None:
            name_this_thread(b"dlmon-sampler")  # so top -H and the benchmarks can tell it apart
            reason = sample_until_done(
                self.sampler,
                self.interval,
                pipeline,
                self._stop,
                target_alive=(lambda: exit_code() is None) if exit_code is not None else None,
            )
            pipeline.finish(reason)
            on_end(reason)

        self._thread = threading.Thread(target=body, name="dlmon-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


@dataclass(frozen=True, slots=True)
class ReplayProblem:
    line: int
    reason: str


@dataclass
class ReplayFile:
    """A record file read whole: its snapshots, why it ended, and what was wrong with it."""

    snapshots: list[Snapshot] = field(default_factory=list)
    end_reason: str | None = None
    problems: list[ReplayProblem] = field(default_factory=list)


def read_record(path: str) -> ReplayFile:
    """Parse a record file. Corrupt or foreign lines are skipped and listed, never fatal:
    a recording cut short by a crash still replays up to its last whole line."""
    result = ReplayFile()
    for item in iter_records(path):
        if isinstance(item, RecordEnd):
            result.end_reason = item.reason
        elif isinstance(item, RecordProblem):
            result.problems.append(ReplayProblem(item.line, item.reason))
        else:
            result.snapshots.append(item)
    return result


class ReplaySource:
    """Plays a record file through the same render path as live data.

    ``speed`` 1.0 keeps the recorded pace, 10.0 is ten times faster, None delivers at once.
    """

    def __init__(self, path: str, speed: float | None = 1.0, analyzer: Analyzer | None = None) -> None:
        self.path = path
        self.record = read_record(path)  # raises OSError for an unreadable file
        self.speed = speed
        self.analyzer = analyzer
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def description(self) -> str:
        first = self.record.snapshots[0] if self.record.snapshots else None
        target = f"{first.target.cmdline} (pid {first.target.pid})" if first else "empty"
        return f"replay of {self.path}: {target}"

    @property
    def log_path(self) -> str | None:
        return None

    @property
    def live(self) -> bool:
        return False

    def start(self, on_snapshot: SnapshotSink, on_end: EndSink) -> None:
        def body() -> None:
            previous: float | None = None
            for snapshot in self.record.snapshots:
                if self.speed and previous is not None:
                    delay = max(0.0, snapshot.time - previous) / self.speed
                    delay = min(delay, threading.TIMEOUT_MAX)  # a gap of 1e300 s must not kill the thread
                    if self._stop.wait(delay):
                        return
                elif self._stop.is_set():
                    return
                previous = snapshot.time
                on_snapshot(self.analyzer(snapshot) if self.analyzer else snapshot)
            on_end(REPLAY_FINISHED)

        self._thread = threading.Thread(target=body, name="dlmon-replay", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


def wait_for_end(source: Source, on_snapshot: SnapshotSink, timeout: float | None = None) -> str | None:
    """Run a source to its end on the caller's behalf (headless use and tests)."""
    ended: list[str] = []
    done = threading.Event()

    def on_end(reason: str) -> None:
        ended.append(reason)
        done.set()

    source.start(on_snapshot, on_end)
    deadline = None if timeout is None else time.monotonic() + timeout
    done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return ended[0] if ended else None
