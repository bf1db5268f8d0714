"""``dlmon advise PID``: measure the job for a few seconds, then advise on num_workers, batch
size and memory (dlmon.analysis.advice). The CLI checks the arguments and calls :func:`advise`."""

from __future__ import annotations

import json
import time

import click

from dlmon.launch.console import Failed, echo, open_sampler


def advise(target: int, duration: float, as_json: bool, *, inject: bool = False) -> int:
    """Sample ``target`` every second for ``duration`` seconds and print the advice (text or JSON);
    ``inject``: load the agent into it first, so that the loader figures count."""
    from dlmon.analysis import Analyzer, advice_to_dict, format_advice
    from dlmon.analysis import advise as advice_of
    from dlmon.collect.procfs import smaps_unreadable

    if inject:
        from dlmon.launch.agent_offer import load_first

        load_first(target)
    sampler = open_sampler(target, unlimited_smaps=True)
    denied = smaps_unreadable(target)
    if denied:
        sampler.close()
        raise Failed(
            f"cannot read the memory of process {target}: {denied} (run dlmon as its user, or as root)"
        )
    analyzer = Analyzer()
    history = [analyzer(sampler.sample())]
    if not history[0].target.alive:
        sampler.close()
        raise Failed(f"process {target} has exited (it is a zombie): nothing left to measure")
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline and history[-1].target.alive:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        history.append(analyzer(sampler.sample()))
    sampler.close()
    if not history[-1].target.alive:
        history.pop()
        echo(
            f"process {target} exited during the measurement: advice from its "
            f"{len(history)} sample(s) before that"
        )
    result = advice_of(history)
    if as_json:
        click.echo(json.dumps(advice_to_dict(result), indent=2, allow_nan=False))
    else:
        click.echo(format_advice(result))
    return 0
