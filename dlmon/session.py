"""``dlmon run``: launch the training with the agent, watch it, exit with its code."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

from dlmon.collect.sampler import Sampler
from dlmon.loop import sample_until_done
from dlmon.model import Snapshot
from dlmon.recording import RecordWriter
from dlmon.runner import Training, exit_status, launch

AlertPrinter = Callable[[Snapshot], None]


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

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        training = launch(command, to_log=False)  # OSError for a bad command: the caller says so
        for signum in pending:
            forward(signum, None)
        return _watch(training, interval, record_path, analyzer, on_alerts)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _watch(
    training: Training,
    interval: float,
    record_path: str | None,
    analyzer: Callable[[Snapshot], Snapshot] | None,
    on_alerts: AlertPrinter | None,
) -> int:
    writer = RecordWriter(record_path) if record_path else None
    sampler = Sampler(training.pid, exit_code=training.exit_code)

    def deliver(snapshot: Snapshot) -> None:
        if analyzer is not None:
            snapshot = analyzer(snapshot)
        if writer is not None:
            writer.write(snapshot)
        if on_alerts is not None:
            on_alerts(snapshot)

    try:
        reason = sample_until_done(sampler, interval, deliver, threading.Event())
    finally:
        sampler.close()
    if writer is not None:
        writer.end(reason)
        writer.close()
    return exit_status(training.popen.wait())
