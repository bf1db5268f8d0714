"""What keeps the dashboard cheap at 1 Hz, checked on the screen it draws (never by timing)."""

from __future__ import annotations

import asyncio
import dataclasses

from test_ui_support import BOOT, T0, FakeSource, fixed_clock, make_snapshot

from dlmon.model import Snapshot
from dlmon.ui import create_app
from dlmon.ui.app import DlmonApp, SnapshotArrived
from dlmon.ui.widgets import CHART_REBUILD_S, TimeChart


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
                app.refresh_view(True)
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
