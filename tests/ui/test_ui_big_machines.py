"""Issue 12: the dashboard on a real GPU box (big machines, many ranks, the training's output)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from textual.color import Color
from textual.events import MouseScrollDown
from textual.pilot import Pilot

from dlmon.flow.sources import ReplaySource
from dlmon.model import Alert, LoaderSample, Snapshot, WorkerDeath
from dlmon.model.serialize import snapshot_to_dict
from dlmon.ui import DashboardResult, create_app
from dlmon.ui.app import LOG_KEEP, MIN_RENDER_GAP_S, DlmonApp
from dlmon.ui.screens import AdviceScreen
from dlmon.ui.state import HISTORY_CAPACITY, DashboardState
from dlmon.ui.views import memory_lines, memory_trend, text_of
from dlmon.ui.widgets import CHART_LINE_KINDS, LinesView, LogView, Panel, TimeChart, WorkerTable
from support.ui import (
    BOOT,
    MAIN_PID,
    T0,
    WORKER_PIDS,
    FakeSource,
    GiB,
    fixed_clock,
    make_ddp_snapshot,
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
    await pilot.pause(MIN_RENDER_GAP_S + 0.05)


# ---- 1. small things a review found -----------------------------------------------------------
def test_the_state_cell_shows_a_whole_exit_code() -> None:
    """A worker that exited 137 reads "exit 137" in the table, not "exit 13"."""
    snap = make_snapshot(zombie=False)
    victim = WORKER_PIDS[1]
    death = WorkerDeath(
        pid=victim, worker_id=1, loader_id="loader-1", signal=None, exit_code=137, time=T0 + 1
    )
    rest = tuple(p for p in snap.processes if p.pid != victim)
    dead = dataclasses.replace(snap, time=T0 + 1, processes=rest, worker_deaths=(death,))
    seen: list[str] = []

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        seen.append(app.main_screen.query_one("#table", WorkerTable).text)

    drive(make(FakeSource([snap, dead])), scenario)
    assert "exit 137" in seen[0], seen[0]


def _loader(lid: str, name: str, rate: float, pids: tuple[int, ...]) -> LoaderSample:
    return LoaderSample(
        id=lid,
        name=name,
        pid=MAIN_PID,
        num_workers=len(pids),
        batch_size=32,
        pin_memory=False,
        persistent_workers=False,
        prefetch_factor=2,
        batches_total=1000,
        batches_per_s=rate,
        samples_per_s=rate * 32,
        data_wait_fraction=0.1,
        worker_pids=pids,
        batches_per_worker=(),
    )


def test_the_throughput_chart_plots_the_live_loaders_busiest_first() -> None:
    """A loader that ended (the first one ever seen) is not plotted; the two live ones are,
    the busiest first."""
    snaps: list[Snapshot] = []
    for k in range(40):
        t = T0 - 200 + 5 * k
        base = make_snapshot(t, interval=5.0)
        if k < 10:
            loaders: tuple[LoaderSample, ...] = (_loader("L-old", "oldval.py:1", 3.0, ()),)
        else:
            loaders = (
                _loader("L-slow", "slowval.py:2", 2.0, ()),
                _loader("L-fast", "fasttrain.py:3", 40.0, ()),
            )
        snaps.append(dataclasses.replace(base, loaders=loaders))
    labels: list[tuple[str, ...]] = []

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        chart = app.main_screen.query_one("#throughput-chart", TimeChart)
        labels.append(chart.plotted_labels)

    drive(make(FakeSource(snaps)), scenario)
    assert labels[0][:2] == ("batch/s fasttrain.py:3", "data wait % fasttrain.py:3"), labels
    assert not any("oldval" in name for name in labels[0]), labels


def test_the_advice_window_says_the_span_it_really_read() -> None:
    """The advice screen names the span of history it was computed from (the bounded history)."""
    seen: list[str] = []
    snaps = run_of(1200, 5.0)  # 241 snapshots: more than the history holds

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await pilot.press("a")
        assert isinstance(app.screen, AdviceScreen)
        seen.append(str(app.screen.query_one("#help-box").border_title))

    drive(make(FakeSource(snaps)), scenario)
    span = (HISTORY_CAPACITY - 1) * 5.0
    assert f"{HISTORY_CAPACITY} snapshots" in seen[0], seen
    assert "9m55s" in seen[0] and span == 595.0, seen


def test_the_memory_panel_trend_is_the_growth_rules_not_a_slope_of_its_own() -> None:
    """A job whose PSS rose over the window but which the memory_growth rule did not call growth
    (no alert): the Trend line reads the rule, so no "+X/min" of its own, before or after the
    rule's warm-up."""
    state = DashboardState()
    texts = []
    for k in range(61):
        s = make_snapshot(T0 - 300 + 5 * k, interval=5.0, alerts=False)
        m = dataclasses.replace(s.memory, pss_sum_bytes=(1 + k) * 64 * 2**20, pss_anon_sum_bytes=None)
        state.ingest(dataclasses.replace(s, memory=m))
        if k in (6, 60):
            texts.append("\n".join(text_of(line) for line in memory_lines(state, 160, False)))
    assert "none yet (warm-up, 1m30s left)" in texts[0] and "/min" not in texts[0], texts[0]
    assert "Trend   PSS no growth" in texts[1] and "/min" not in texts[1], texts[1]
    reading = memory_trend(state)
    assert reading.state == "no_growth" and reading.rate_bytes_per_s is None


def test_the_memory_panel_shows_the_growth_alert_eta_when_there_is_one() -> None:
    state = DashboardState()
    for k in range(61):
        s = make_snapshot(T0 - 300 + 5 * k, interval=5.0, alerts=False)
        alert = Alert(
            kind="memory_growth",
            severity="warning",
            subject="job",
            message="grew",
            advice="look",
            since=T0 - 100,
            evidence={"eta_s": 2 * 3600.0 + 5 * 60, "rate_bytes_per_s": 3 * 2**20 / 60, "window_s": 600.0},
        )
        state.ingest(dataclasses.replace(s, alerts=(alert,)))
    text = "\n".join(text_of(line) for line in memory_lines(state, 160, False))
    assert "+3.0 MiB/min · limit in ~2h05m (memory_growth, last 10m00s)" in text, text


# ---- 2. quitting the demo ends the synthetic training by default ----------------------------------
@pytest.mark.parametrize(
    ("stop_by_default", "keys", "stop"),
    [(True, ("q", "enter"), True), (True, ("q", "l"), False), (False, ("q", "enter"), False)],
)
def test_the_quit_question_default_depends_on_whose_training_it_is(
    stop_by_default: bool, keys: tuple[str, ...], stop: bool
) -> None:
    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await pilot.press(*keys)

    app = make(FakeSource([make_snapshot()]), ask_stop_on_quit=True, stop_by_default=stop_by_default)
    result = drive(app, scenario)
    assert result is not None and result.quit_by_user and result.stop_training is stop


# ---- 3. the training's own output -------------------------------------------------------------
def test_the_training_output_is_shown_by_default_bounded_with_tqdm_as_one_line(tmp_path: Path) -> None:
    """`dlmon run`: the last lines of the log in a small pane from the start; 24,000 lines
    written while the pane is hidden (another panel in full) reach the widget as one screenful;
    a tqdm bar redrawn with \\r is one updating line."""
    log = tmp_path / "train.log"
    log.write_text("loading data\n")
    source = FakeSource([make_snapshot()], log_path=str(log))
    seen: dict[str, object] = {}

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        main = app.main_screen
        await settle(pilot)
        pane = main.query_one("#logs")
        assert pane.display and pane.region.height >= 3
        view = main.query_one("#log", LogView)
        assert "loading data" in view.text
        await pilot.press("2")  # the workers in full: the log pane is hidden
        with log.open("a") as fh:
            fh.writelines(f"step {k} loss 0.{k:05d}\n" for k in range(24_000))
            fh.write("epoch 3:  10%|#         | 10/100\repoch 3:  55%|#####     | 55/100")
        app._poll_log()
        await pilot.press("2")  # back to the overview
        await settle(pilot)
        seen["buffer"] = len(app.log_lines)
        seen["shown"] = view.text.splitlines()
        seen["height"] = view.size.height
        with log.open("a") as fh:
            fh.write("\repoch 3: 100%|##########| 100/100\n")
        app._poll_log()
        await settle(pilot)
        seen["after"] = view.text.splitlines()

    drive(make(source), scenario, (160, 50))
    assert isinstance(seen["buffer"], int) and seen["buffer"] <= LOG_KEEP
    shown = seen["shown"]
    assert isinstance(shown, list) and len(shown) <= int(str(seen["height"]))
    assert shown[-1] == "epoch 3:  55%|#####     | 55/100", shown  # the progress line, as it is now
    assert shown[-2] == "step 23999 loss 0.23999", shown
    after = seen["after"]
    assert isinstance(after, list) and after[-1] == "epoch 3: 100%|##########| 100/100", after
    assert not any("10/100" in line for line in after)


def test_the_log_pane_says_the_file_size_on_disk(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_bytes(b"x" * 3000 + b"\n")
    source = FakeSource([make_snapshot()], log_path=str(log))
    captions: list[str] = []

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        captions.append(str(app.main_screen.query_one("#logs", Panel).border_subtitle))

    drive(make(source), scenario, (160, 50))
    assert "train.log" in captions[0] and "2.9 KiB on disk" in captions[0], captions


# ---- 4. charts scaled to the job -----------------------------------------------------------------
TiB = 1024 * GiB


def _big_host(limit: int | None) -> list[Snapshot]:
    out = []
    for s in run_of(900, 5.0):
        m = dataclasses.replace(
            s.memory,
            total_bytes=2 * TiB,
            available_bytes=int(1.9 * TiB),
            used_bytes=int(0.1 * TiB),
            cgroup_limit_bytes=limit,
        )
        cg = dataclasses.replace(s.cgroup, limit_bytes=limit) if s.cgroup is not None else None
        out.append(dataclasses.replace(s, memory=m, cgroup=cg))
    return out


@pytest.mark.parametrize("limit", [None, 16 * GiB, 1 * TiB])
def test_the_memory_chart_plots_the_job_on_its_own_scale(limit: int | None) -> None:
    """On a 2 TiB host the chart's axis fits the job's PSS (~7 GiB, growing), not the machine;
    the cgroup limit shares the axis only when it is within reach of the job."""
    seen: dict[str, object] = {}

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        chart = app.main_screen.query_one("#memory-chart", TimeChart)
        seen["labels"], seen["range"], seen["unit"] = chart.plotted_labels, chart.y_range, chart.unit
        seen["text"] = app.main_screen.query_one("#memory-lines", LinesView).text

    drive(make(FakeSource(_big_host(limit))), scenario, (160, 50))
    labels = seen["labels"]
    assert isinstance(labels, tuple) and "available" not in labels and labels[0] == "job PSS"
    assert ("cgroup limit" in labels) is (limit == 16 * GiB), labels
    lo, hi = seen["range"]  # type: ignore[misc]
    assert seen["unit"] == "GiB"
    if limit == 16 * GiB:
        assert 16 <= hi < 20, (lo, hi)
    else:  # the job's PSS (7.2 -> 7.4 GiB over the run) fills the axis: its growth shows
        assert 6.5 < lo < 7.3 and 7.3 < hi < 8.0, (lo, hi)
    assert "2.0 TiB" in str(seen["text"])  # the machine's figures stay in the text


# ---- 5. layout under load -------------------------------------------------------------------------
def test_a_big_ddp_box_keeps_every_panel_useful_at_160x50() -> None:
    """8 GPUs, 6 disks, 64 workers: the Throughput panel keeps its chart; the GPUs, disks and
    loaders that do not fit collapse to a "+N more" line."""
    snaps = [make_ddp_snapshot(T0 - (60 - k) * 5.0, interval=5.0) for k in range(61)]
    seen: dict[str, object] = {}

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        main = app.main_screen
        seen["throughput"] = main.query_one("#throughput").region.height
        seen["chart"] = main.query_one("#throughput-chart").region.height
        seen["workers"] = main.query_one("#workers").region.height
        for panel in ("gpu", "io", "throughput"):
            seen[panel + "-text"] = main.query_one(f"#{panel}-lines", LinesView).text

    drive(make(FakeSource(snaps)), scenario, (160, 50))
    assert int(str(seen["throughput"])) >= 8 and int(str(seen["chart"])) >= 5, seen
    assert int(str(seen["workers"])) >= 8, seen
    assert "+6 more: 2 76%" in str(seen["gpu-text"]), seen["gpu-text"]
    assert "+4 more: nvme2n1" in str(seen["io-text"]), seen["io-text"]
    assert "+6 more loaders" in str(seen["throughput-text"]), seen["throughput-text"]
    assert str(seen["throughput-text"]).startswith("train.py:88 rank 7"), seen["throughput-text"]  # busiest


# ---- 6. a tree for DDP ----------------------------------------------------------------------------
def test_a_ddp_job_reads_as_ranks_with_sums_that_expand_to_their_workers() -> None:
    """8 ranks x 8 workers: 8 groups (folded) with PSS, batches/s and data wait per rank;
    space on a rank shows its workers under it, space again folds them."""
    seen: dict[str, str] = {}

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        tbl = app.main_screen.query_one("#table", WorkerTable)
        seen["folded"] = tbl.text
        seen["caption"] = tbl.caption
        for _ in range(6):  # main, rank 0..4: the cursor on the sixth rank (pid 5005)
            await pilot.press("down")
        await pilot.press("space")
        await settle(pilot)
        seen["open"] = tbl.text
        await pilot.press("down", "down", "space")  # from one of its workers: folds the rank
        await settle(pilot)
        seen["refolded"] = tbl.text

    drive(make(FakeSource([make_ddp_snapshot()])), scenario, (160, 50))
    folded = seen["folded"].splitlines()
    assert sum(1 for line in folded if line.lstrip().startswith("worker")) == 0, seen["folded"]
    assert sum(1 for line in folded if line.startswith("rank ")) == 8, seen["folded"]
    sums = [line for line in folded if "▸ 8 workers" in line]
    assert len(sums) == 8, seen["folded"]
    rank5 = folded[folded.index(next(li for li in folded if " 5005 " in li)) + 1]
    assert "PSS 9.08G" in rank5 and "8.5 batch/s" in rank5 and "data wait 25%" in rank5, rank5
    assert "73 processes" in seen["caption"] and "8 ranks" in seen["caption"]
    opened = seen["open"].splitlines()
    i = opened.index(next(li for li in opened if " 5005 " in li))
    assert "▾ 8 workers" in opened[i + 1]
    assert all(f" {6500 + k} " in opened[i + 2 + k] for k in range(8)), seen["open"]
    assert sum(1 for line in seen["refolded"].splitlines() if line.lstrip().startswith("worker")) == 0


# ---- 7. mouse --------------------------------------------------------------------------------------
def test_clicks_and_the_wheel_move_the_table_and_unfold_ranks() -> None:
    seen: dict[str, object] = {}

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        tbl = app.main_screen.query_one("#table", WorkerTable)
        await pilot.click("#table", offset=(20, 2))  # header, main, rank 5000
        seen["clicked"] = tbl.cursor_key
        await pilot.click("#table", offset=(10, 3))  # the sums line of rank 5000: unfolds it
        await settle(pilot)
        seen["open"] = tbl.text
        for _ in range(2):
            tbl.post_message(MouseScrollDown(tbl, 5, 5, 0, 0, 0, False, False, False))
        await settle(pilot)
        seen["scrolled"] = tbl.cursor_key

    drive(make(FakeSource([make_ddp_snapshot()])), scenario, (160, 50))
    assert seen["clicked"] == ("p", "5000", make_ddp_snapshot().processes[1].start_time)
    assert "▾ 8 workers" in str(seen["open"]) and " 6000 " in str(seen["open"])
    scrolled = seen["scrolled"]
    assert isinstance(scrolled, tuple) and scrolled[0] == "w" and scrolled[2] == 5, scrolled  # 6 rows down


# ---- 8. replay that scales ---------------------------------------------------------------------
def _write_record(path: Path, n: int, step: float = 5.0) -> list[float]:
    """``n`` snapshots; a memory_growth alert from the 100th, an io_saturation one from the 200th."""
    times = []
    with path.open("w") as fh:
        for k in range(n):
            t = T0 + k * step
            s = make_snapshot(t, interval=step, alerts=False)
            kinds = (["memory_growth"] if k >= 100 else []) + (["io_saturation"] if k >= 200 else [])
            alerts = tuple(
                Alert(kind=kind, severity="warning", subject="job", message="m", advice="a", since=t)
                for kind in kinds
            )
            fh.write(json.dumps(snapshot_to_dict(dataclasses.replace(s, alerts=alerts))) + "\n")
            times.append(t)
    return times


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_replay_streams_the_file_and_seeks_with_an_index_built_while_playing(tmp_path: Path) -> None:
    """The first frame comes after one line is read (not the whole file); the next alert and a
    seek back land on the right snapshot; a seek back reads from an indexed offset."""
    path = tmp_path / "rec.jsonl"
    times = _write_record(path, 600)
    source = ReplaySource(str(path), speed=1e-9)  # one frame, then wait: we drive it
    got: list[Snapshot] = []
    seeks: list[float] = []
    source.on_seek = seeks.append
    source.start(got.append, lambda reason: None)
    try:
        _wait(lambda: len(got) == 1, "the first frame")
        assert source.snapshots_read <= 2  # streamed: the other 598 lines are not read yet
        source.next_alert()
        _wait(lambda: len(got) == 2, "the first alert")
        assert got[1].time == times[100] and seeks == [times[100]]
        source.next_alert()
        _wait(lambda: len(got) == 3, "the next alert")
        assert got[2].time == times[200]
        assert source.snapshots_read <= 202 and len(source.index) >= 3  # an offset every 64 snapshots
        source.seek(times[150])  # back: from the indexed offset at or before it, not the start
        _wait(lambda: len(got) == 4, "the seek back")
        assert got[3].time == times[150] and seeks[-1] == times[150]
        assert source.position == times[150]
    finally:
        source.stop()


def test_the_replay_dashboard_jumps_to_the_next_alert_with_a_fresh_history(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    times = _write_record(path, 300)
    seen: dict[str, object] = {}

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        seen["before"] = app.state.count
        await pilot.press("right_square_bracket")
        for _ in range(200):
            await pilot.pause(0.05)
            if app.state.latest is not None and app.state.latest.time == times[100]:
                break
        await settle(pilot)
        seen["latest"] = app.state.latest.time if app.state.latest is not None else None
        seen["count"] = app.state.count
        seen["alerts"] = app.main_screen.query_one("#alerts-lines", LinesView).text

    app = create_app(ReplaySource(str(path), speed=1e-9), clock=fixed_clock, boot_time=BOOT)
    drive(app, scenario, (160, 50))
    assert seen["before"] == 1 and seen["latest"] == times[100] and seen["count"] == 1, seen
    assert "memory_growth" in str(seen["alerts"])


@pytest.mark.parametrize("size", [(80, 24), (60, 20), (160, 50)])
def test_the_log_pane_fits_every_size_without_overlap(tmp_path: Path, size: tuple[int, int]) -> None:
    log = tmp_path / "train.log"
    log.write_text("".join(f"line {k}\n" for k in range(50)))

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        main = app.main_screen
        boxes = [p.region for p in main.query(Panel) if p.display and p.region.area]
        for i, a in enumerate(boxes):
            assert a.right <= size[0] and a.bottom <= size[1], (a, size)
            for b in boxes[i + 1 :]:
                assert not a.overlaps(b), (a, b)
        assert main.query_one("#table").region.height >= 3
        assert "line 49" in main.query_one("#log", LogView).text

    drive(make(FakeSource(run_of(60, gpus=2), log_path=str(log))), scenario, size)


def test_the_log_buffer_keeps_a_bounded_head_of_each_huge_line(tmp_path: Path) -> None:
    """A training that prints a 200 KB line per step (a JSON blob, a tensor on one line): the
    buffer keeps 2,000 lines, but each used to be kept whole (up to 500 MB for the buffer); the
    pane shows only a screen's width of each anyway."""
    log = tmp_path / "train.log"
    log.write_text("start\n")
    seen: dict[str, object] = {}

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        for k in range(30):
            with log.open("a") as fh:
                fh.write(f"step {k} " + "x" * 200_000 + "\n")
            app._poll_log()
        await settle(pilot)
        seen["longest"] = max(len(line) for line in app.log_lines)
        seen["shown"] = app.main_screen.query_one("#log", LogView).text.splitlines()

    drive(make(FakeSource([make_snapshot()], log_path=str(log))), scenario, (160, 50))
    longest = seen["longest"]
    assert isinstance(longest, int) and longest <= 4096, longest
    shown = seen["shown"]
    assert isinstance(shown, list) and shown[-1].startswith("step 29 xxx") and shown[-1].endswith("…"), shown[
        -1:
    ]


@pytest.mark.parametrize("size", [(160, 50), (120, 36)])
def test_the_cursor_stays_on_screen_on_the_last_folded_rank(size: tuple[int, int]) -> None:
    """8 folded ranks take two lines each (the rank and its sums): the table scrolled by rows,
    not by lines, so ``end`` put the cursor below the table's bottom edge, out of sight."""
    seen: dict[str, object] = {}

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        tbl = app.main_screen.query_one("#table", WorkerTable)
        tbl.focus()
        await pilot.press("end")
        await settle(pilot)
        seen["height"] = tbl.size.height
        seen["cursor_line"] = next(
            i for i, line in enumerate(tbl.lines) if line and line[0][1] in ("cursor", "cursor-blur")
        )
        seen["cursor"] = tbl.cursor_key
        seen["text"] = tbl.text

    drive(make(FakeSource([make_ddp_snapshot()])), scenario, size)
    cursor = seen["cursor"]
    assert isinstance(cursor, tuple) and cursor[:2] == ("p", "5007"), cursor
    assert isinstance(seen["cursor_line"], int) and isinstance(seen["height"], int)
    assert seen["cursor_line"] < seen["height"], seen


def _chart_colours(chart: TimeChart) -> set[object]:
    """The colours of the plot's lines as drawn (ANSI number or RGB triplet)."""
    text = chart.render()
    assert not isinstance(text, str) and hasattr(text, "spans")
    out: set[object] = set()
    for span in text.spans:
        colour = getattr(span.style, "color", None)
        if colour is not None:
            out.add(colour.number if colour.triplet is None else tuple(colour.triplet))
    return out


def test_chart_lines_take_their_colours_from_the_stylesheet() -> None:
    """Issue 12: chart colours were Python literals (and "yellow", no plotext colour, drew the
    anon and read lines uncoloured). They are component classes of dlmon.tcss: the PSS line is
    the terminal's cyan, and a stylesheet rule recolours it."""
    seen: dict[str, object] = {}

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        chart = app.main_screen.query_one("#memory-chart", TimeChart)
        seen["default"] = {kind: chart.line_colour(kind) for kind in ("pss", "anon", "limit")}
        seen["every"] = {kind: chart.line_colour(kind) for kind in CHART_LINE_KINDS}
        seen["drawn"] = _chart_colours(chart)
        app.stylesheet.add_source("TimeChart > .timechart--pss { color: #ff0000; }", ("test", "recolour"))
        app.refresh_css()
        app.refresh_view(True)
        await settle(pilot)
        seen["after"] = chart.line_colour("pss")
        seen["drawn_after"] = _chart_colours(chart)

    drive(make(FakeSource(_big_host(16 * GiB))), scenario, (160, 50))
    assert seen["default"] == {"pss": 6, "anon": 3, "limit": 1}
    every = seen["every"]
    assert isinstance(every, dict) and all(isinstance(c, int) for c in every.values()), every  # a rule each
    assert 6 in seen["drawn"]  # type: ignore[operator]
    assert seen["after"] == (255, 0, 0)
    drawn_after = seen["drawn_after"]
    assert isinstance(drawn_after, set) and (255, 0, 0) in drawn_after and 6 not in drawn_after


def _chart_rgb(chart: TimeChart) -> set[tuple[int, int, int]]:
    """The RGB colours (text and background) the chart's plot paints."""
    text = chart.render()
    assert not isinstance(text, str) and hasattr(text, "spans")
    out: set[tuple[int, int, int]] = set()
    for span in text.spans:
        for colour in (getattr(span.style, "color", None), getattr(span.style, "bgcolor", None)):
            if colour is not None and colour.triplet is not None:
                out.add(tuple(colour.triplet))
    return out


def test_charts_leave_an_ansi_themes_colours_to_the_terminal() -> None:
    """The ANSI themes of the theme switcher (ansi-dark, ansi-light) set the surface and the text
    colour to the terminal's own ("ansi_default"); textual-plotext read those as RGB black, so the
    chart was a black box with black axis numbers. Under an ANSI theme the plot paints no RGB
    colour (the lines keep their ANSI colours); back on an RGB theme it is on its surface again."""
    seen: dict[str, object] = {}

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await settle(pilot)
        chart = app.main_screen.query_one("#memory-chart", TimeChart)
        for theme in ("ansi-dark", "ansi-light", "nord"):  # nord: an "auto" plot theme not yet made
            app.theme = theme
            await settle(pilot)
            seen[theme] = (_chart_rgb(chart), _chart_colours(chart))
        seen["surface"] = Color.parse(app.theme_variables["surface"]).rgb

    drive(make(FakeSource(_big_host(16 * GiB))), scenario, (160, 50))
    for theme in ("ansi-dark", "ansi-light"):
        rgb, drawn = seen[theme]  # type: ignore[misc]
        assert rgb == set(), (theme, rgb)
        assert 6 in drawn, (theme, drawn)  # the PSS line is still the terminal's cyan
    rgb, drawn = seen["nord"]  # type: ignore[misc]
    assert seen["surface"] in rgb and 6 in drawn, (rgb, drawn)
