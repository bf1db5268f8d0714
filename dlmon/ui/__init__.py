"""The live dashboard (Textual). The only package that imports textual, rich or plotext.

Importing ``dlmon.ui`` is cheap and starts nothing: Textual is imported when an app is created.

- :func:`create_app` builds the one app used by the CLI and by every test;
- :func:`run_dashboard` runs it in the terminal and returns a :class:`DashboardResult`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dlmon.ui.result import DashboardResult

if TYPE_CHECKING:
    from dlmon.flow.sources import Source
    from dlmon.ui.app import DlmonApp

__all__ = ["DashboardResult", "create_app", "run_dashboard"]


def create_app(
    source: Source,
    *,
    interval: float | None = None,
    clock: Callable[[], float] = time.time,
    ask_stop_on_quit: bool = False,
    boot_time: float | None = None,
    stop_by_default: bool = False,
    rank: int | None = None,
) -> DlmonApp:
    """The dashboard app for ``source`` (not started).

    ``interval``: the sampling interval, for display and staleness (default: the source's).
    ``clock``: wall time, for "no data for N s" and screenshot names (tests pass a fixed one).
    ``ask_stop_on_quit``: ``dlmon run`` — quitting asks whether to stop the training as well.
    ``boot_time``: Unix time of the boot, for the target's uptime when a snapshot lacks its
    start_unix_time (the CLI passes /proc/stat's for a live source; default unknown).
    ``stop_by_default``: the quit question's default button stops the training (``dlmon demo``:
    a synthetic training has no reason to outlive the dashboard); otherwise it leaves it running.
    ``rank``: show only that rank of a distributed job (``--rank N``), and what belongs to no rank.
    """
    from dlmon.ui.app import DlmonApp

    return DlmonApp(
        source,
        interval=interval,
        clock=clock,
        ask_stop_on_quit=ask_stop_on_quit,
        boot_time=boot_time,
        stop_by_default=stop_by_default,
        rank=rank,
    )


def run_dashboard(source: Source, **kw: Any) -> DashboardResult:
    """Run the dashboard in this terminal until the user quits; the source is stopped on exit."""
    from dlmon.ui.app import run_app

    return run_app(create_app(source, **kw))
