"""One watch, assembled in one place: the sampler (or a replay), the analyzer, the record file,
and the sinks that see every analysed snapshot (the Prometheus exporter, the alert log, stdout,
the dashboard).

Every command that watches builds its watch here from one :class:`WatchOptions`. The flow layer
imports no exporter and no UI: what lives above it (the Prometheus exporter in dlmon/export)
comes in as a *plug*, a callable started when the watch is assembled that returns a sink.

The steps are separate methods because each command takes them in its own order, and the order
is what the user sees on stderr (``dlmon run`` binds the metrics port before the training
starts; ``attach`` looks for the process first). :func:`open_watch` takes them in the usual one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

from dlmon.analysis import Analyzer
from dlmon.collect.gpu_sweep import GpuSource
from dlmon.collect.sampler import ExitCodeProvider, Sampler
from dlmon.flow.loop import Faults, Pipeline, sample_until_done, stop_on_signals
from dlmon.flow.recording import RecordWriter
from dlmon.flow.sources import LiveSource, ReplaySource
from dlmon.model import Snapshot

SnapshotSink = Callable[[Snapshot], None]
Plug = Callable[[], SnapshotSink]  # started when the watch is assembled (binds a port, says where)
Reporter = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class WatchOptions:
    """What a command asks of its watch."""

    interval: float = 1.0
    record_path: str | None = None
    #: ``dlmon record``: the file is the point; it must open, and a failed write stops the watch
    record_required: bool = False
    duration: float | None = None  # headless: stop after this many seconds
    plugs: tuple[Plug, ...] = ()  # sinks that start with the watch: the Prometheus exporter
    sinks: tuple[SnapshotSink, ...] = ()  # after the analysis and the record, in this order
    report: Reporter | None = None  # where dlmon's own failures are said as they happen (headless)


class Watch:
    """A watch being assembled, then run headless or handed to the dashboard as a source.

    Each snapshot goes: agent note, analyzer, record file, the plugs' sinks, the options' sinks,
    then the consumer (the dashboard) — see :class:`dlmon.flow.loop.Pipeline`.
    """

    def __init__(self, options: WatchOptions) -> None:
        self.options = options
        self.stop = threading.Event()
        on_record_failure = self.stop.set if options.record_required else None
        #: dlmon's own failures (failed ticks, a record that stopped): counted, never fatal
        self.faults = Faults(options.report, on_record_failure=on_record_failure)
        self.analyzer = Analyzer()
        self.sampler: Sampler | None = None
        self.exit_code: ExitCodeProvider | None = None
        self.writer: RecordWriter | None = None
        self.started: tuple[SnapshotSink, ...] | None = None  # the plugs' sinks, once started
        self._added: tuple[SnapshotSink, ...] = ()

    # ---- assembling (each step once, in the order the command needs) ------------------------
    def start_plugs(self) -> None:
        """Start the plugs (the exporter binds its port); a plug's failure propagates."""
        if self.started is None:
            self.started = tuple(plug() for plug in self.options.plugs)

    def open_sampler(
        self,
        pid: int,
        *,
        exit_code: ExitCodeProvider | None = None,
        unlimited_smaps: bool = False,
        gpu_source: GpuSource | None = None,
    ) -> Sampler:
        """The target's sampler (reading ``gpu_source``, a sweep shared with other watches, when
        given); raises what :class:`Sampler` raises (NoSuchProcess, PermissionError)."""
        self.sampler = Sampler(
            pid, exit_code=exit_code, unlimited_smaps=unlimited_smaps, gpu_source=gpu_source
        )
        self.exit_code = exit_code
        return self.sampler

    def open_record(self) -> RecordWriter | None:
        """The record file, opened once the target is known. A failure is one of the watch's
        faults, or (``record_required``) raised as the OSError."""
        path = self.options.record_path
        if not path:
            return None
        try:
            self.writer = RecordWriter(path)
        except OSError as exc:
            if self.options.record_required:
                raise
            self.faults.record_failed(path, exc)
        return self.writer

    def add_sinks(self, *sinks: SnapshotSink) -> None:
        """Sinks the command makes once the watch exists (what keeps the last frame, the
        processes seen): after the options' ones."""
        self._added += sinks

    @property
    def sinks(self) -> tuple[SnapshotSink, ...]:
        return (*(self.started or ()), *self.options.sinks, *self._added)

    def pipeline(self) -> Pipeline:
        return Pipeline(self.analyzer, self.writer, self.sinks, self.faults)

    # ---- running ----------------------------------------------------------------------------
    def run(self, *, on_signals: bool = True, target_alive: Callable[[], bool] | None = None) -> str:
        """Sample headless until the target ends (or the duration, or SIGINT/SIGTERM when
        ``on_signals``); the record gets its end line; returns why it stopped."""
        sampler = self.sampler
        assert sampler is not None, "open_sampler first"
        pipeline = self.pipeline()
        try:
            with stop_on_signals(self.stop) if on_signals else contextlib.nullcontext():
                reason = sample_until_done(
                    sampler,
                    self.options.interval,
                    pipeline,
                    self.stop,
                    duration=self.options.duration,
                    target_alive=target_alive,
                )
                pipeline.finish(reason)
        finally:
            sampler.close()
        return reason

    def finish_unwatched(self, reason: str) -> None:
        """The target could not be sampled at all: the record still ends with why."""
        self.pipeline().finish(reason)

    def live_source(self, *, log_path: str | None = None) -> LiveSource:
        """The dashboard's source: this watch, sampled on its own thread."""
        assert self.sampler is not None, "open_sampler first"
        return LiveSource(
            self.sampler.pid,
            self.options.interval,
            analyzer=self.analyzer,
            exit_code=self.exit_code,
            log_path=log_path,
            sampler=self.sampler,
            faults=self.faults,
            writer=self.writer,
            sinks=self.sinks,
        )

    def replay_source(self, path: str, speed: float | None) -> ReplaySource:
        """A record file played through this watch's analyzer (the verdicts of this dlmon);
        raises OSError for a file that cannot be read."""
        return ReplaySource(path, speed=speed, analyzer=self.analyzer)


def open_watch(pid: int, options: WatchOptions, *, unlimited_smaps: bool = False) -> Watch:
    """The usual order: the process first (nothing starts for one that is not there), then the
    plugs, then the record file."""
    watch = Watch(options)
    watch.open_sampler(pid, unlimited_smaps=unlimited_smaps)
    watch.start_plugs()
    watch.open_record()
    return watch


def record_notes(writer: RecordWriter | None, *, fifo: bool = True) -> list[str]:
    """What to tell the user about the record file just opened: a FIFO nobody reads yet (unless
    not ``fifo``: the headless watches have never said it), an existing record replaced."""
    notes = []
    if fifo and writer is not None and writer.waiting_for_reader:
        notes.append(f"{writer.path} is a FIFO nobody reads yet: lines are dropped until a reader opens it")
    if writer is not None and writer.replaced_bytes:
        notes.append(f"replacing the existing record {writer.path} ({writer.replaced_bytes} bytes)")
    return notes
