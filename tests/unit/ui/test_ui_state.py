"""The dashboard's memory and formatting, without Textual: bounded series, rows, log tail, cells."""

from __future__ import annotations

import dataclasses
import math
import tracemalloc
from pathlib import Path

import pytest

from dlmon.model import LoaderSample, ProcessSample, WorkerDeath
from dlmon.ui.fmt import DASH, cbytes, duration, mbps
from dlmon.ui.logtail import LogTail
from dlmon.ui.series import DEFAULT_TIERS, Ring, Series, chart_step
from dlmon.ui.state import MAX_ROWS, DashboardState
from dlmon.ui.views import (
    COLUMNS,
    memory_lines,
    table_cells,
    table_columns,
    text_of,
)
from support.ui import MAIN_PID, T0, WORKER_PIDS, ZOMBIE_PID, make_snapshot


def test_ring_keeps_the_newest_points_in_order() -> None:
    ring = Ring(3)
    for t in range(5):
        ring.append(float(t), t * 10.0)
    assert list(ring) == [(2.0, 20.0), (3.0, 30.0), (4.0, 40.0)]
    assert ring.since(3.0) == [(3.0, 30.0), (4.0, 40.0)]
    assert ring.first_time() == 2.0 and ring.last() == (4.0, 40.0)


def test_series_is_bounded_and_answers_long_windows_from_coarse_tiers() -> None:
    s = Series()
    for t in range(3 * 3600):  # three hours at 1 Hz
        s.add(float(t), float(t % 100))
    assert s.memory_points() == sum(capacity for _, capacity in DEFAULT_TIERS)
    recent = s.points(3 * 3600 - 60)
    assert len(recent) == 60  # raw points for the last minute
    old = s.points(3600.0)
    assert 100 < len(old) < 400  # an old window comes from the 60 s tier
    buckets = s.resample(0.0, 3 * 3600.0, 600.0)
    assert len(buckets) == 18 and all(abs(v - 49.5) < 1 for _, v in buckets)


def test_series_skips_missing_values_instead_of_storing_zero() -> None:
    s = Series()
    s.add(0.0, None)
    s.add(1.0, 5.0)
    s.add(2.0, None)
    assert s.points(0.0) == [(1.0, 5.0)] and s.latest() == (1.0, 5.0) and s.first_time == 1.0


def test_series_slope() -> None:
    s = Series()
    for t in range(301):
        s.add(float(t), 1000.0 + 2.0 * t)
    slope = s.slope(300.0, 300.0)
    assert slope is not None and math.isclose(slope, 2.0)
    assert Series().slope(300.0, 0.0) is None


def test_chart_step_is_round_never_finer_than_the_interval_and_grows_with_the_run() -> None:
    assert chart_step(10.0, 140, 1.0) == 5  # at least 10 minutes in 140 points
    assert chart_step(10.0, 140, 30.0) == 30
    assert chart_step(6 * 3600.0, 140, 1.0) == 300
    assert chart_step(10 * 86400.0, 100, 1.0) >= 7200


def test_rows_are_keyed_by_worker_id_across_respawns() -> None:
    state = DashboardState()
    first = make_snapshot()
    state.ingest(first)
    respawned = []
    for p in first.processes:
        if p.role == "worker" and p.state != "Z":
            p = dataclasses.replace(p, pid=p.pid + 100, start_time=p.start_time + 5000)
        respawned.append(p)
    loader = first.loaders[0]
    new_pids = tuple(p.pid for p in respawned if p.role == "worker")
    second = dataclasses.replace(
        first,
        time=T0 + 1,
        processes=tuple(respawned),
        loaders=(dataclasses.replace(loader, worker_pids=new_pids),),
    )
    state.ingest(second)
    assert len(state.rows) == 5  # the same rows, not 5 + 3
    row = state.rows[("w", "loader-1", 0)]
    assert row.process.pid == WORKER_PIDS[0] + 100 and row.pids_seen == 2
    assert len(row.pss.points(0.0)) == 2  # one history across both pids


def test_rows_without_worker_ids_use_pid_and_start_time_and_vanish_later() -> None:
    state = DashboardState()
    procs = [
        ProcessSample(pid=100 + i, start_time=i, ppid=1, role="worker", comm="pt_data_worker", state="S")
        for i in range(3)
    ]
    base = make_snapshot(loaders=False)
    state.ingest(dataclasses.replace(base, processes=tuple(procs)))
    state.ingest(dataclasses.replace(base, time=T0 + 1, processes=tuple(procs[:1])))
    gone = [r for r in state.rows.values() if r.gone]
    assert len(gone) == 2 and {r.key for r in gone} == {("p", "101", 1), ("p", "102", 2)}
    state.ingest(dataclasses.replace(base, time=T0 + 120, processes=tuple(procs[:1])))
    assert len(state.rows) == 1


def test_a_dead_worker_keeps_its_row_with_the_signal() -> None:
    state = DashboardState()
    snap = make_snapshot(zombie=False)
    state.ingest(snap)
    victim = WORKER_PIDS[1]
    death = WorkerDeath(pid=victim, worker_id=1, loader_id="loader-1", signal=9, exit_code=None, time=T0 + 1)
    rest = tuple(p for p in snap.processes if p.pid != victim)
    state.ingest(dataclasses.replace(snap, time=T0 + 1, processes=rest, worker_deaths=(death,)))
    row = state.rows[("w", "loader-1", 1)]
    assert row.gone and row.death == death
    cols = table_columns(200, batches=True, gpu=False)
    cells = text_of(table_cells(row, cols, 1.0))
    assert "killed" in cells and " 0B" not in cells
    state.ingest(dataclasses.replace(snap, time=T0 + 200, processes=rest, worker_deaths=(death,)))
    assert ("w", "loader-1", 1) in state.rows  # a death stays visible longer than a plain exit


def test_sorting_puts_missing_values_last_in_both_directions() -> None:
    state = DashboardState()
    state.ingest(make_snapshot())
    by_pss = [r.process.pid for r in state.sorted_rows("pss")]
    assert by_pss[0] == MAIN_PID and by_pss[-1] == ZOMBIE_PID
    reverse = [r.process.pid for r in state.sorted_rows("pss", reverse=True)]
    assert reverse[-1] == ZOMBIE_PID and reverse[0] == WORKER_PIDS[0]
    natural = [r.process.pid for r in state.sorted_rows("id")]
    assert natural == [MAIN_PID, *WORKER_PIDS]


def test_batch_share_comes_from_the_loader() -> None:
    state = DashboardState()
    state.ingest(make_snapshot())
    shares = {r.process.pid: r.batch_share for r in state.rows.values()}
    assert shares[MAIN_PID] is None
    assert shares[WORKER_PIDS[0]] == pytest.approx(4000 / 12300)
    assert shares[ZOMBIE_PID] == 0.0


def test_the_state_stays_bounded_over_a_long_run_with_churning_workers() -> None:
    """Non-persistent workers without the agent: a new (pid, start_time) every epoch."""
    state = DashboardState()
    base = make_snapshot(loaders=False, alerts=False)
    main = base.processes[0]
    tracemalloc.start()
    try:
        for k in range(4000):
            epoch = k // 50
            workers = tuple(
                ProcessSample(
                    pid=10_000 + epoch * 8 + i,
                    start_time=epoch,
                    ppid=MAIN_PID,
                    role="worker",
                    comm="pt_data_worker",
                    state="S",
                    rss_bytes=1 << 30,
                    pss_bytes=1 << 28,
                    cpu_percent=50.0,
                )
                for i in range(8)
            )
            state.ingest(dataclasses.replace(base, time=T0 + k, processes=(main, *workers)))
            if k == 1000:
                early, _ = tracemalloc.get_traced_memory()
        late, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(state.rows) <= MAX_ROWS and len(state.history) <= state.history.capacity
    assert late - early < 4 * 1024 * 1024, (early, late)  # flat after the first minutes


def test_compact_cells() -> None:
    assert cbytes(None) == DASH and cbytes(0) == "0B" and cbytes(512) == "512B"
    assert cbytes(1536) == "1.50K" and cbytes(123 * 1024**2) == "123M" and cbytes(1.5 * 1024**3) == "1.50G"
    assert mbps(None) == DASH and mbps(0.0) == "0.0" and mbps(142.3e6) == "142"
    assert duration(45) == "45s" and duration(3723) == "1h02m" and duration(None) == "n/a"


def test_table_drops_low_priority_columns_when_narrow() -> None:
    wide = table_columns(200, batches=True, gpu=True)
    assert [c.key for c in wide] == [c.key for c in COLUMNS]
    narrow = table_columns(60, batches=True, gpu=True)
    keys = [c.key for c in narrow]
    assert {"role", "pid", "state", "pss", "cpu"} <= set(keys) and "thr" not in keys
    assert sum(c.width for c in narrow) + len(narrow) - 1 <= 60


def test_memory_summary_reports_missing_figures_as_na() -> None:
    state = DashboardState()
    snap = make_snapshot()
    memory = dataclasses.replace(
        snap.memory, pss_sum_bytes=None, cgroup_limit_bytes=None, available_bytes=None
    )
    state.ingest(dataclasses.replace(snap, memory=memory, shm=None, cgroup=None))
    text = "\n".join(text_of(line) for line in memory_lines(state, 200, False))
    assert "PSS n/a" in text and "avail n/a" in text and "/dev/shm n/a" in text
    assert "cgroup" not in text and "0 B (true total)" not in text


def test_log_tail_reads_incrementally_and_bounded(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    log.write_bytes(b"one\ntw")
    tail = LogTail(str(log), max_read=64)
    assert tail.poll() == ["one"] and tail.partial == "tw"
    with log.open("ab") as fh:
        fh.write(b"o\n\x1b[31mred\x1b[0m\n")
    assert tail.poll() == ["two", "red"]
    assert tail.poll() == []
    with log.open("ab") as fh:
        fh.write(b"x" * 200 + b"\nlast\n")
    lines = tail.poll()
    assert lines[0].startswith("[dlmon: skipped") and lines[-1] == "last"
    log.write_bytes(b"new\n")  # truncated and rewritten
    lines = tail.poll()
    assert "truncated" in lines[0] and lines[-1] == "new"
    assert LogTail(str(tmp_path / "missing")).poll() == []


def test_loader_history_is_kept_per_loader() -> None:
    state = DashboardState()
    snap = make_snapshot()
    other = LoaderSample(
        id="val", name="train.py:99", pid=MAIN_PID, batches_per_s=3.0, data_wait_fraction=0.9
    )
    state.ingest(dataclasses.replace(snap, loaders=(*snap.loaders, other)))
    assert set(state.loaders) == {"loader-1", "val"}
    assert state.loaders["val"].data_wait_percent.latest() == (T0, 90.0)


def test_oom_kills_are_counted_from_when_dlmon_started() -> None:
    state = DashboardState()
    snap = make_snapshot()
    state.ingest(dataclasses.replace(snap, memory=dataclasses.replace(snap.memory, oom_kill_count=9)))
    text = "\n".join(text_of(line) for line in memory_lines(state, 200, False))
    assert "OOM kills 9 since boot" in text
    state.ingest(
        dataclasses.replace(snap, time=T0 + 1, memory=dataclasses.replace(snap.memory, oom_kill_count=10))
    )
    text = "\n".join(text_of(line) for line in memory_lines(state, 200, False))
    assert "OOM kills +1 while watching" in text


def test_processes_read_without_held_fds_are_named_on_screen_and_in_the_line() -> None:
    """Past the fd limit the sampler degrades; the user must see that it did, and how far."""
    from dlmon.model.format import one_line

    state = DashboardState()
    snap = dataclasses.replace(make_snapshot(), processes_without_held_fds=40)
    state.ingest(snap)
    text = "\n".join(text_of(line) for line in memory_lines(state, 200, False))
    assert "fd limit: 40 processes read without held fds" in text
    assert "fd limit: 40 processes read without held fds" in one_line(snap)
    quiet = DashboardState()
    quiet.ingest(make_snapshot())
    assert "fd limit" not in "\n".join(text_of(line) for line in memory_lines(quiet, 200, False))


def test_workers_read_in_rotation_are_named_on_screen_with_how_stale_a_row_may_be() -> None:
    """A tree too big for the sampler's budget: rows may be a few ticks old, and the user sees so."""
    state = DashboardState()
    snap = dataclasses.replace(make_snapshot(), rotation_ticks=3, processes_in_rotation=80, interval_s=1.0)
    state.ingest(snap)
    text = "\n".join(text_of(line) for line in memory_lines(state, 200, False))
    assert "large tree: workers read every 3 ticks (~3 s)" in text
    quiet = DashboardState()
    quiet.ingest(make_snapshot())
    assert "large tree" not in "\n".join(text_of(line) for line in memory_lines(quiet, 200, False))


@pytest.mark.parametrize(
    ("severities", "style"),
    [
        (("info", "critical", "warning"), "crit"),
        (("warning", "info"), "warn"),
        (("info",), "dim"),
        (("someday", "info"), "dim"),  # a severity this dlmon does not know counts least
        (("someday", "warning"), "warn"),
    ],
)
def test_the_header_styles_the_alert_count_by_its_worst(severities: tuple[str, ...], style: str) -> None:
    from dlmon.model import Alert
    from dlmon.ui.views import HeaderInfo, header_line, sorted_alerts

    alerts = [Alert("k", sev, f"s{i}", "m", "a", T0 - i) for i, sev in enumerate(severities)]
    state = DashboardState()
    state.ingest(dataclasses.replace(make_snapshot(), alerts=alerts))
    info = HeaderInfo("job", True, False, T0, None, 100, 1.0, None)
    spans = [span for span in header_line(state, info, 200) if "alert" in span[0]]
    assert spans == [(f"{len(alerts)} alert" + ("" if len(alerts) == 1 else "s"), style)]
    order = [a.severity for a in sorted_alerts(alerts)]
    assert order == sorted(severities, key=["critical", "warning", "info", "someday"].index)


@pytest.mark.parametrize(
    ("signal", "word"),
    [
        (1, "SIGHUP"),
        (2, "SIGINT"),
        (13, "SIGPIPE"),
        (8, "SIGFPE"),
        (4, "SIGILL"),
        (9, "killed"),
        (40, "signal 40"),
    ],
)
def test_a_dead_workers_state_names_its_signal(signal: int, word: str) -> None:
    """The STATE cell names the signal as the alerts do (model.format.signal_name); SIGKILL,
    the OOM killer's, reads "killed"."""
    from dlmon.model.format import signal_name
    from dlmon.ui.columns import row_state
    from dlmon.ui.state import ProcessRow

    snap = make_snapshot(zombie=False)
    death = WorkerDeath(
        pid=WORKER_PIDS[1], worker_id=1, loader_id="loader-1", signal=signal, exit_code=None, time=T0
    )
    row = ProcessRow(("w", "loader-1", 1), snap.processes[1], 0, T0, T0, gone=True, death=death)
    assert row_state(row) == (word, "crit")
    assert signal_name(signal) == (word if signal != 9 else "SIGKILL")


def test_the_cuda_pinned_pool_is_shown_with_its_part_in_use_and_counted_in_the_trainers_shm() -> None:
    """Issue 24 item 4: the pool and the part in use, and the word that shm includes the pool
    (cudaHostAlloc memory is RssShmem); VmLck/VmPin are named for what they are."""
    from dlmon.model import PinnedMemory
    from dlmon.ui.views import detail_lines

    MiB = 1 << 20
    pinned = PinnedMemory(512 * MiB, "torch.cuda.host_memory_stats:allocated_bytes.current", 96 * MiB)
    state = DashboardState()
    state.ingest(dataclasses.replace(make_snapshot(), pinned=pinned))
    text = "\n".join(text_of(line) for line in memory_lines(state, 200, False))
    assert "pinned pool 512.0 MiB (96.0 MiB in use)" in text, text
    assert "the trainer's shm includes its pinned pool" in text
    compact = "\n".join(text_of(line) for line in memory_lines(state, 200, True))
    assert "shm counts the pinned pool" in compact, compact
    row = state.rows[next(k for k, r in state.rows.items() if r.process.pid == MAIN_PID)]
    detail = "\n".join(text_of(x) for x in detail_lines(row, state.latest, 200))
    assert "mlocked " in detail and "RDMA pins " in detail and "pinned " not in detail, detail
    # no pool (a CPU-only job, or an agent that does not say): no note
    for none in (None, PinnedMemory(0, "torch.cuda.host_memory_stats:allocated_bytes.current", 0)):
        quiet = DashboardState()
        quiet.ingest(dataclasses.replace(make_snapshot(), pinned=none))
        text = "\n".join(text_of(line) for line in memory_lines(quiet, 200, False))
        assert "includes its pinned pool" not in text, text
