"""The analyzer's swallowed failures reach the screen: a dim line in the Alerts panel."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

from dlmon.analysis import Analyzer
from dlmon.analysis.detectors import DETECTORS, Candidate, Context
from dlmon.flow.sources import LiveSource
from dlmon.ui import create_app
from dlmon.ui.app import DlmonApp, SnapshotArrived
from dlmon.ui.widgets import LinesView
from support.ui import T0, FakeSource, fixed_clock, make_snapshot


def _broken_detector(ctx: Context) -> list[Candidate]:
    raise ValueError(f"broken on purpose at {len(ctx.recent)} snapshots")


def test_a_failing_detector_is_said_in_the_alerts_panel() -> None:
    """A real training-like process watched live; one detector raises every tick. The analyzer
    goes on (the other detectors still run) and the Alerts panel says how often it failed."""
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    analyzer = Analyzer(detectors={**DETECTORS, "broken": _broken_detector})
    seen: dict[str, str | int] = {}

    async def main() -> None:
        app: DlmonApp = create_app(LiveSource(target.pid, 0.2, analyzer=analyzer))
        async with app.run_test(size=(160, 50)) as pilot:
            deadline = time.monotonic() + 60  # generous: a loaded machine samples late
            view = app.main_screen.query_one("#alerts-lines", LinesView)
            while time.monotonic() < deadline and "analysis failed" not in view.text:
                await pilot.pause(0.2)
            while time.monotonic() < deadline and analyzer.errors < 3:
                await pilot.pause(0.2)
            app.refresh_view(True)
            await pilot.pause()
            seen["text"] = view.text
            seen["styles"] = ",".join(style for line in view.lines for _, style in line)
            seen["errors"] = analyzer.errors  # read after the screen: at least what it shows
            await pilot.press("q")

    try:
        asyncio.run(main())
    finally:
        target.kill()
        target.wait()
    text = str(seen["text"])
    assert "analysis failed" in text, text
    assert "ValueError: broken on purpose" in text, text
    shown = re.search(r"analysis failed (\d+) times", text)
    assert shown is not None, text
    # the sampling thread goes on meanwhile: the count shown is the analyzer's at that repaint
    assert 3 <= int(shown.group(1)) <= int(seen["errors"]), (text, seen["errors"])
    assert set(str(seen["styles"]).split(",")) <= {"dim"}, seen  # said quietly, not as an alert


def test_a_healthy_analysis_says_nothing_of_failures() -> None:
    seen: list[str] = []

    async def main() -> None:
        app = create_app(FakeSource([make_snapshot(T0)]), clock=fixed_clock)
        async with app.run_test(size=(160, 50)) as pilot:
            app.post_message(SnapshotArrived(make_snapshot(T0 + 1)))
            await pilot.pause(0.4)
            seen.append(app.main_screen.query_one("#alerts-lines", LinesView).text)

    asyncio.run(main())
    assert seen and "analysis failed" not in seen[0], seen


def test_a_small_terminal_says_it_on_the_one_alerts_line() -> None:
    """80x24: the Alerts panel is one line; the failure count is on it (the full line is in the
    zoomed panel)."""
    analyzer = Analyzer(detectors={"broken": _broken_detector})
    source = FakeSource([analyzer(make_snapshot(T0 + k, alerts=False)) for k in range(3)])
    source.analyzer = analyzer  # type: ignore[attr-defined]  # a live source carries its analyzer
    seen: list[str] = []

    async def main() -> None:
        app = create_app(source, clock=fixed_clock)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause(0.4)
            seen.append(app.main_screen.query_one("#alerts-lines", LinesView).text)
            await pilot.press("6")
            await pilot.pause(0.4)
            seen.append(app.main_screen.query_one("#alerts-lines", LinesView).text)

    asyncio.run(main())
    assert "analysis failed 3 times" in seen[0], seen
    assert "analysis failed 3 times (last: ValueError: broken on purpose" in " ".join(seen[1].split()), seen
