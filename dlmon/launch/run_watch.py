"""``dlmon run`` and ``dlmon demo``: launch the training with the agent and watch it, in the
dashboard or headless; exit with its code.

The CLI parses and checks the arguments, then calls :func:`run_training`; the watch itself is
built by :mod:`dlmon.flow.watch`. Failures come back as :class:`~dlmon.launch.console.Failed`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import time
from collections.abc import Iterator
from types import FrameType

from dlmon.flow.watch import Plug, Watch, WatchOptions
from dlmon.launch import unwatched
from dlmon.launch.console import (
    Dashboard,
    Failed,
    echo,
    report_faults,
    report_screenshots,
    say_record_opened,
    terminal_problem,
)
from dlmon.launch.runner import LogDirError, Training, launch, note_in_log
from dlmon.launch.session import (
    AlertLog,
    CannotStart,
    LastSnapshot,
    describe_left_behind,
    left_behind,
    run_headless,
    say,
)


def run_training(
    command: list[str],
    interval: float,
    record_path: str | None,
    headless: bool,
    plugs: tuple[Plug, ...],
    dashboard: Dashboard,
    *,
    stop_by_default: bool = False,  # the demo: quitting ends the synthetic training unless told not to
    rank: int | None = None,
) -> int:
    """Launch ``command`` (the record path already checked) and watch it; its exit status."""
    no_terminal = None if headless else terminal_problem()
    report = say if headless or no_terminal else None  # headless: dlmon's failures said as they come
    watch = Watch(WatchOptions(interval, record_path, plugs=plugs, report=report))
    watch.start_plugs()  # a bad address fails before the training starts
    if headless or no_terminal:
        note = (
            f"{no_terminal}: running headless (the training's output passes through)" if no_terminal else None
        )
        try:
            return run_headless(
                command, watch, on_alerts=AlertLog(), started_note=note, lifeline=stop_by_default
            )
        except CannotStart as exc:
            raise Failed(str(exc)) from None
    try:
        training = launch(command, to_log=True, lifeline=stop_by_default)
    except LogDirError as exc:
        raise Failed(str(exc)) from None
    except OSError as exc:
        raise Failed(f"cannot start {command[0]}: {exc.strerror or exc}") from None
    return run_dashboard(training, watch, dashboard, stop_by_default=stop_by_default, rank=rank)


def run_dashboard(
    training: Training,
    watch: Watch,
    dashboard: Dashboard,
    *,
    stop_by_default: bool = False,
    rank: int | None = None,
) -> int:
    """The dashboard on the launched training; after it, the training's fate: stopped, ended
    (its exit status), or left running (0)."""
    echo(f"training log: {training.log_path}")
    last = LastSnapshot()  # the analysed final frame, for the verdict after the dashboard closes
    watch.add_sinks(last)
    watch.open_sampler(training.pid, exit_code=training.exit_code)
    watch.open_record()  # a failure is said after the dashboard (recording stopped early)
    source = watch.live_source(log_path=training.log_path)
    say_record_opened(source.writer)
    note = unwatched.note_launch(training.pid, shlex.join(training.command), training.log_path)
    interval = watch.options.interval
    with on_hangup(training, note):
        result = dashboard(
            source, interval=interval, ask_stop_on_quit=True, stop_by_default=stop_by_default, rank=rank
        )
    report_screenshots(result)
    report_faults(watch.faults)
    code = training.exit_code()
    if code is not None:
        unwatched.forget(training.pid)
        last.say_verdict(code)
        return after_exit(training, code, result.stop_training)
    # the demo's training is left running only when the user said so: a dashboard that ended
    # otherwise (the terminal gone under it, an error) must not release it to burn a core for ever
    demo_orphaned = training.lifeline is not None and not result.quit_by_user
    if result.stop_training or demo_orphaned:
        echo("stopping the training (SIGINT, then SIGTERM, then SIGKILL)...")
        code = training.stop()
        unwatched.forget(training.pid)
        return code
    training.release()  # the demo too: the user chose to leave it running
    if note is not None:
        unwatched.note_left(note, "you left it running" if result.quit_by_user else "the dashboard ended")
    note_goes_on(training, "the dashboard was closed")
    echo(
        f"the training goes on (pid {training.pid}); log: {training.log_path}\n"
        f"dlmon: watch it again with: dlmon attach {training.pid}"
    )
    return 0


def note_goes_on(training: Training, why: str) -> None:
    """In the training's log, where the user looks first: how to find the training again."""
    note_in_log(
        training.log_path,
        f"{why} at {time.strftime('%H:%M:%S')}; the training goes on: pid {training.pid} "
        f"({shlex.join(training.command)[:200]}); watch it again with: dlmon attach {training.pid}",
    )


@contextlib.contextmanager
def on_hangup(training: Training, note: unwatched.JobNote | None) -> Iterator[None]:
    """SIGHUP (the terminal or the SSH connection closed): the dashboard cannot go on. ``dlmon run``
    leaves the training running and says in its log (and its job note) how to find it again; the
    demo's training stops through its lifeline when dlmon is gone. Then dlmon dies of the SIGHUP,
    as before."""

    def hangup(signum: int, frame: FrameType | None) -> None:
        if training.lifeline is None and training.exit_code() is None:
            note_goes_on(training, "the dashboard's terminal closed (SIGHUP)")
            if note is not None:
                unwatched.note_left(note, "its terminal closed")
        elif training.lifeline is not None:
            unwatched.forget(training.pid)  # the demo's training stops with dlmon
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGHUP)

    previous = signal.signal(signal.SIGHUP, hangup)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def after_exit(training: Training, code: int, stop_leftovers: bool) -> int:
    """The training ended; its children may not have: stop them if asked, else name them."""
    if stop_leftovers:
        training.stop()
        return code
    leftovers = left_behind(training.pid, None, training.job_token)
    if leftovers:
        echo(describe_left_behind(leftovers))
    return code
