"""What the watching commands (``attach``, ``record``, ``run``, ``demo``) share on the console: a
failure as one line, the ``dlmon:`` lines on stderr, the terminal check, and the dashboard as the
CLI hands it in (dlmon/ui is above this layer: the commands get it as a callable).

Light to import: ``dlmon --help`` loads nothing of the collectors through here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import click

if TYPE_CHECKING:
    from dlmon.collect.sampler import Sampler
    from dlmon.flow.loop import Faults
    from dlmon.flow.recording import RecordWriter
    from dlmon.flow.sources import Source
    from dlmon.flow.watch import Watch, WatchOptions

EXIT_USAGE = 2
EXIT_FAILURE = 1


class Failed(Exception):
    """The command cannot go on: one ``dlmon: error:`` line and this exit code (the CLI says it)."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def echo(line: str) -> None:
    """One ``dlmon:`` line on stderr, as the CLI writes them."""
    click.echo(f"dlmon: {line}", err=True)


class DashboardResult(Protocol):
    """How a dashboard session ended (dlmon.ui.result.DashboardResult)."""

    @property
    def quit_by_user(self) -> bool: ...

    @property
    def stop_training(self) -> bool: ...

    @property
    def screenshots(self) -> Sequence[str]: ...


class Dashboard(Protocol):
    """Runs the dashboard on ``source`` in this terminal until it closes (dlmon.ui.run_dashboard)."""

    def __call__(
        self,
        source: Source,
        *,
        interval: float | None = None,
        rank: int | None = None,
        ask_stop_on_quit: bool = False,
        stop_by_default: bool = False,
    ) -> DashboardResult: ...


def terminal_problem() -> str | None:
    """Why the dashboard cannot run here (nohup, cron, CI, a pipe, TERM=dumb), else None.

    Without this check Textual spins at 100% CPU writing escape codes nobody reads.
    """
    if not sys.stdout.isatty():
        return "stdout is not a terminal"
    if not sys.stdin.isatty():
        return "stdin is not a terminal"
    if not sys.stderr.isatty():  # Textual draws the dashboard on stderr: `2>log` would hide it
        return "stderr is not a terminal (the dashboard is drawn there)"
    if os.environ.get("TERM", "") in ("dumb", "unknown"):
        return f"TERM={os.environ['TERM']} cannot show a dashboard"
    return None


def open_sampler(
    pid: int, *, unlimited_smaps: bool = False, gpu_first_deadline_s: float | None = None
) -> Sampler:
    from dlmon.collect.gpu_sweep import FIRST_DEADLINE_S
    from dlmon.collect.sampler import NoSuchProcess, Sampler

    first = FIRST_DEADLINE_S if gpu_first_deadline_s is None else gpu_first_deadline_s
    try:
        return Sampler(pid, unlimited_smaps=unlimited_smaps, gpu_first_deadline_s=first)
    except NoSuchProcess:
        raise Failed(f"no such process: {pid}") from None
    except PermissionError as exc:
        raise Failed(f"cannot read process {pid}: {exc.strerror or exc}") from None


def watch_of(pid: int, options: WatchOptions, *, unlimited_smaps: bool = False) -> Watch:
    """A watch in the usual order (:func:`dlmon.flow.watch.open_watch`): the process, the plugs,
    the record file; :class:`Failed` for a process not there or a required record unwritable."""
    from dlmon.collect.sampler import NoSuchProcess
    from dlmon.flow.watch import Watch

    watch = Watch(options)
    try:
        watch.open_sampler(pid, unlimited_smaps=unlimited_smaps)
    except NoSuchProcess:
        raise Failed(f"no such process: {pid}") from None
    except PermissionError as exc:
        raise Failed(f"cannot read process {pid}: {exc.strerror or exc}") from None
    watch.start_plugs()
    try:
        watch.open_record()
    except OSError as exc:
        raise Failed(f"cannot write {options.record_path}: {exc.strerror or exc}") from None
    return watch


def say_record_opened(writer: RecordWriter | None) -> None:
    """A record opened for a dashboard or ``dlmon record``: a FIFO's wait, a record replaced."""
    from dlmon.flow.watch import record_notes

    for note in record_notes(writer):
        echo(note)


def report_faults(faults: Faults) -> None:
    """After the dashboard: what failed inside dlmon while it was shown (never silently)."""
    if faults.record_stopped:
        echo(f"recording stopped early: {faults.record_stopped}")
    summary = faults.summary()
    if summary:
        echo(summary)


def report_screenshots(result: DashboardResult) -> None:
    for path in result.screenshots:
        echo(f"screenshot saved: {path}")


def remind_unwatched(except_pid: int | None = None) -> None:
    """Trainings an earlier ``dlmon run`` left without a dashboard: say where they are."""
    from dlmon.launch.unwatched import remind

    for line in remind(except_pid):
        echo(line)
