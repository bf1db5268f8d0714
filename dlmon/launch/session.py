"""``dlmon run``: launch the training with the agent, watch it, exit with its code."""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TextIO

from dlmon.analysis import Analyzer, events, format_event
from dlmon.analysis.verdict import exit_verdict
from dlmon.collect.sampler import Sampler
from dlmon.flow.loop import Pipeline, handle_signals, sample_until_done
from dlmon.flow.recording import RecordWriter
from dlmon.launch.runner import Training, exit_status, launch
from dlmon.model import Alert, Snapshot

AlertPrinter = Callable[[Snapshot], None]


class AlertLog:
    """Headless: each alert raised, escalated or cleared, as lines on stderr when it happens."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._previous: tuple[Alert, ...] = ()
        self._stream = stream

    def __call__(self, snapshot: Snapshot) -> None:
        for event in events(self._previous, snapshot.alerts):
            print(
                f"dlmon: {format_event(event, at=snapshot.time)}", file=self._stream or sys.stderr, flush=True
            )
        self._previous = snapshot.alerts


class LastSnapshot:
    """A sink that keeps the last analysed snapshot, for the verdict at the end."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None

    def __call__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    @classmethod
    def of(cls, analyzer: Analyzer) -> LastSnapshot:
        """The analyzer's last snapshot with its alerts (the dashboard keeps no copy of its own)."""
        keeper = cls()
        history = analyzer.history()
        if history:
            keeper.snapshot = dataclasses.replace(history[-1], alerts=analyzer.alerts)
        return keeper

    def say_verdict(self, exit_code: int | None, stream: TextIO | None = None) -> None:
        try:
            line = exit_verdict(self.snapshot, exit_code)
        except Exception as exc:  # the training's own exit status matters more than our sentence
            line = f"training exited {exit_code} (no verdict: {type(exc).__name__}: {exc})"
        if line is not None:
            print(f"dlmon: {line}", file=stream or sys.stderr, flush=True)


def run_headless(
    command: list[str],
    interval: float,
    record_path: str | None,
    analyzer: Callable[[Snapshot], Snapshot] | None = None,
    on_alerts: AlertPrinter | None = None,
) -> int:
    """Launch ``command`` and sample until it exits; returns its exit status.

    Ctrl-C is forwarded (SIGINT, then SIGTERM, then SIGKILL) and sampling goes on until the
    training has really ended. The handlers go in before the launch, so a signal that arrives
    while dlmon starts up is queued and forwarded, not lost with dlmon.
    """
    training: Training | None = None
    pending: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if training is None:
            pending.append(signum)
        elif signum == signal.SIGINT:
            training.interrupt()
        else:
            training.popen.send_signal(signum)

    with handle_signals(forward, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        training = launch(command, to_log=False)  # OSError for a bad command: the caller says so
        for signum in pending:
            forward(signum, None)
        return _watch(training, interval, record_path, analyzer, on_alerts)


def _watch(
    training: Training,
    interval: float,
    record_path: str | None,
    analyzer: Callable[[Snapshot], Snapshot] | None,
    on_alerts: AlertPrinter | None,
) -> int:
    last = LastSnapshot()
    sinks = (on_alerts, last) if on_alerts else (last,)
    pipeline = Pipeline(analyzer, RecordWriter(record_path) if record_path else None, sinks)
    sampler = Sampler(training.pid, exit_code=training.exit_code)
    try:
        reason = sample_until_done(sampler, interval, pipeline, threading.Event())
    finally:
        sampler.close()
    pipeline.finish(reason)
    code = exit_status(training.popen.wait())
    last.say_verdict(code)
    return code
