"""``dlmon run``: launch the training with the agent, watch it, exit with its code."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TextIO

from dlmon.analysis import events, format_event
from dlmon.analysis.verdict import exit_verdict
from dlmon.collect.procfs import (
    group_members,
    processes_with_environ,
    read_cmdline,
    read_stat,
)
from dlmon.flow.loop import handle_signals, pid_exists
from dlmon.flow.watch import Watch, record_notes
from dlmon.launch.runner import JOB_ENV, Training, exit_status, launch
from dlmon.model import Alert, Snapshot
from dlmon.model.format import DEAD_STATES

AlertPrinter = Callable[[Snapshot], None]
Reporter = Callable[[str], None]


class CannotStart(Exception):
    """The training could not be launched (bad command, no permission): nothing is running."""


def say(line: str) -> None:
    """One ``dlmon:`` line on stderr, never raising (stderr itself may be gone)."""
    with contextlib.suppress(OSError, ValueError):
        print(f"dlmon: {line}", file=sys.stderr, flush=True)


def marked_processes(token: str, exclude: int | None = None) -> list[tuple[int, str]]:
    """Live processes whose environment holds ``JOB_ENV=token``: everything a launch started,
    however it left the session or was re-parented (a daemon's double fork), unless it cleared
    its environment. Read once, at the end: one environ read per process of our user."""
    return processes_with_environ(f"{JOB_ENV}={token}".encode(), exclude)


class SeenProcesses:
    """A sink remembering every process the watch saw in the job's tree (pid and start time), so
    that one which left the tree (re-parented after its parent exited) is still named at the end."""

    LIMIT = 4096

    def __init__(self, training_pid: int) -> None:
        self._training = training_pid
        self.seen: dict[int, tuple[int | None, str]] = {}

    def __call__(self, snapshot: Snapshot) -> None:
        for p in snapshot.processes:
            if p.pid != self._training and p.pid not in self.seen and len(self.seen) < self.LIMIT:
                self.seen[p.pid] = (p.start_time, p.comm)

    def alive(self) -> list[tuple[int, str]]:
        out = []
        for pid, (start, comm) in self.seen.items():
            stat = read_stat(pid)
            if stat is None or stat.state in DEAD_STATES:
                continue
            if start is not None and stat.start_time != start:
                continue  # the pid was reused
            out.append((pid, read_cmdline(pid) or comm))
        return out


def left_behind(
    training_pid: int,
    last: Snapshot | None,
    token: str | None = None,
    seen: SeenProcesses | None = None,
) -> list[tuple[int, str]]:
    """Processes of the training still running after it ended: (pid, command line). Its process
    group, members of its tree that left the group (setsid) as the last snapshot saw them, any
    process the watch saw in the tree, and every process carrying the launch's token."""
    found = dict(group_members(training_pid))
    for p in last.processes if last is not None else ():
        if p.pid != training_pid and p.pid not in found and p.state not in DEAD_STATES and pid_exists(p.pid):
            found[p.pid] = read_cmdline(p.pid) or p.comm
    for pid, cmd in seen.alive() if seen is not None else ():
        found.setdefault(pid, cmd)
    for pid, cmd in marked_processes(token, exclude=training_pid) if token else ():
        found.setdefault(pid, cmd)
    found.pop(training_pid, None)
    found.pop(os.getpid(), None)
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
    watch: Watch,
    on_alerts: AlertPrinter | None = None,
    report: Reporter = say,
    started_note: str | None = None,
    lifeline: bool = False,
) -> int:
    """Launch ``command`` and sample it with ``watch`` (built from its options, plugs started)
    until it exits; returns its exit status.

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
        return _watch(training, watch, on_alerts, report)


def _watch(training: Training, watch: Watch, on_alerts: AlertPrinter | None, report: Reporter = say) -> int:
    last = LastSnapshot()
    seen = SeenProcesses(training.pid)
    watch.add_sinks(*((on_alerts, last, seen) if on_alerts else (last, seen)))
    watch.open_record()
    for note in record_notes(watch.writer, fifo=False):
        report(note)
    try:
        watch.open_sampler(training.pid, exit_code=training.exit_code)
    except Exception as exc:  # gone already, or /proc unreadable: still wait for the training
        report(f"cannot watch pid {training.pid}: {exc}; waiting for the training to end")
        watch.finish_unwatched("target_exited")
        return exit_status(training.popen.wait())
    watch.run(on_signals=False, target_alive=lambda: training.exit_code() is None)
    code = exit_status(training.popen.wait())
    leftovers = left_behind(training.pid, last.snapshot, training.job_token, seen)
    if leftovers:
        report(describe_left_behind(leftovers))
    summary = watch.faults.summary()
    if summary:
        report(summary)
    last.say_verdict(code)
    return code
