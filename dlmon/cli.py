"""The ``dlmon`` command. Heavy modules are imported inside the commands so ``--help`` is fast."""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, NoReturn

import click

from dlmon import __version__

if TYPE_CHECKING:
    from dlmon.collect.sampler import Sampler
    from dlmon.flow.recording import RecordWriter
    from dlmon.launch.runner import Training
    from dlmon.model import Snapshot
    from dlmon.ui.result import DashboardResult

EXIT_USAGE = 2


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """One clear line on stderr and a non-zero exit: never a traceback for bad input."""
    click.echo(f"dlmon: error: {message}", err=True)
    sys.exit(code)


def parse_pid(text: str) -> int:
    try:
        pid = int(text, 10)
    except ValueError:
        fail(f"{text!r} is not a process id (a positive whole number)")
    if pid <= 0:
        fail(f"{text!r} is not a process id (a positive whole number)")
    return pid


def positive_seconds(text: str | float, what: str, *, allow_zero: bool = False) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        fail(f"{what} must be a number of seconds, not {text!r}")
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        lowest = "0 or more" if allow_zero else "more than 0"
        fail(f"{what} must be {lowest} seconds, not {text!r}")
    return value


def open_sampler(pid: int, *, unlimited_smaps: bool = False) -> Sampler:
    from dlmon.collect.sampler import NoSuchProcess, Sampler

    try:
        return Sampler(pid, unlimited_smaps=unlimited_smaps)
    except NoSuchProcess:
        fail(f"no such process: {pid}")
    except PermissionError as exc:
        fail(f"cannot read process {pid}: {exc.strerror or exc}")


def open_record(path: str) -> RecordWriter:
    from dlmon.flow.recording import RecordWriter

    try:
        return RecordWriter(path)
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror or exc}")


class _Group(click.Group):
    """Usage errors as one line (click prints four), and no traceback for a closed pipe."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        kwargs.setdefault("prog_name", "dlmon")
        try:
            result = super().main(*args, **kwargs)
        except click.UsageError as exc:
            hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx else ""
            fail(exc.format_message() + hint)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code)
        except click.Abort:
            sys.exit(130)
        except BrokenPipeError:  # `dlmon record ... | head`: the reader left; that is fine
            sys.stderr.close()
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dlmon")
def main() -> None:
    """A live monitor for PyTorch training jobs: true memory (PSS/USS) per DataLoader worker,
    shared memory, IO, GPU, and what is wrong."""


INTERVAL_HELP = "Seconds between samples (default 1)."


@main.command()
@click.argument("pid")
@click.option("--interval", default="1", metavar="S", help=INTERVAL_HELP)
@click.option(
    "--record", "record_path", metavar="FILE", help="Also write every snapshot to FILE (JSON lines)."
)
@click.option("--once", is_flag=True, help="Take two samples ~1 s apart (so rates exist), print one, exit.")
@click.option("--json", "as_json", is_flag=True, help="Print snapshots as JSON.")
@click.option("--inject", is_flag=True, help="Load the agent into PID first (Python 3.14+, sys.remote_exec).")
def attach(pid: str, interval: str, record_path: str | None, once: bool, as_json: bool, inject: bool) -> None:
    """Watch a running training process PID and all its descendants."""
    target = parse_pid(pid)
    seconds = positive_seconds(interval, "--interval")
    if inject:
        from dlmon.launch.inject import InjectError
        from dlmon.launch.inject import inject as inject_agent

        try:
            inject_agent(target)
        except InjectError as exc:
            fail(str(exc))
    if once:
        _attach_once(target, as_json)
        return
    if sys.stdout.isatty() and not as_json:
        sys.exit(_attach_dashboard(target, seconds, record_path))
    from dlmon.analysis import Analyzer
    from dlmon.flow.loop import Pipeline, sample_until_done, stop_on_signals
    from dlmon.flow.recording import END_TARGET_EXITED, encode_snapshot
    from dlmon.launch.session import AlertLog, LastSnapshot
    from dlmon.model.format import one_line

    sampler = open_sampler(target)

    def show(snapshot: Snapshot) -> None:
        sys.stdout.write(encode_snapshot(snapshot).decode() if as_json else one_line(snapshot) + "\n")
        sys.stdout.flush()

    writer = open_record(record_path) if record_path else None
    last = LastSnapshot()
    pipeline = Pipeline(Analyzer(), writer, (AlertLog(), show, last))
    stop = threading.Event()
    with stop_on_signals(stop):
        reason = sample_until_done(sampler, seconds, pipeline, stop)
        pipeline.finish(reason)
    sampler.close()
    if reason == END_TARGET_EXITED:
        last.say_verdict(None)


def _attach_dashboard(pid: int, interval: float, record_path: str | None) -> int:
    from dlmon.analysis import Analyzer
    from dlmon.collect.sampler import NoSuchProcess
    from dlmon.flow.sources import LiveSource
    from dlmon.ui import run_dashboard

    if record_path:
        open_record(record_path).close()
    try:
        source = LiveSource(pid, interval, record_path=record_path, analyzer=Analyzer())
    except NoSuchProcess:
        fail(f"no such process: {pid}")
    _report_screenshots(run_dashboard(source, interval=interval))
    return 0


def _report_screenshots(result: DashboardResult) -> None:
    for path in result.screenshots:
        click.echo(f"dlmon: screenshot saved: {path}", err=True)


def _attach_once(pid: int, as_json: bool) -> None:
    import time

    from dlmon.model.format import one_line
    from dlmon.model.serialize import snapshot_to_dict

    sampler = open_sampler(pid, unlimited_smaps=True)
    sampler.sample()
    time.sleep(1.0)
    snapshot = sampler.sample()
    sampler.close()
    if as_json:
        click.echo(json.dumps(snapshot_to_dict(snapshot), indent=2, allow_nan=False))
    else:
        click.echo(one_line(snapshot))


@main.command()
@click.argument("pid")
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    metavar="FILE",
    help="JSON-lines file to write (replaced if it exists).",
)
@click.option("--interval", default="1", metavar="S", help=INTERVAL_HELP)
@click.option(
    "--duration", default=None, metavar="S", help="Stop after S seconds (default: until the target exits)."
)
def record(pid: str, output: str, interval: str, duration: str | None) -> None:
    """Record snapshots of PID to FILE without a dashboard, one JSON object per line."""
    target = parse_pid(pid)
    seconds = positive_seconds(interval, "--interval")
    limit = positive_seconds(duration, "--duration") if duration is not None else None
    from dlmon.analysis import Analyzer
    from dlmon.flow.loop import Pipeline, sample_until_done, stop_on_signals
    from dlmon.flow.recording import END_TARGET_EXITED
    from dlmon.launch.session import AlertLog, LastSnapshot

    sampler = open_sampler(target)
    last = LastSnapshot()
    pipeline = Pipeline(Analyzer(), open_record(output), (AlertLog(), last))
    stop = threading.Event()
    with stop_on_signals(stop):
        reason = sample_until_done(sampler, seconds, pipeline, stop, duration=limit)
        pipeline.finish(reason)
    sampler.close()
    if reason == END_TARGET_EXITED:
        last.say_verdict(None)
    click.echo(f"dlmon: recorded to {output} ({reason.replace('_', ' ')})", err=True)


class _RunCommand(click.Command):
    """Remembers whether ``--`` came right before the command: ``run -- CMD`` vs ``run SCRIPT``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["dlmon.raw_args"] = list(args)
        return super().parse_args(ctx, args)


def _is_command_mode(ctx: click.Context, command: tuple[str, ...]) -> bool:
    raw: list[str] = ctx.meta.get("dlmon.raw_args", [])
    tail_start = len(raw) - len(command)
    return tail_start > 0 and raw[tail_start - 1] == "--"


RUN_SETTINGS = {"ignore_unknown_options": True, "allow_interspersed_args": False}


@main.command(cls=_RunCommand, context_settings=RUN_SETTINGS)
@click.option("--interval", default="1", metavar="S", help=INTERVAL_HELP)
@click.option(
    "--record", "record_path", metavar="FILE", help="Also write every snapshot to FILE (JSON lines)."
)
@click.option("--headless", is_flag=True, help="No dashboard: the training's output passes through.")
@click.argument(
    "command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="SCRIPT [ARGS]... | -- CMD [ARGS]..."
)
@click.pass_context
def run(
    ctx: click.Context, interval: str, record_path: str | None, headless: bool, command: tuple[str, ...]
) -> None:
    """Run a training script (with this Python) or any command, with the in-process agent, and watch it.

    \b
      dlmon run train.py --epochs 3
      dlmon run -- torchrun --nproc_per_node 2 train.py
    """
    from dlmon.launch.runner import command_for

    seconds = positive_seconds(interval, "--interval")
    is_command = _is_command_mode(ctx, command)
    if not is_command and not os.path.isfile(command[0]):
        fail(f"no such script: {command[0]} (to run a command, put it after --: dlmon run -- CMD)")
    sys.exit(_run_training(command_for(list(command), is_command), seconds, record_path, headless))


@main.command()
@click.option(
    "--scenario", type=click.Choice(["healthy", "leak", "io-bound", "slow-workers"]), default="healthy"
)
@click.option("--workers", default=4, type=click.IntRange(0, 256), help="DataLoader num_workers.")
@click.option("--batch-size", default=64, type=click.IntRange(1, 1 << 16))
@click.option(
    "--duration", default="0", metavar="S", help="Stop the demo after S seconds (0: run until stopped)."
)
@click.option("--interval", default="1", metavar="S", help=INTERVAL_HELP)
@click.option(
    "--record", "record_path", metavar="FILE", help="Also write every snapshot to FILE (JSON lines)."
)
@click.option("--headless", is_flag=True, help="No dashboard: the demo's output passes through.")
def demo(
    scenario: str,
    workers: int,
    batch_size: int,
    duration: str,
    interval: str,
    record_path: str | None,
    headless: bool,
) -> None:
    """A synthetic training (small model, generated data, DataLoader workers) under dlmon run.

    \b
    Scenarios: healthy, leak (copy-on-read growth of a Python-object dataset, pytorch#13246),
    io-bound (reads that hit the disk), slow-workers (CPU-heavy transforms).
    """
    import importlib.util

    seconds = positive_seconds(interval, "--interval")
    if importlib.util.find_spec("torch") is None:
        fail("dlmon demo needs PyTorch: pip install 'dlmon[demo]'")
    limit = positive_seconds(duration, "--duration", allow_zero=True)
    command = [sys.executable, "-m", "dlmon.demo", "--scenario", scenario, "--workers", str(workers)]
    command += ["--batch-size", str(batch_size), "--duration", str(limit)]
    sys.exit(_run_training(command, seconds, record_path, headless))


def _run_training(command: list[str], interval: float, record_path: str | None, headless: bool) -> int:
    from dlmon.launch.runner import launch

    if record_path:
        open_record(record_path).close()  # fail early, before the training starts
    try:
        if headless:
            from dlmon.analysis import Analyzer
            from dlmon.launch.session import AlertLog, run_headless

            return run_headless(command, interval, record_path, analyzer=Analyzer(), on_alerts=AlertLog())
        training = launch(command, to_log=True)
    except OSError as exc:
        fail(f"cannot start {command[0]}: {exc.strerror or exc}")
    return _run_dashboard(training, interval, record_path)


def _run_dashboard(training: Training, interval: float, record_path: str | None) -> int:
    from dlmon.flow.sources import LiveSource
    from dlmon.ui import run_dashboard

    click.echo(f"dlmon: training log: {training.log_path}", err=True)
    from dlmon.analysis import Analyzer
    from dlmon.launch.session import LastSnapshot

    analyzer = Analyzer()
    source = LiveSource(
        training.pid,
        interval,
        analyzer=analyzer,
        record_path=record_path,
        exit_code=training.exit_code,
        log_path=training.log_path,
    )
    result = run_dashboard(source, interval=interval, ask_stop_on_quit=True)
    _report_screenshots(result)
    code = training.exit_code()
    if code is not None:
        LastSnapshot.of(analyzer).say_verdict(code)
        return code
    if result.stop_training:
        click.echo("dlmon: stopping the training (SIGINT, then SIGTERM, then SIGKILL)...", err=True)
        return training.stop()
    click.echo(
        f"dlmon: the training goes on (pid {training.pid}); log: {training.log_path}\n"
        f"dlmon: watch it again with: dlmon attach {training.pid}",
        err=True,
    )
    return 0


@main.command()
@click.argument("pid")
@click.option("--seconds", default="5", metavar="S", help="How long to measure before advising (default 5).")
@click.option("--json", "as_json", is_flag=True, help="Print the advice as JSON.")
def advise(pid: str, seconds: str, as_json: bool) -> None:
    """Measure PID for a few seconds and advise on num_workers, batch size and memory.

    Uses the seed's rule, peak ~ (num_workers + 1) x batch_size x memory per sample, fed with
    measured per-worker memory and the real (cgroup-aware) headroom.
    """
    import time

    from dlmon.analysis import Analyzer, advice_to_dict, advise, format_advice

    target = parse_pid(pid)
    duration = positive_seconds(seconds, "--seconds")
    sampler = open_sampler(target, unlimited_smaps=True)
    analyzer = Analyzer()
    history = [analyzer(sampler.sample())]
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline and history[-1].target.alive:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        history.append(analyzer(sampler.sample()))
    sampler.close()
    result = advise(history)
    if as_json:
        click.echo(json.dumps(advice_to_dict(result), indent=2, allow_nan=False))
    else:
        click.echo(format_advice(result))


@main.command()
@click.argument("file")
@click.option(
    "--speed", default="1", metavar="X", help="Play X times faster than recorded (default 1; 0: all at once)."
)
def replay(file: str, speed: str) -> None:
    """Play a record file (from record, attach --record or run --record) in the dashboard."""
    from dlmon.analysis import Analyzer
    from dlmon.flow.sources import ReplaySource
    from dlmon.ui import run_dashboard

    factor = positive_seconds(speed, "--speed", allow_zero=True)
    try:
        source = ReplaySource(file, speed=factor or None, analyzer=Analyzer())  # verdicts of this dlmon
    except OSError as exc:
        fail(f"cannot read {file}: {exc.strerror or exc}")
    if not source.record.snapshots:
        problems = source.record.problems
        why = f" (line {problems[0].line}: {problems[0].reason})" if problems else ""
        fail(f"{file} holds no snapshots{why}")
    for problem in source.record.problems[:5]:
        click.echo(f"dlmon: skipping line {problem.line} of {file}: {problem.reason}", err=True)
    _report_screenshots(run_dashboard(source))
