"""``dlmon attach`` and ``dlmon record``: watch a process that is already running.

The CLI parses and checks the arguments, then calls one function here; the watch itself is
built by :mod:`dlmon.flow.watch`. Failures come back as :class:`~dlmon.launch.console.Failed`.
"""

from __future__ import annotations

import json
import sys
import time

import click

from dlmon.flow.agent_note import AgentNote
from dlmon.flow.recording import END_TARGET_EXITED, encode_snapshot
from dlmon.flow.watch import Plug, Watch, WatchOptions, record_notes
from dlmon.launch.console import (
    EXIT_FAILURE,
    Dashboard,
    Failed,
    echo,
    open_sampler,
    report_faults,
    report_screenshots,
    say_record_opened,
    terminal_problem,
    watch_of,
)
from dlmon.launch.session import AlertLog, LastSnapshot, say
from dlmon.model import Snapshot


def attach(
    target: int,
    interval: float,
    record_path: str | None,
    *,
    once: bool,
    as_json: bool,
    inject: bool | None,
    plugs: tuple[Plug, ...],
    rank: int | None,
    dashboard: Dashboard,
) -> int:
    """Watch ``target`` (its arguments checked): the dashboard in a terminal, else a line (or a
    JSON object) per sample on stdout; ``once``: one sample, printed.

    ``inject``: True loads the agent first; None offers it on the dashboard of a job without one
    ("press i"); False never does. A load that fails says why in one line and the watch goes on
    with the outside figures (the dashboard offers to try again)."""
    failed: str | None = None
    if inject:
        from dlmon.launch.agent_offer import load_first

        failed = load_first(target)
    if once:
        attach_once(target, as_json)
        return 0
    no_terminal = terminal_problem()
    if not no_terminal and not as_json:
        offer = inject is None or failed is not None
        return attach_dashboard(
            target, interval, record_path, plugs, rank, dashboard, offer=offer, failed=failed
        )
    if sys.stdout.isatty() and not as_json:  # a terminal that cannot show the dashboard
        echo(f"{no_terminal}: printing one line per sample instead")
    from dlmon.model.format import one_line

    output_error: list[OSError] = []
    watching: list[Watch] = []  # the watch, once built: a failed write to stdout stops it

    def show(snapshot: Snapshot) -> None:
        try:
            sys.stdout.write(encode_snapshot(snapshot).decode() if as_json else one_line(snapshot) + "\n")
            sys.stdout.flush()
        except OSError as exc:  # stdout is the point of this mode: stop on a full disk
            output_error.append(exc)
            watching[0].stop.set()

    last = LastSnapshot()
    options = WatchOptions(interval, record_path, plugs=plugs, sinks=(AlertLog(), show, last), report=say)
    watch = watch_of(target, options)
    watching.append(watch)
    for note in record_notes(watch.writer, fifo=False):
        say(note)
    reason = watch.run()
    if reason == END_TARGET_EXITED:
        last.say_verdict(None)
    if output_error:
        raise output_error[0]
    return 0


def attach_dashboard(
    pid: int,
    interval: float,
    record_path: str | None,
    plugs: tuple[Plug, ...],
    rank: int | None,
    dashboard: Dashboard,
    *,
    offer: bool = False,
    failed: str | None = None,
) -> int:
    from dlmon.collect.sampler import NoSuchProcess

    # the record path was checked by the CLI, symlinks and non-records included
    watch = Watch(WatchOptions(interval, record_path, plugs=plugs))
    watch.start_plugs()
    try:
        watch.open_sampler(pid)
    except NoSuchProcess:
        raise Failed(f"no such process: {pid}") from None
    watch.open_record()  # a failure is said after the dashboard (recording stopped early)
    source = watch.live_source()
    if offer:  # the outside figures at once; the agent on request
        from dlmon.launch.agent_offer import offer_for

        source.agent_loader = offer_for(pid, failed)
    say_record_opened(source.writer)
    report_screenshots(dashboard(source, interval=interval, rank=rank))
    report_faults(watch.faults)
    return 0


#: How long the one-shot attach waits for NVML's start (``nvmlInit`` takes seconds without
#: persistence mode).
ONE_SHOT_GPU_DEADLINE_S = 10.0


def attach_once(pid: int, as_json: bool) -> None:
    from dlmon.model.format import one_line
    from dlmon.model.serialize import snapshot_to_dict

    # Its one reading is the whole output: it waits longer for NVML's start than a watch does.
    sampler = open_sampler(pid, unlimited_smaps=True, gpu_first_deadline_s=ONE_SHOT_GPU_DEADLINE_S)
    sampler.sample()
    time.sleep(1.0)
    snapshot = sampler.sample()
    sampler.close()
    # why there are no DataLoader figures when the agent cannot be reached (a container out of
    # reach, an unsafe socket directory): on stderr and in the snapshot, as a watch says it
    snapshot = AgentNote(say)(snapshot)
    if as_json:
        click.echo(json.dumps(snapshot_to_dict(snapshot), indent=2, allow_nan=False))
    else:
        click.echo(one_line(snapshot))


def record(target: int, output: str, interval: float, duration: float | None, *, inject: bool = False) -> int:
    """Record ``target`` to ``output`` (checked) until it exits, the duration, or Ctrl-C;
    ``inject``: load the agent into it first."""
    if inject:
        from dlmon.launch.agent_offer import load_first

        load_first(target)
    last = LastSnapshot()
    options = WatchOptions(
        interval, output, record_required=True, duration=duration, sinks=(AlertLog(), last), report=say
    )
    watch = watch_of(target, options)
    say_record_opened(watch.writer)
    reason = watch.run()
    faults = watch.faults
    if reason == END_TARGET_EXITED:
        last.say_verdict(None)
    if faults.record_stopped:
        raise Failed(
            f"recording stopped: {faults.record_stopped} (whole lines up to there are kept)", EXIT_FAILURE
        )
    summary = faults.summary()
    if summary:
        echo(summary)
    echo(f"recorded to {output} ({reason.replace('_', ' ')})")
    return 0
