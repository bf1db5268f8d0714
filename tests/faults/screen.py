"""Driving the real dashboard (``dlmon.ui.create_app``) under Textual's Pilot, for the fault tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from textual.pilot import Pilot

from dlmon.flow.sources import Source
from dlmon.ui import DashboardResult, create_app
from dlmon.ui.app import DlmonApp
from dlmon.ui.widgets import LinesView, WorkerTable

Scenario = Callable[[DlmonApp, Pilot[DashboardResult]], Awaitable[None]]


def screen_text(app: DlmonApp) -> str:
    """Every panel's text and the process table, as the main screen shows them."""
    screen = app.main_screen
    parts = [view.text for view in screen.query(LinesView)]
    parts += [table.text for table in screen.query(WorkerTable)]
    return "\n".join(parts)


def run_dashboard(
    source: Source, scenario: Scenario, size: tuple[int, int] = (160, 50), **kw: object
) -> tuple[DlmonApp, DashboardResult | None]:
    """Run ``scenario`` in the app at ``size``; the scenario must end by quitting (``q``)."""
    app = create_app(source, **kw)  # type: ignore[arg-type]

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await scenario(app, pilot)

    asyncio.run(main())
    return app, app.return_value


async def wait_for_text(
    app: DlmonApp, pilot: Pilot[DashboardResult], needle: str, timeout: float = 30.0
) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        text = screen_text(app)
        if needle in text:
            return text
        if loop.time() > deadline:
            raise AssertionError(f"{needle!r} never shown; the screen:\n{text}")
        await pilot.pause(0.2)
