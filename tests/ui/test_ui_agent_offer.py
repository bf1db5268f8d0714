"""The dashboard's offer to load the agent (issue 23), driven by Textual's Pilot: ``i`` loads it
only while the offer is on the screen, and never into a job that has gone. Second-reader
regressions: each failed before its fix. The loader records its calls (a real one runs gdb)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

from textual.pilot import Pilot

from dlmon.ui import DashboardResult
from dlmon.ui.app import DlmonApp
from dlmon.ui.widgets import WorkerTable
from support.ui import FakeSource, make_snapshot
from ui.test_ui_app import make, settle

OFFER = "no agent in this job: press i to load the agent into pid 4242 (gdb; ~60 ms pause)"


class RecordingLoader:
    """An AgentLoader whose load counts its calls and, if asked, waits for ``release``."""

    offer = OFFER

    def __init__(self, why: str | None = None, hold: bool = False) -> None:
        self.calls = 0
        self.why = why
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def load(self) -> str | None:
        self.calls += 1
        self.release.wait(30)
        return self.why


def offered(loader: RecordingLoader) -> tuple[FakeSource, DlmonApp]:
    source = FakeSource([dataclasses.replace(make_snapshot(), loaders=())])
    source.agent_loader = loader  # type: ignore[attr-defined]  # what `dlmon attach` sets
    return source, make(source)


def run(app: DlmonApp, scenario: object) -> None:
    async def main() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            await scenario(app, pilot)  # type: ignore[operator]

    asyncio.run(main())


def test_i_in_a_zoomed_panel_without_the_offer_reverses_the_sort_and_loads_nothing() -> None:
    """Zoomed into the workers table the offer is not on screen: ``i`` there is the table's
    reverse, as everywhere else, not a gdb attach to the training that the user cannot see offered."""
    loader = RecordingLoader()
    _, app = offered(loader)

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        await pilot.press("2")  # the workers panel in full
        await settle(pilot)
        table = app.main_screen.query_one("#table", WorkerTable)
        before = table.reverse
        await pilot.press("i")
        await settle(pilot)
        assert loader.calls == 0
        assert table.reverse is not before
        assert app.state.agent_offer == OFFER

    run(app, scenario)


def test_the_palettes_reverse_the_sort_reverses_it_and_loading_is_a_command_of_its_own() -> None:
    loader = RecordingLoader()
    _, app = offered(loader)

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        commands = {c.title: c for c in app.get_system_commands(app.main_screen)}
        table = app.main_screen.query_one("#table", WorkerTable)
        before = table.reverse
        commands["Reverse the sort"].callback()
        await settle(pilot)
        assert loader.calls == 0 and table.reverse is not before
        commands["Load the agent"].callback()
        await settle(pilot)
        assert loader.calls == 1

    run(app, scenario)


def test_a_job_that_exits_during_the_load_is_not_offered_again() -> None:
    """The job's end came while the load ran (the offer is kept through a load): a failed load then
    offered 'press i to try again' for a pid that may be another process's by now."""
    loader = RecordingLoader(why="process 4242 exited while dlmon was loading the agent into it", hold=True)
    source, app = offered(loader)

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        await pilot.press("i")
        await settle(pilot)
        assert loader.calls == 1
        last = make_snapshot()
        gone = dataclasses.replace(last.target, alive=False)
        source.push(dataclasses.replace(last, loaders=(), target=gone))
        source.end("target_exited")
        await settle(pilot)
        loader.release.set()
        for _ in range(40):
            await pilot.pause(0.05)
            if not app._agent_loading:
                break
        await settle(pilot)
        assert app.agent_loader is None and app.state.agent_offer is None
        await pilot.press("i")
        await settle(pilot)
        assert loader.calls == 1

    run(app, scenario)
