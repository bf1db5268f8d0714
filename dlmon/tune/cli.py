"""``dlmon tune`` behind the click command: options, the sweep, Ctrl-C, and the output."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType

from dlmon.tune.model import Result, fit_memory
from dlmon.tune.plan import Plan, PlanError, default_workers, parse_int_list, parse_pin, usable_cores
from dlmon.tune.report import (
    ReportError,
    atomic_write,
    check_writable,
    load_sweep,
    recommendation_lines,
    sweep_csv,
    sweep_json,
    table,
)
from dlmon.tune.runner import CannotRun, RunOptions, kill_live_trainings, run_config, still_left_running
from dlmon.tune.sweep import SweepAborted, plan_from_dict, plan_to_dict, run_sweep

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"dlmon tune: {line}", file=sys.stderr, flush=True)


def error(line: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        print(f"dlmon: error: {line}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _seconds(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise PlanError(f"{what} must be a positive number of seconds, not {text!r}")
    return value


def _plan(
    workers_text: str | None, batches_text: str | None, pin_text: str, prefetch_text: str | None
) -> Plan:
    return Plan(
        workers=parse_int_list(workers_text, "--workers", 0)
        if workers_text
        else default_workers(usable_cores()),
        batch_sizes=parse_int_list(batches_text, "--batch-sizes", 1) if batches_text else None,
        pin_memory=parse_pin(pin_text),
        prefetch_factors=parse_int_list(prefetch_text, "--prefetch-factor", 1) if prefetch_text else (None,),
    )


def _shown(command: Sequence[str]) -> str:
    return shlex.join(command)[:500]


def _confirm_resume(path: str, saved: Sequence[str], given: Sequence[str]) -> str | None:
    """None when the user agrees to run the command of the sweep file ``path`` (asked on a
    terminal); else why not. A sweep file is data anyone may hand over: the command it holds is
    run only once seen."""
    if given:
        what = f"{path} was measured with: {_shown(saved)}\nyou gave: {_shown(given)}"
        question = "mix results of the two commands?"
    else:
        what = f"{path} will run: {_shown(saved)}"
        question = "run it?"
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        return f"{what.replace(chr(10), '; ')}; pass --yes to go on (no terminal to ask)"
    say(what)
    try:
        print(f"dlmon tune: {question} [y/N] ", end="", file=sys.stderr, flush=True)
        answer = sys.stdin.readline().strip().lower()
    except (OSError, ValueError, KeyboardInterrupt):
        answer = ""
    return None if answer in ("y", "yes") else "not resumed"


PlotRenderer = Callable[[Sequence[Result]], str]


def print_outcome(results: Sequence[Result], plot: PlotRenderer | None) -> None:
    print(table(results))
    model = fit_memory(results)
    if model is not None:
        print(f"memory model: {model.describe()}")
    for line in recommendation_lines(results):
        print(line)
    if plot is not None:
        text = plot(results)
        if text:
            print(text)


def run_tune(
    command: list[str],
    workers_text: str | None,
    batches_text: str | None,
    pin_text: str,
    prefetch_text: str | None,
    seconds_text: str,
    batches_n: int | None,
    loader: str | None,
    warmup_text: str,
    force: bool,
    json_path: str | None,
    csv_path: str | None,
    resume_path: str | None,
    plot: PlotRenderer | None,
    loader_only: bool = False,
    yes: bool = False,
) -> int:
    prior: list[Result] = []
    try:
        seconds = None if batches_n else _seconds(seconds_text, "--seconds-per-config")
        warmup = _seconds(warmup_text, "--warmup-timeout")
        plan = _plan(workers_text, batches_text, pin_text, prefetch_text)
        if resume_path:
            saved_command, saved_plan, prior = load_sweep(resume_path)
            given = list(command)
            command = command or saved_command
            if not (workers_text or batches_text or prefetch_text or pin_text != "own"):
                try:
                    plan = plan_from_dict(saved_plan)
                except (KeyError, ValueError, TypeError) as exc:
                    raise ReportError(f"cannot resume from {resume_path}: bad plan: {exc}") from exc
            json_path = json_path or resume_path
            if command and given != saved_command and not yes:
                refusal = _confirm_resume(resume_path, saved_command, given)
                if refusal is not None:
                    return error(refusal)
            if command:
                say(f"resuming {resume_path}: {_shown(command)}")
        if not command:
            return error("no command to tune: dlmon tune [OPTIONS] -- CMD [ARGS]...")
        for path in (json_path, csv_path):
            if path and path != resume_path:
                check_writable(path)
    except (PlanError, ReportError) as exc:
        return error(str(exc))

    interrupted = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if interrupted.is_set() and signum == signal.SIGINT:
            kill_live_trainings()  # the user insists: no clean stop this time, and nothing left behind
            raise KeyboardInterrupt
        interrupted.set()
        say("stopping: the configuration in progress is dropped, what was measured is kept")

    def save(results: Sequence[Result], complete: bool) -> None:
        if json_path:
            atomic_write(json_path, sweep_json(command, plan_to_dict(plan), results, complete))

    opts = RunOptions(
        seconds=seconds, batches=batches_n, loader=loader, warmup_timeout_s=warmup, loader_only=loader_only
    )
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        window = f"{seconds:g} s" if seconds else f"{batches_n} batches"
        batches = len(plan.batch_sizes) if plan.batch_sizes else 3
        resuming = f"; resuming with {len(prior)} done" if prior else ""
        say(f"{len(plan.workers)} worker counts x {batches} batch sizes; {window} each{resuming}")
        end = run_sweep(
            plan,
            lambda c: run_config(command, c, opts, interrupted, say),
            prior,
            save,
            say,
            interrupted.is_set,
            force,
        )
    except SweepAborted as exc:
        return error(f"cannot tune {' '.join(command)[:80]}: {exc}")
    except CannotRun as exc:
        return error(str(exc))
    except ReportError as exc:
        return error(str(exc))
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    survivors = still_left_running()
    if survivors:
        from dlmon.launch.session import describe_left_behind

        say(f"the sweep's trainings {describe_left_behind(survivors)}")
    if loader_only:
        print("loader only: the DataLoader iterated without the training step (the input pipeline's ceiling)")
    print_outcome(end.results, plot)
    if csv_path:
        try:
            atomic_write(csv_path, sweep_csv(end.results))
        except ReportError as exc:
            return error(str(exc))
    if not end.complete:
        if json_path and os.path.isfile(json_path):
            say(
                f"interrupted: {len(end.results)} configuration(s) kept; continue with "
                f"dlmon tune --resume {json_path}"
            )
        elif end.results:
            say(
                f"interrupted: {len(end.results)} configuration(s) measured; none saved "
                "(give --json FILE to keep them and continue with --resume FILE)"
            )
        else:
            say("interrupted before any configuration finished: nothing to resume")
        return EXIT_INTERRUPTED
    return 0
