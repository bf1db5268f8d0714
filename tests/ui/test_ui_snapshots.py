"""SVG snapshots of the dashboard (pytest-textual-snapshot) at 80x24 and 160x50, fixed data and time.

Regenerate after a deliberate change with ``python -m pytest tests/ui/test_ui_snapshots.py
--snapshot-update`` and look at the SVGs in tests/ui/__snapshots__/ before committing them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from textual.pilot import Pilot

from dlmon.ui import DashboardResult, create_app
from dlmon.ui.app import MIN_RENDER_GAP_S, DlmonApp
from support.ui import BOOT, T0, FakeSource, fixed_clock, make_ddp_snapshot, run_of

SnapCompare = Callable[..., bool]


async def settle(pilot: Pilot[DashboardResult]) -> None:
    await pilot.pause(MIN_RENDER_GAP_S + 0.05)


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "UTC")
    monkeypatch.delenv("NO_COLOR", raising=False)
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def app_with(gpus: int = 0, **kw: Any) -> DlmonApp:
    """Fifteen minutes of history every 5 s (so the charts have a shape), ending at T0."""
    source = FakeSource(run_of(900, 5.0, gpus=gpus, **kw))
    return create_app(source, clock=fixed_clock, boot_time=BOOT)


def test_overview_80x24(snap_compare: SnapCompare) -> None:
    assert snap_compare(app_with(), terminal_size=(80, 24), run_before=settle)


def test_overview_160x50(snap_compare: SnapCompare) -> None:
    assert snap_compare(app_with(), terminal_size=(160, 50), run_before=settle)


def test_two_gpus_80x24(snap_compare: SnapCompare) -> None:
    assert snap_compare(app_with(gpus=2), terminal_size=(80, 24), run_before=settle)


def test_two_gpus_160x50(snap_compare: SnapCompare) -> None:
    assert snap_compare(app_with(gpus=2), terminal_size=(160, 50), run_before=settle)


def test_memory_panel_in_full_80x24(snap_compare: SnapCompare) -> None:
    assert snap_compare(app_with(), press=["1"], terminal_size=(80, 24), run_before=settle)


def test_worker_detail_160x50(snap_compare: SnapCompare) -> None:
    assert snap_compare(app_with(), press=["down", "enter"], terminal_size=(160, 50), run_before=settle)


def test_target_exited_without_agent_80x24(snap_compare: SnapCompare) -> None:
    app = create_app(
        FakeSource(run_of(60, 5.0, loaders=False, alerts=False, alive=False, exit_code=137)),
        clock=fixed_clock,
        boot_time=BOOT,
    )
    assert snap_compare(app, terminal_size=(80, 24), run_before=settle)


def ddp_app() -> DlmonApp:
    """8 GPUs, 6 disks, 8 ranks x 8 workers on a 2 TiB host: fifteen minutes every 5 s."""
    snaps = [make_ddp_snapshot(T0 - (180 - k) * 5.0, interval=5.0) for k in range(181)]
    return create_app(FakeSource(snaps), clock=fixed_clock, boot_time=BOOT)


@pytest.mark.parametrize("size", [(80, 24), (160, 50), (250, 70)])
def test_big_ddp_box(snap_compare: SnapCompare, size: tuple[int, int]) -> None:
    assert snap_compare(ddp_app(), terminal_size=size, run_before=settle)
