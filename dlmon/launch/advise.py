"""``dlmon advise PID``: measure a running training for a few seconds, then advise on
num_workers, batch size and memory (:func:`dlmon.analysis.advise`).

The measurement is a watch like any other (:mod:`dlmon.flow.watch`): a tick a second (or a
little less), every PSS read (advice from a half-read tree would be wrong), until the time is up
or the target exits.
"""

from __future__ import annotations

import json
import math

import click

from dlmon.analysis import advice_to_dict, advise, format_advice
from dlmon.collect.procfs import smaps_unreadable
from dlmon.flow.watch import WatchOptions
from dlmon.launch.console import EXIT_FAILURE, Failed, echo, watch_of
from dlmon.model import Snapshot

MAX_TICK_S = 1.0


def advise_pid(pid: int, seconds: float, *, as_json: bool, inject: bool = False) -> int:
    """Measure ``pid`` for ``seconds`` and print the advice; :class:`Failed` for a process that
    cannot be measured (its memory unreadable, already exited). ``inject``: load the agent into it
    first, so that the loader figures count."""
    if inject:
        from dlmon.launch.agent_offer import load_first

        load_first(pid)
    history: list[Snapshot] = []

    def keep(snapshot: Snapshot) -> None:
        history.append(snapshot)
        if not snapshot.target.alive:  # what it advises on is the training, not its remains
            watch.stop.set()

    # ticks of at most a second that end on the last one: 2.5 s is 4 samples over 2.5 s
    tick_s = seconds / max(1, math.ceil(seconds / MAX_TICK_S))
    options = WatchOptions(tick_s, duration=seconds, sinks=(keep,), report=echo)
    watch = watch_of(pid, options, unlimited_smaps=True)
    denied = smaps_unreadable(pid)
    if denied:
        assert watch.sampler is not None
        watch.sampler.close()
        raise Failed(f"cannot read the memory of process {pid}: {denied} (run dlmon as its user, or as root)")
    # Ctrl-C is click's "Aborted!", as it always was: no advice from a measurement cut short
    watch.run(on_signals=False)
    summary = watch.faults.summary()
    if summary and history:  # with no sample at all, the error line below says the first failure
        echo(summary)
    if not history:  # every tick failed inside dlmon (said on stderr as it happened)
        raise Failed(f"no sample of process {pid} could be taken: {watch.faults.first_failure}", EXIT_FAILURE)
    if not history[0].target.alive:
        raise Failed(f"process {pid} has exited (it is a zombie): nothing left to measure")
    if not history[-1].target.alive:
        history.pop()
        taken = len(history)
        echo(f"process {pid} exited during the measurement: advice from its {taken} sample(s) before that")
    result = advise(history)
    if as_json:
        click.echo(json.dumps(advice_to_dict(result), indent=2, allow_nan=False))
    else:
        click.echo(format_advice(result))
    return 0
