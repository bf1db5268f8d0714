"""The dashboard driven by Textual's Pilot: snapshots injected as messages, no sampling thread."""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from textual.pilot import Pilot

from dlmon.ui import DashboardResult, create_app
from dlmon.ui.app import MIN_RENDER_GAP_S, DlmonApp, MainScreen, SnapshotArrived
from dlmon.ui.screens import AdviceScreen, HelpScreen, QuitScreen, WorkerDetailScreen
from dlmon.ui.widgets import LinesView, LogView, Panel, WorkerTable
from support.ui import (
    BOOT,
    MAIN_PID,
    NO_GPU_REASON,
    T0,
    WORKER_PIDS,
    ZOMBIE_PID,
    FakeSource,
    fixed_clock,
    make_snapshot,
    run_of,
)

Scenario = Callable[[DlmonApp, Pilot[DashboardResult]], Awaitable[None]]


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def make(source: FakeSource, **kw: object) -> DlmonApp:
    return create_app(source, clock=fixed_clock, boot_time=BOOT, **kw)  # type: ignore[arg-type]


def drive(app: DlmonApp, scenario: Scenario, size: tuple[int, int] = (160, 50)) -> DashboardResult | None:
    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await scenario(app, pilot)

    asyncio.run(main())
    return app.return_value


async def settle(pilot: Pilot[DashboardResult]) -> None:
    """Let a pushed snapshot be drawn (repaints are at most every MIN_RENDER_GAP_S)."""
    await pilot.pause(MIN_RENDER_GAP_S + 0.05)


def main_of(app: DlmonApp) -> MainScreen:
    return app.main_screen


def header(app: DlmonApp) -> str:
    return main_of(app).query_one("#header", LinesView).text


def view(app: DlmonApp, panel: str) -> str:
    return main_of(app).query_one(f"#{panel}-lines", LinesView).text


def table(app: DlmonApp) -> WorkerTable:
    return main_of(app).query_one("#table", WorkerTable)


def test_first_frame_before_any_data() -> None:
    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        assert "waiting for the first sample" in header(app)
        assert "waiting" in view(app, "memory")

    drive(make(FakeSource()), scenario)


def test_injected_snapshot_fills_every_panel() -> None:
    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        text = header(app)
        for expected in (f"pid {MAIN_PID}", "gpu-box-7", "0 GPUs", "1 alert", "up 1h01m", "python train.py"):
            assert expected in text, text
        rows = table(app).text.splitlines()
        assert rows[0].split()[:4] == ["ROLE", "ID▾", "PID", "STATE"]
        assert len(rows) == 1 + 5  # header + main + 4 workers
        zombie = next(r for r in rows if str(ZOMBIE_PID) in r)
        assert "zombie" in zombie and " 0B" not in zombie and "–" in zombie  # noqa: RUF001
        stale = next(r for r in rows if str(WORKER_PIDS[2]) in r)
        assert "~1.1" in stale  # PSS read 48 s ago: marked, not hidden
        memory = view(app, "memory")
        assert (
            "PSS 7.4 GiB" in memory
            and "RSS sum 23.5 GiB" in memory
            and "cgroup 8.6 GiB of 16.0 GiB" in memory
        )
        assert "/dev/shm 1.4 GiB of 32.0 GiB" in memory and "pinned pool n/a" in memory
        assert " ".join(view(app, "gpu").split()) == f"no GPU: {NO_GPU_REASON}"  # wrapped, not cut
        io = view(app, "io")
        assert "nvme0n1" in io and "util 87%" in io and "1 process in D state" in io and "some 12.5%" in io
        assert "9.5 batch/s" in view(app, "throughput") and "data wait 34%" in view(app, "throughput")
        assert "memory_growth" in view(app, "alerts") and "look for tensors" in view(app, "alerts")

    drive(make(FakeSource(run_of(120))), scenario)


def test_two_gpus_show_devices_processes_and_torch_figures() -> None:
    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        overview = view(app, "gpu").splitlines()
        assert len(overview) == 2 and "torch 17.9G/20.0G" in overview[0]  # one line per device
        assert "2 GPUs" in header(app)
        assert "GPU" in table(app).text.splitlines()[0]  # each process's VRAM in the table
        await pilot.press("3")  # in full: torch's figures and every process on the device
        gpu = view(app, "gpu")
        assert "GPU0" in gpu and "GPU1" in gpu and "util 91%" in gpu
        assert "torch alloc 17.9G reserved 20.0G peak 19.2G" in gpu
        assert f"pid {MAIN_PID} main 20.5G" in gpu and f"pid {WORKER_PIDS[0]} worker 0 512M" in gpu

    drive(make(FakeSource([make_snapshot(gpus=2)])), scenario)


def test_without_the_agent_the_throughput_panel_says_how_to_get_it() -> None:
    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        text = " ".join(view(app, "throughput").split())
        assert "dlmon run" in text and "import dlmon.agent; dlmon.agent.start()" in text
        assert "BATCH%" not in table(app).text

    drive(make(FakeSource([make_snapshot(loaders=False)])), scenario)


def test_sort_keys_and_cursor_follow_rows() -> None:
    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        t = table(app)

        def first_pid() -> int:
            return int(t.text.splitlines()[1].split()[2])

        assert t.sort == "id" and first_pid() == MAIN_PID
        await pilot.press("c")
        assert t.sort == "cpu" and not t.reverse and first_pid() == MAIN_PID  # 97% CPU
        await pilot.press("c")
        assert t.reverse and first_pid() == ZOMBIE_PID  # 0% first when reversed
        await pilot.press("d")
        assert t.sort == "read" and first_pid() == WORKER_PIDS[2]
        await pilot.press("i")
        assert t.reverse
        await pilot.press("m", "down")
        assert t.sort == "pss" and t.cursor_key is not None
        selected = t.cursor_key
        await pilot.press("greater_than_sign")
        assert t.sort == "rss" and t.cursor_key == selected  # the cursor stays on its row
        await pilot.press("less_than_sign", "n")
        assert t.sort == "id"
        assert "sorted by worker id" in str(main_of(app).query_one("#workers", Panel).border_subtitle)

    drive(make(FakeSource([make_snapshot()])), scenario)


def test_enter_opens_a_worker_detail_that_keeps_updating() -> None:
    source = FakeSource(run_of(60, 1.0))

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await pilot.press("down", "enter")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, WorkerDetailScreen)
        lines = screen.query_one("#detail-lines", LinesView)
        assert f"pid {WORKER_PIDS[0]}" in lines.text and "worker id 0" in lines.text
        before = lines.text
        source.push(make_snapshot(T0 + 30))
        await settle(pilot)
        assert lines.text != before  # sampling and rendering go on while the detail is open
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)
        assert "00:00:30" in header(app)  # the main screen caught up on return

    drive(make(source), scenario)


def test_pause_freezes_the_view_while_sampling_goes_on() -> None:
    source = FakeSource([make_snapshot()])

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await pilot.press("p")
        assert app.paused and "PAUSED" in header(app)
        for k in range(1, 4):
            source.push(make_snapshot(T0 + k))
        await pilot.pause()
        assert app.state.count == 4 and len(app.state.history) == 4  # kept
        assert "00:00:00" in header(app)  # but not drawn
        await pilot.press("p")
        assert not app.paused and "00:00:03" in header(app) and "PAUSED" not in header(app)

    drive(make(source), scenario)


def test_number_keys_show_one_panel_and_tab_moves_between_panels() -> None:
    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        main = main_of(app)
        await pilot.press("3")
        assert main.zoomed == "gpu"
        shown = [p.id for p in main.query(Panel) if p.display]
        assert shown == ["gpu"]
        await pilot.press("3")
        assert main.zoomed is None
        await pilot.press("1")
        assert main.zoomed == "memory" and main.query_one("#memory-chart").display
        await pilot.press("tab")
        assert main.zoomed == "workers"  # tab goes on to the next panel in full
        await pilot.press("escape")
        assert main.zoomed is None
        seen = []
        for _ in range(6):
            await pilot.press("tab")
            seen.append(main.focused_panel())
        assert seen == ["gpu", "io", "throughput", "alerts", "memory", "workers"]  # in number order
        await pilot.press("shift+tab")
        assert main.focused_panel() == "memory"
        await pilot.press("z")
        assert main.zoomed == "memory"
        await pilot.press("0")
        assert main.zoomed is None

    drive(make(FakeSource(run_of(60))), scenario)


def test_target_exit_keeps_the_last_data_and_is_reported() -> None:
    source = FakeSource([make_snapshot()])

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        source.push(make_snapshot(T0 + 1, alive=False, exit_code=3))
        source.end("target_exited")
        await settle(pilot)
        assert "target exited (code 3)" in header(app)
        assert len(table(app).text.splitlines()) == 6  # the rows stay
        await pilot.press("q")  # its workers are still listed: asked whether to stop them too
        assert isinstance(app.screen, QuitScreen)
        await pilot.press("enter")  # leave them

    result = drive(make(source, ask_stop_on_quit=True), scenario)
    assert result == DashboardResult(
        quit_by_user=True, target_exited=True, exit_code=3, stop_training=False, end_reason="target_exited"
    )


@pytest.mark.parametrize(
    ("keys", "stop"),
    [(("q", "enter"), False), (("q", "x"), True), (("q", "tab", "enter"), True), (("q", "l"), False)],
)
def test_quitting_dlmon_run_asks_whether_to_stop_the_training(keys: tuple[str, ...], stop: bool) -> None:
    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await pilot.press(keys[0])
        assert isinstance(app.screen, QuitScreen)
        await pilot.press(*keys[1:])

    result = drive(make(FakeSource([make_snapshot()]), ask_stop_on_quit=True), scenario)
    assert result is not None and result.quit_by_user and result.stop_training is stop
    assert not result.target_exited


def test_the_quit_question_can_be_cancelled() -> None:
    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await pilot.press("q", "escape")
        assert isinstance(app.screen, MainScreen) and app.is_running
        await pilot.press("q", "enter")

    result = drive(make(FakeSource([make_snapshot()]), ask_stop_on_quit=True), scenario)
    assert result is not None and not result.stop_training


def test_attach_quits_without_asking_and_stops_the_source() -> None:
    source = FakeSource([make_snapshot()])

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await pilot.press("q")

    result = drive(make(source), scenario)
    assert result == DashboardResult(True, False, None, False)
    assert source.started == 1
    deadline = time.monotonic() + 5
    while source.stopped == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.stopped >= 1


def test_help_and_command_palette_cover_every_action() -> None:
    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for expected in (
            "Quit",
            "Pause / resume",
            "Help",
            "Screenshot",
            "Advice",
            "Show Memory",
            "Show Workers",
        ):
            assert expected in titles
        assert sum(t.startswith("Sort workers by") for t in titles) == 7
        assert "Show Logs" not in titles  # no log without `dlmon run`
        assert "Open worker detail" in titles and "Next panel" in titles and "Reverse the sort" in titles

    drive(make(FakeSource([make_snapshot()])), scenario)


def test_advice_key_shows_the_sizing_advice_from_the_measured_history() -> None:
    """`a` runs dlmon advise over the snapshots the dashboard holds: no new sampling needed."""
    seen: list[str] = []

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await pilot.press("a")
        assert isinstance(app.screen, AdviceScreen)
        seen.append(str(app.screen.query_one("#advice-text").render()))
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)

    drive(make(FakeSource([make_snapshot()])), scenario)
    assert "largest safe num_workers" in seen[0] and "advice" in seen[0]


def test_screenshot_key_saves_an_svg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "screenshots").mkdir()

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await pilot.press("s")
        await pilot.press("s")
        await pilot.press("q")

    result = drive(make(FakeSource([make_snapshot()])), scenario)
    assert result is not None and len(result.screenshots) == 2
    for path in result.screenshots:
        assert Path(path).parent.name == "screenshots"
        assert "<svg" in Path(path).read_text()[:500]


def test_a_burst_of_snapshots_is_drawn_once() -> None:
    source = FakeSource([make_snapshot()])

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        before = app.renders
        for k in range(1, 101):
            app.post_message(SnapshotArrived(make_snapshot(T0 + k)))
        await settle(pilot)
        assert app.state.count == 101
        assert app.renders - before <= 2
        assert "00:01:40" in header(app)

    drive(make(source), scenario)


@pytest.mark.parametrize("size", [(80, 24), (60, 20), (100, 30), (160, 50), (220, 60)])
def test_every_size_lays_out_without_overlap(size: tuple[int, int]) -> None:
    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        main = main_of(app)
        boxes = [p.region for p in main.query(Panel) if p.display and p.region.area]
        boxes.append(main.query_one("#header").region)
        for i, a in enumerate(boxes):
            assert a.right <= size[0] and a.bottom <= size[1], (a, size)
            for b in boxes[i + 1 :]:
                assert not a.overlaps(b), (a, b)
        rows = table(app).text.splitlines()
        assert len(rows) >= 2 and all(len(r) <= size[0] for r in rows)
        assert main.query_one("#table").region.height >= 3  # the table always gets room
        if size[1] < 36:
            assert not main.query_one("#memory-chart").region.area  # charts collapse first

    drive(make(FakeSource(run_of(60, gpus=2))), scenario, size)


def test_no_color_keeps_every_meaning_in_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    svg: list[str] = []

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        assert app.no_color
        svg.append(app.export_screenshot())
        rows = table(app).text
        assert "zombie" in rows and "disk" in rows and "~1.1" in rows
        assert "1 warning" in view(app, "alerts")

    drive(make(FakeSource([make_snapshot()])), scenario, (100, 30))
    colours = set(re.findall(r"#([0-9a-f]{6})", svg[0]))
    assert colours
    chrome = {"ff5f57", "febc2e", "28c840", "c5c8c6"}  # rich's window frame around the screenshot
    colours -= chrome
    greys = {c for c in colours if c[0:2] == c[2:4] == c[4:6]}
    assert colours == greys, colours - greys


def test_logs_panel_tails_the_training_output(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("epoch 1\nepoch 2\nprogress 10%\rprogress 100%\n")
    source = FakeSource([make_snapshot()], log_path=str(log))

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        main = main_of(app)
        await settle(pilot)
        assert main.query_one("#logs").display  # a small pane by default
        await pilot.press("7")
        assert main.zoomed == "logs"
        await settle(pilot)
        widget = main.query_one("#log", LogView)
        assert widget.text.splitlines() == ["epoch 1", "epoch 2", "progress 100%"]
        with log.open("a") as fh:
            fh.write("epoch 3\n")
        app._poll_log()
        await pilot.pause()
        assert widget.text.splitlines()[-1] == "epoch 3"
        assert "Show Logs" in [c.title for c in app.get_system_commands(app.screen)]

    drive(make(source), scenario, (100, 30))


def test_stale_data_is_flagged_in_the_header() -> None:
    now = [T0 + 0.5]
    source = FakeSource([make_snapshot()])
    app = create_app(source, clock=lambda: now[0], boot_time=BOOT, interval=1.0)

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        assert "no data for" not in header(app)
        now[0] = T0 + 20
        app._check_stale()
        await pilot.pause()
        assert "no data for 20s" in header(app)

    drive(app, scenario)


def test_create_app_imports_nothing_heavy_until_called() -> None:
    import subprocess
    import sys

    heavy = "('textual', 'rich', 'plotext', 'textual_plotext')"
    code = f"import sys, dlmon.ui; print(any(m.split('.')[0] in {heavy} for m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    )
    assert out.stdout.strip() == "False"


def test_an_hour_at_1hz_keeps_the_dashboard_memory_flat() -> None:
    """3600 snapshots of a 1 + 32 worker tree through the app (no thread): history, series and
    rows are bounded, so what is allocated in the second half-hour is released again."""
    import tracemalloc

    base = [make_snapshot(T0 + k, workers=32, zombie=False) for k in range(30)]
    sizes: list[int] = []

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        import dataclasses
        import gc

        tracemalloc.start()
        try:
            for k in range(3600):
                app.post_message(SnapshotArrived(dataclasses.replace(base[k % 30], time=T0 + k)))
                if k % 300 == 299:
                    await pilot.pause()
                if k in (1799, 3599):
                    await settle(pilot)
                    gc.collect()
                    sizes.append(tracemalloc.get_traced_memory()[0])
        finally:
            tracemalloc.stop()
        assert app.state.count == 3600 and len(app.state.history) == app.state.history.capacity
        assert app.renders < 100  # bursts are drawn once, not 3600 times

    drive(make(FakeSource()), scenario)
    assert sizes[1] - sizes[0] < 2 * 1024 * 1024, sizes
