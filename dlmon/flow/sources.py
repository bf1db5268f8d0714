"""Where snapshots come from: live attach, ``dlmon run`` (live plus the child's log), replay.

All three sit behind one small protocol and feed the same render path. A live source samples on
its own thread and keeps sampling (and recording) whatever the consumer does: a paused or busy
dashboard loses no data. No UI imports here.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from dlmon.collect.sampler import ExitCodeProvider, Sampler
from dlmon.flow.loop import Faults, Pipeline, sample_until_done
from dlmon.flow.recording import RecordWriter
from dlmon.flow.records import RecordEnd, RecordProblem, iter_records, read_lines_from
from dlmon.model import Snapshot, SnapshotStep

SnapshotSink = Callable[[Snapshot], None]
EndSink = Callable[[str], None]  # receives why the source ended (a recording END_* reason)

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


# ---- what some sources can do besides: declared, so a consumer asks isinstance(), not getattr()
@runtime_checkable
class Seekable(Protocol):
    """A source that can be moved through (a replay): the dashboard's ``,`` ``.`` and ``]``."""

    #: called (on the source's thread) before the first frame after a seek, with its time
    on_seek: Callable[[float], None] | None

    def seek(self, when: float) -> None:
        """Play from the first snapshot at or after ``when`` (Unix time)."""
        ...

    def next_alert(self) -> None:
        """Play from the next snapshot where an alert kind appears."""
        ...


@runtime_checkable
class HasFaults(Protocol):
    """A source that counts dlmon's own failures while it runs (a live watch)."""

    faults: Faults


@runtime_checkable
class Paced(Protocol):
    """A source sampled every ``interval`` seconds (a live watch; a replay keeps the record's)."""

    interval: float


class AgentLoader(Protocol):
    """Loads dlmon's agent into the watched job when the user asks (``dlmon attach`` of a job
    without one): made by dlmon/launch, which alone may load it."""

    @property
    def offer(self) -> str:
        """The one line that offers it: "press i to load the agent into pid 4242 (gdb; ~60 ms pause)"."""
        ...

    def load(self) -> str | None:
        """Load it (blocks for up to seconds; never on the UI thread): None once the agent serves,
        else the one line that says why not. Never raises."""
        ...


@runtime_checkable
class Injectable(Protocol):
    """A live watch whose job has no agent yet and could be given one (``agent_loader`` not None)."""

    agent_loader: AgentLoader | None


class LiveSource:
    """Samples a running process on a daemon thread, every ``interval`` seconds."""

    def __init__(
        self,
        pid: int,
        interval: float = 1.0,
        *,
        record_path: str | None = None,
        analyzer: SnapshotStep | None = None,
        exit_code: ExitCodeProvider | None = None,
        log_path: str | None = None,
        sampler: Sampler | None = None,
        faults: Faults | None = None,
        writer: RecordWriter | None = None,
        sinks: tuple[SnapshotSink, ...] = (),
    ) -> None:
        # Created here, not on the thread: "no such process" must surface before any UI starts.
        self.sampler = sampler or Sampler(pid, exit_code=exit_code)
        #: dlmon's own failures (failed ticks, a record that stopped): counted, never fatal.
        self.faults = faults or Faults()
        self.writer: RecordWriter | None = writer  # opened by the caller (dlmon.flow.watch), or:
        #: sinks that see each analysed snapshot before the consumer (the Prometheus exporter)
        self.sinks = sinks
        # opened once the target is known, so an error path never clobbers it
        if record_path and writer is None:
            try:
                self.writer = RecordWriter(record_path)
            except OSError as exc:
                self.faults.record_failed(record_path, exc)
        self._exit_code = exit_code
        self.interval = interval
        self.analyzer = analyzer
        self._log_path = log_path
        self.agent_loader: AgentLoader | None = None  # set by `dlmon attach` for a job without the agent
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
        pipeline = Pipeline(self.analyzer, self.writer, (*self.sinks, on_snapshot), self.faults)
        exit_code = self._exit_code

        def body() -> None:
            name_this_thread(b"dlmon-sampler")  # so top -H and the benchmarks can tell it apart
            try:
                reason = sample_until_done(
                    self.sampler,
                    self.interval,
                    pipeline,
                    self._stop,
                    target_alive=(lambda: exit_code() is None) if exit_code is not None else None,
                )
            finally:  # on its own thread, as it is used: its GPU sweep thread ends with it
                self.sampler.close()
            pipeline.finish(reason)
            on_end(reason)

        self._thread = threading.Thread(target=body, name="dlmon-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


@dataclass
class ReplayFile:
    """A record file read whole: its snapshots, why it ended, and what was wrong with it."""

    snapshots: list[Snapshot] = field(default_factory=list)
    end_reason: str | None = None
    problems: list[RecordProblem] = field(default_factory=list)


def read_record(path: str) -> ReplayFile:
    """Parse a record file. Corrupt or foreign lines are skipped and listed, never fatal:
    a recording cut short by a crash still replays up to its last whole line."""
    result = ReplayFile()
    for item in iter_records(path):
        if isinstance(item, RecordEnd):
            result.end_reason = item.reason
        elif isinstance(item, RecordProblem):
            result.problems.append(item)
        else:
            result.snapshots.append(item)
    return result


INDEX_EVERY = 64  # a byte offset every this many snapshots: seeking reads at most this many lines
MAX_PROBLEMS = 1000  # skipped lines remembered (the count goes on)
MAX_ALERT_MARKS = 10_000


@dataclass(frozen=True, slots=True)
class IndexMark:
    time: float
    offset: int  # byte offset of the line (in the decompressed stream for .gz)
    line: int


@dataclass(frozen=True, slots=True)
class _Line:
    offset: int
    line: int
    record: Snapshot | RecordEnd | RecordProblem


def _read_from(path: str, offset: int, line: int) -> Iterator[_Line]:
    """The records of ``path`` from a byte offset, with the offset of each (iter_records' rules)."""
    for at, number, record in read_lines_from(path, offset, line):
        yield _Line(at, number, record)


class ReplaySource:
    """Plays a record file through the same render path as live data, streaming it.

    ``speed`` 1.0 keeps the recorded pace, 10.0 is ten times faster, None delivers at once.
    One snapshot is in memory at a time: the first frame comes after one line is read, whatever
    the file's size. An index built while playing (a byte offset every :data:`INDEX_EVERY`
    snapshots, and where alerts appear) makes :meth:`seek` and :meth:`next_alert` read at most
    a few dozen lines to get back to a place already passed.
    """

    def __init__(self, path: str, speed: float | None = 1.0, analyzer: SnapshotStep | None = None) -> None:
        self.path = path
        self.speed = speed
        self.analyzer = analyzer
        self.problems: list[RecordProblem] = []
        self.problem_count = 0
        self.end_reason: str | None = None
        self.index: list[IndexMark] = []
        self.alert_marks: list[IndexMark] = []  # snapshots where an alert kind appeared
        self.snapshots_read = 0
        self.position: float | None = None  # time of the newest snapshot delivered
        self.on_seek: Callable[[float], None] | None = None  # called before the first frame after a seek
        self._request: tuple[str, float] | None = None
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.first: Snapshot | None = None
        self._seen_offset = -1  # the furthest line read so far: problems and marks counted once
        for item in _read_from(path, 0, 1):  # raises OSError for an unreadable file
            if isinstance(item.record, Snapshot):
                self.first = item.record
                break
            if isinstance(item.record, RecordProblem):
                self._problem(item.record)
            elif isinstance(item.record, RecordEnd):
                self.end_reason = item.record.reason

    @property
    def record(self) -> ReplayFile:
        """The whole file read at once (headless checks and tests; the dashboard never needs it)."""
        return read_record(self.path)

    @property
    def description(self) -> str:
        first = self.first
        target = f"{first.target.cmdline} (pid {first.target.pid})" if first else "empty"
        return f"replay of {self.path}: {target}"

    @property
    def log_path(self) -> str | None:
        return None

    @property
    def live(self) -> bool:
        return False

    # ---- control (any thread) -----------------------------------------------------------------
    def seek(self, when: float) -> None:
        """Play from the first snapshot at or after ``when`` (Unix time)."""
        with self._lock:
            self._request = ("seek", when)
        self._wake.set()

    def next_alert(self) -> None:
        """Play from the next snapshot (after the current one) where an alert kind appears."""
        with self._lock:
            self._request = ("alert", self.position if self.position is not None else -math.inf)
        self._wake.set()

    def _take_request(self) -> tuple[str, float] | None:
        with self._lock:
            request, self._request = self._request, None
        return request

    def _problem(self, problem: RecordProblem) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS and problem.line not in {p.line for p in self.problems[-8:]}:
            self.problems.append(problem)

    # ---- playing ------------------------------------------------------------------------------
    def _mark(self, at: _Line, snapshot: Snapshot, kinds: frozenset[str], previous: frozenset[str]) -> None:
        mark = IndexMark(snapshot.time, at.offset, at.line)
        if self.snapshots_read % INDEX_EVERY == 0 and (not self.index or mark.offset > self.index[-1].offset):
            self.index.append(mark)
        later = not self.alert_marks or mark.offset > self.alert_marks[-1].offset
        if kinds - previous and len(self.alert_marks) < MAX_ALERT_MARKS and later:
            self.alert_marks.append(mark)

    def _start_of(self, when: float) -> tuple[int, int]:
        """Where to read from to reach ``when``: the last indexed place at or before it."""
        best = (0, 1)
        for mark in self.index:
            if mark.time > when:
                break
            best = (mark.offset, mark.line)
        return best

    def start(self, on_snapshot: SnapshotSink, on_end: EndSink) -> None:
        def body() -> None:
            offset, line = 0, 1
            skip_before: float | None = None  # after a seek: read on, deliver nothing earlier
            want_alert_after: float | None = None
            sought = False
            while True:
                restart = False
                previous: float | None = None
                kinds: frozenset[str] = frozenset()
                for at in _read_from(self.path, offset, line):
                    if self._stop.is_set():
                        return
                    record = at.record
                    if isinstance(record, RecordEnd):
                        self.end_reason = record.reason
                        continue
                    first_time_here = at.offset > self._seen_offset
                    if first_time_here:
                        self._seen_offset = at.offset
                    if isinstance(record, RecordProblem):
                        if first_time_here:
                            self._problem(record)
                        continue
                    snapshot = record
                    now_kinds = frozenset(a.kind for a in snapshot.alerts)
                    if first_time_here:
                        self._mark(at, snapshot, now_kinds, kinds)
                        self.snapshots_read += 1
                    new_alert = bool(now_kinds - kinds)
                    kinds = now_kinds
                    if skip_before is not None and snapshot.time < skip_before:
                        continue
                    if want_alert_after is not None and (snapshot.time <= want_alert_after or not new_alert):
                        continue
                    skip_before = want_alert_after = None
                    if sought:
                        sought = False
                        previous = None
                        if self.on_seek is not None:
                            self.on_seek(snapshot.time)
                    if self.speed and previous is not None:
                        delay = max(0.0, snapshot.time - previous) / self.speed
                        delay = min(delay, threading.TIMEOUT_MAX)  # a gap of 1e300 s must not kill the thread
                        self._wake.clear()
                        # a request that came while this frame was read kept no wake: look first
                        if self._request is None and self._wait(delay) and self._stop.is_set():
                            return
                    request = self._take_request()
                    if request is not None:
                        kind, value = request
                        if kind == "seek":
                            offset, line = self._start_of(value)
                            skip_before = value
                        else:
                            mark = next((m for m in self.alert_marks if m.time > value), None)
                            offset, line = (mark.offset, mark.line) if mark else self._start_of(value)
                            want_alert_after = value
                        sought = True
                        restart = True
                        break
                    previous = snapshot.time
                    self.position = snapshot.time
                    on_snapshot(self.analyzer(snapshot) if self.analyzer else snapshot)
                if restart:
                    continue
                on_end(REPLAY_FINISHED)
                # the end: stay ready for a seek back until stopped
                while not self._stop.is_set():
                    self._wake.wait(0.5)
                    self._wake.clear()  # left set, the wait returns at once: a spin at full CPU
                    request = self._take_request()
                    if request is not None:
                        kind, value = request
                        if kind == "seek":
                            offset, line = self._start_of(value)
                            skip_before = value
                        else:
                            mark = next((m for m in self.alert_marks if m.time > value), None)
                            if mark is None:
                                continue
                            offset, line = mark.offset, mark.line
                            want_alert_after = value
                        sought = True
                        break
                if self._stop.is_set():
                    return

        self._seen_offset = -1
        self.problems.clear()  # found again, in order, while playing
        self.problem_count = 0
        self._thread = threading.Thread(target=body, name="dlmon-replay", daemon=True)
        self._thread.start()

    def _wait(self, delay: float) -> bool:
        """Sleep ``delay`` unless stopped or asked to seek; True when interrupted."""
        deadline = time.monotonic() + delay
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._wake.wait(min(left, 0.5)) or self._stop.is_set():
                return True

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


@dataclass(frozen=True, slots=True)
class RecordScan:
    """A record file read through once without keeping it: what ``dlmon replay`` says without a terminal."""

    snapshots: int
    problems: tuple[RecordProblem, ...]  # the first MAX_PROBLEMS
    problem_count: int


def scan_record(path: str) -> RecordScan:
    snapshots = 0
    problems: list[RecordProblem] = []
    count = 0
    for item in iter_records(path):
        if isinstance(item, RecordProblem):
            count += 1
            if len(problems) < MAX_PROBLEMS:
                problems.append(item)
        elif not isinstance(item, RecordEnd):
            snapshots += 1
    return RecordScan(snapshots, tuple(problems), count)


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
