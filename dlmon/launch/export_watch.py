"""``dlmon export PID --prometheus``: serve one job's snapshots as Prometheus metrics, headless,
until it exits or Ctrl-C. (``--all-jobs`` keeps its own loop in the CLI.)"""

from __future__ import annotations

from dlmon.flow.watch import Plug, WatchOptions
from dlmon.launch.console import echo, watch_of
from dlmon.launch.session import AlertLog


def export(target: int, interval: float, plugs: tuple[Plug, ...], *, inject: bool = False) -> int:
    """Watch ``target`` with the exporter plugged in; ``inject``: load the agent into it first."""
    if inject:
        from dlmon.launch.agent_offer import load_first

        load_first(target)
    watch = watch_of(target, WatchOptions(interval, plugs=plugs, sinks=(AlertLog(),)))
    reason = watch.run()
    echo(f"export stopped ({reason.replace('_', ' ')})")
    return 0
