"""What keeps the dashboard cheap at 1 Hz, checked on the screen it draws (never by timing)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

from textual.pilot import Pilot

from dlmon.flow.sources import ReplaySource
from dlmon.model import Alert, Snapshot
from dlmon.model.serialize import snapshot_to_dict
from dlmon.ui import DashboardResult, create_app
from dlmon.ui.app import MIN_RENDER_GAP_S, DlmonApp, SnapshotArrived
from dlmon.ui.widgets import CHART_REBUILD_S, TimeChart
from support.ui import BOOT, T0, FakeSource, fixed_clock, make_snapshot


def _without_limit(snap: Snapshot) -> Snapshot:
    memory = dataclasses.replace(snap.memory, cgroup_limit_bytes=None)
    return dataclasses.replace(snap, memory=memory, cgroup=None)


def test_a_chart_moves_on_every_15_s_of_data_not_every_bucket() -> None:
    """At 1 Hz the memory chart's bucket is 5 s; when only time moved on, the plot (plotext's
    build, the dashboard's costliest step) is rebuilt once per CHART_REBUILD_S of data. A new
    line (the cgroup limit appearing) is drawn at once."""
    seen: dict[str, object] = {}

    async def main() -> None:
        app: DlmonApp = create_app(FakeSource([]), clock=fixed_clock, boot_time=BOOT)
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            chart = app.main_screen.query_one("#memory-chart", TimeChart)
            seconds = 90
            for k in range(seconds + 1):  # one tick at a time, each drawn
                app.post_message(SnapshotArrived(_without_limit(make_snapshot(T0 + k))))
                await pilot.pause()
                app.refresh_view()  # not forced: a forced repaint draws the charts up to now
                await pilot.pause()
            seen["builds"] = chart.builds
            seen["labels_before"] = chart.plotted_labels
            app.post_message(SnapshotArrived(make_snapshot(T0 + seconds + 1)))  # the limit appears
            await pilot.pause()
            app.refresh_view(True)
            await pilot.pause()
            seen["labels_after"] = chart.plotted_labels
            seen["builds_after"] = chart.builds

    asyncio.run(main())
    builds = seen["builds"]
    assert isinstance(builds, int)
    # 90 s of data: 18 five-second buckets, but at most one rebuild per 15 s (+ the first plot)
    assert 2 <= builds <= 90 / CHART_REBUILD_S + 2, builds
    assert "cgroup limit" not in seen["labels_before"]  # type: ignore[operator]
    assert "cgroup limit" in seen["labels_after"]  # type: ignore[operator]
    assert seen["builds_after"] == builds + 1


# ---- the throttle never leaves a chart behind the figures it sits under ------------------------
GROWTH = 100 * 1024**2  # 100 MiB/s: 10 s of data move the job's PSS far outside the chart's padding


def _chart_top(app: DlmonApp) -> float:
    """The top of the memory chart's y axis, in bytes (what its scale labels say)."""
    chart = app.main_screen.query_one("#memory-chart", TimeChart)
    assert chart.y_range is not None
    return chart.y_range[1] * chart.scale


def _pss_shown(app: DlmonApp) -> float:
    latest = app.state.latest
    assert latest is not None and latest.memory.pss_sum_bytes is not None
    return float(latest.memory.pss_sum_bytes)


async def _ticks(app: DlmonApp, pilot: Pilot[DashboardResult], seconds: range) -> None:
    for k in seconds:  # one tick at a time, each drawn
        app.post_message(SnapshotArrived(_without_limit(make_snapshot(T0 + k, growth_per_s=GROWTH))))
        await pilot.pause()
        app.refresh_view()
        await pilot.pause()


def test_pausing_draws_the_charts_up_to_the_frozen_figures() -> None:
    """A user pauses to read the screen: the chart must end where the figures above it are, not
    up to 15 s of data earlier (a leak's last step missing from the chart it is judged on)."""
    seen: dict[str, float] = {}

    async def main() -> None:
        app: DlmonApp = create_app(FakeSource([]), clock=fixed_clock, boot_time=BOOT)
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            await _ticks(app, pilot, range(0, 28))
            await pilot.press("p")
            await pilot.pause()
            seen["top"], seen["pss"] = _chart_top(app), _pss_shown(app)

    asyncio.run(main())
    assert seen["top"] >= seen["pss"], seen


def test_the_source_ending_draws_the_last_data_in_the_charts() -> None:
    """The training exited: the last frame stays on screen for good, so its charts must hold the
    last samples (no later tick will ever move them on)."""
    seen: dict[str, float] = {}

    async def main() -> None:
        source = FakeSource([])
        app: DlmonApp = create_app(source, clock=fixed_clock, boot_time=BOOT)
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            await _ticks(app, pilot, range(0, 28))
            source.end("the target exited")
            await pilot.pause(MIN_RENDER_GAP_S + 0.1)
            seen["top"], seen["pss"] = _chart_top(app), _pss_shown(app)

    asyncio.run(main())
    assert seen["top"] >= seen["pss"], seen


def test_a_replay_jump_redraws_the_charts_from_the_fresh_history(tmp_path: Path) -> None:
    """``]`` in a replay jumps 10 s on to the next alert: the history starts again there, and the
    chart must show it at once, not the frames before the jump for 15 s more."""
    path = tmp_path / "rec.jsonl"
    with path.open("w") as fh:
        for k in range(40):
            s = _without_limit(make_snapshot(T0 + k, growth_per_s=GROWTH, alerts=False))
            alert = Alert(
                kind="memory_growth", severity="warning", subject="job", message="m", advice="a", since=T0
            )
            s = dataclasses.replace(s, alerts=(alert,) if k >= 10 else ())
            fh.write(json.dumps(snapshot_to_dict(s)) + "\n")
    seen: dict[str, object] = {}

    async def main() -> None:
        app: DlmonApp = create_app(ReplaySource(str(path), speed=1e-9), clock=fixed_clock, boot_time=BOOT)
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause(MIN_RENDER_GAP_S + 0.1)
            seen["first"] = _chart_top(app)
            await pilot.press("right_square_bracket")
            for _ in range(400):
                await pilot.pause(0.05)
                if app.state.latest is not None and app.state.latest.time == T0 + 10:
                    break
            await pilot.pause(MIN_RENDER_GAP_S + 0.1)
            latest = app.state.latest
            seen["at"] = latest.time if latest is not None else None
            seen["top"], seen["pss"] = _chart_top(app), _pss_shown(app)

    asyncio.run(main())
    assert seen["at"] == T0 + 10, seen
    top, pss = seen["top"], seen["pss"]
    assert isinstance(top, float) and isinstance(pss, float)
    assert top >= pss, seen
