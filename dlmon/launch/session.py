"""``dlmon run``: launch the training with the agent, watch it, exit with its code."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TextIO

from dlmon.analysis import events, format_event
from dlmon.analysis.verdict import exit_verdict
from dlmon.collect.procfs import read_cmdline
from dlmon.collect.sampler import Sampler
from dlmon.flow.loop import Faults, Pipeline, handle_signals, pid_exists, sample_until_done
from dlmon.flow.recording import RecordWriter
from dlmon.launch.runner import Training, exit_status, launch
from dlmon.model import Alert, Snapshot

AlertPrinter = Callable[[Snapshot], None]
Reporter = Callable[[str], None]


class CannotStart(Exception):
    """The training could not be launched (bad command, no permission): nothing is running."""


def say(line: str) -> None:
    """One ``dlmon:`` line on stderr, never raising (stderr itself may be gone)."""
    with contextlib.suppress(OSError, ValueError):
        print(f"dlmon: {line}", file=sys.stderr, flush=True)


def open_writer(path: str | None, faults: Faults, report: Reporter = say) -> RecordWriter | None:
    """The record file, opened now that the target is known; a failure is reported, not fatal."""
    if not path:
        return None
    try:
        writer = RecordWriter(path)
    except OSError as exc:
        faults.record_failed(path, exc)
        return None
    if writer.replaced_bytes:
        report(f"replacing the existing record {path} ({writer.replaced_bytes} bytes)")
    return writer


def group_members(pgid: int) -> list[tuple[int, str]]:
    """Live processes of process group ``pgid`` (the training's: it runs in its own), from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            out.append((int(name), read_cmdline(int(name))))
    return out


def left_behind(training_pid: int, last: Snapshot | None) -> list[tuple[int, str]]:
    """Processes of the training still running after it ended: (pid, command line). Its process
    group, plus members of its tree that left the group (setsid) as the last snapshot saw them."""
    found = dict(group_members(training_pid))
    for p in last.processes if last is not None else ():
        if p.pid != training_pid and p.pid not in found and p.state not in ("Z", "X") and pid_exists(p.pid):
            found[p.pid] = read_cmdline(p.pid) or p.comm
    return sorted(found.items())


def describe_left_behind(procs: list[tuple[int, str]]) -> str:
    named = ", ".join(f"pid {pid} ({cmd[:60]})" for pid, cmd in procs[:8])
    more = f" and {len(procs) - 8} more" if len(procs) > 8 else ""
    pids = " ".join(str(pid) for pid, _ in procs)
    return f"left running after the training ended: {named}{more}; stop them with: kill {pids}"


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
    report: Reporter = say,
    started_note: str | None = None,
    lifeline: bool = False,
) -> int:
    """Launch ``command`` and sample until it exits; returns its exit status.

    ``lifeline`` (the demo): the training stops if dlmon goes away (see dlmon/launch/lifeline.py).

    ``started_note`` is reported once the training has started (e.g. why there is no dashboard).

    Raises :class:`CannotStart` only when the launch itself fails; once the training runs,
    dlmon's own failures (a record file on a full disk, a failing tick) are reported through
    ``report`` and the watch goes on until the training ends.

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
        try:
            training = launch(command, to_log=False, lifeline=lifeline)
        except OSError as exc:
            raise CannotStart(f"cannot start {command[0]}: {exc.strerror or exc}") from exc
        if started_note:
            report(started_note)
        for signum in pending:
            forward(signum, None)
        return _watch(training, interval, record_path, analyzer, on_alerts, report)


def _watch(
    training: Training,
    interval: float,
    record_path: str | None,
    analyzer: Callable[[Snapshot], Snapshot] | None,
    on_alerts: AlertPrinter | None,
    report: Reporter = say,
) -> int:
    faults = Faults(report)
    last = LastSnapshot()
    sinks = (on_alerts, last) if on_alerts else (last,)
    pipeline = Pipeline(analyzer, open_writer(record_path, faults, report), sinks, faults)
    try:
        sampler = Sampler(training.pid, exit_code=training.exit_code)
    except Exception as exc:  # gone already, or /proc unreadable: still wait for the training
        report(f"cannot watch pid {training.pid}: {exc}; waiting for the training to end")
        pipeline.finish("target_exited")
        return exit_status(training.popen.wait())
    try:
        reason = sample_until_done(
            sampler, interval, pipeline, threading.Event(), target_alive=lambda: training.exit_code() is None
        )
    finally:
        sampler.close()
    pipeline.finish(reason)
    code = exit_status(training.popen.wait())
    leftovers = left_behind(training.pid, last.snapshot)
    if leftovers:
        report(describe_left_behind(leftovers))
    summary = faults.summary()
    if summary:
        report(summary)
    last.say_verdict(code)
    return code
