"""``dlmon cluster``'s trends (each node's batches/s and data wait over ``--trend``) in the direct
form, and the straggler held across refreshes: real dlmon exporters served on loopback, read by
the command's own reader, their snapshots changed between refreshes. (The Prometheus form's
range queries are tested on the real two-node job in test_cluster.py; their choice of loader at
the end of this file, on a real Prometheus scraping these exporters.)"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dlmon.cluster.command import ClusterOptions, as_dict, node_cells, reader, table
from dlmon.cluster.trend import POINTS, History, bucketed, slots, sparkline
from dlmon.collect.sampler import Sampler
from dlmon.export.prometheus import Address, Exporter, Server, serve
from dlmon.model import Alert, LoaderSample, Snapshot
from support.export import dlmon_cmd, free_port, kill_group, wait_for


@pytest.fixture(scope="module")
def snapshot() -> Snapshot:
    sampler = Sampler(os.getpid())
    try:
        return sampler.sample()
    finally:
        sampler.close()


def _ranked(snapshot: Snapshot, rank: int, wait: float, rate: float = 20.0) -> Snapshot:
    loader = LoaderSample(
        id=f"{100 + rank}:1",
        name="train.py:40",
        pid=100 + rank,
        num_workers=2,
        batches_total=500,
        batches_per_s=rate,
        data_wait_fraction=wait,
        wall_wait_fraction=wait,
        rank=rank,
        local_rank=0,
        node_rank=rank,
        world_size=2,
    )
    return dataclasses.replace(
        snapshot, loaders=(loader,), alerts=(), disks=(), host=f"n{rank}", time=time.time()
    )


@dataclasses.dataclass
class Fleet:
    exporters: list[Exporter]
    servers: list[Server]
    snapshot: Snapshot

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(f"127.0.0.1:{s.port}" for s in self.servers)

    def set(self, waits: tuple[float, float], rates: tuple[float, float] = (20.0, 20.0)) -> None:
        """Both nodes' exporters now serve these loader waits and batch rates (ranks 0 and 1)."""
        for rank, exporter in enumerate(self.exporters):
            exporter(_ranked(self.snapshot, rank, waits[rank], rates[rank]))


@pytest.fixture
def fleet(snapshot: Snapshot) -> Iterator[Fleet]:
    exporters = [Exporter(), Exporter()]
    found = Fleet(exporters, [], snapshot)
    found.set((0.05, 0.05))
    found.servers = [serve(e, Address("127.0.0.1", 0)) for e in exporters]
    try:
        yield found
    finally:
        for server in found.servers:
            server.close()


def test_the_direct_form_keeps_each_node_s_trend_across_refreshes(fleet: Fleet) -> None:
    read = reader(ClusterOptions(fleet.nodes, None, None, None, 5.0, 0.0, trend_s=20.0))
    first = read()
    assert first.trend_step_s == 1.0
    for node in first.nodes:  # one refresh: one slot measured, the rest not yet
        assert node.batches_per_s_trend is not None and len(node.batches_per_s_trend) == 20
        assert [p for p in node.batches_per_s_trend if p is not None] == [20.0]
    for rate in (10.0, 5.0):
        time.sleep(1.1)
        fleet.set((0.05, 0.05), (rate, rate))
        view = read()
    trend = view.nodes[0].batches_per_s_trend
    # oldest first, each slot the mean of the refreshes in it (slots as long as the refreshes' gaps)
    measured = [p for p in trend or () if p is not None]
    assert len(measured) >= 2 and measured == sorted(measured, reverse=True), trend
    assert measured[0] > measured[-1] and trend is not None and trend[-1] == measured[-1] <= 7.5
    assert all(n.data_wait_trend is not None and n.data_wait_trend[-1] == 0.05 for n in view.nodes)
    cells = node_cells(view.nodes[0])
    assert cells[2].lstrip()[0] == "█" and " " not in cells[2].strip(), cells  # the node's own top; no gap
    assert cells[4].strip() == "▁" * len(cells[4].strip()), cells
    data = json.loads(json.dumps(as_dict(view)))
    assert [p for p in data["nodes"][0]["batches_per_s_trend"] if p is not None] == measured
    assert data["trend_step_s"] == view.trend_step_s and view.trend_step_s is not None
    assert "batch/s trend" in table(view).splitlines()[1]


def test_a_node_with_no_range_data_shows_n_a(fleet: Fleet) -> None:
    closed = fleet.nodes[0].rsplit(":", 1)[0] + ":1"
    view = reader(ClusterOptions((fleet.nodes[0], closed), None, None, None, 5.0, 0.0))()
    answered = next(n for n in view.nodes if n.answered)
    assert answered.batches_per_s_trend is not None
    silent = next(n for n in view.nodes if not n.answered)
    assert silent.batches_per_s_trend is None and silent.data_wait_trend is None
    no_history = dataclasses.replace(answered, batches_per_s_trend=None, data_wait_trend=None)
    cells = node_cells(no_history)
    assert (cells[2], cells[4]) == ("n/a", "n/a")


def test_the_trend_stays_bounded_however_long_the_window_and_many_the_refreshes() -> None:
    week = slots(7 * 24 * 3600, 1e9)
    assert week.count == POINTS and week.step_s == 7 * 24 * 3600 / POINTS
    history = History(600.0, keep=100)
    for i in range(10_000):
        where, trends = history.record(1000.0 + i * 0.05, [("n:1", float(i), 0.5)])
    trend = trends["n:1"]
    assert trend.batches_per_s is not None and len(trend.batches_per_s) == POINTS
    assert len(history._seen["n:1"]) <= 100 + 2
    # a range query's evaluation times land in their own slots, to the millisecond
    assert bucketed([(where.end - where.step_s + 0.0004, 1.0)], where, at_ends=True) == (None,) * 18 + (
        1.0,
        None,
    )
    assert sparkline((None, 0.0, 0.5, 1.0), top=1.0) == " ▁▅█"


def test_refreshes_further_apart_than_a_slot_leave_no_blank_slots() -> None:
    """--trend 60 (20 slots of 3 s) read every 4 s (a refresh of 2 s of scrapes, 2 s apart): a
    slot between two refreshes stood blank, a sparkline with a hole every few characters."""
    history = History(60.0)
    for i in range(30):
        where, trends = history.record(1000.0 + 4.0 * i, [("n:1", 10.0, 0.5)])
    assert where.step_s == 4.0 and where.count == 15
    assert trends["n:1"].batches_per_s == (10.0,) * 15
    assert sparkline(trends["n:1"].data_wait, top=1.0) == "▅" * 15


def test_a_long_trend_read_often_fills_every_slot_within_a_bounded_history() -> None:
    """--trend 3600 read every 2 s: 1 800 refreshes a window. History kept the last 1 000 readings
    a node, so the oldest 9 slots never filled (blank, as if the node had not answered) while 512
    nodes held 512 000 readings, all bucketed again at every refresh; readings closer together than
    a quarter of a slot are now kept as one."""
    history = History(3600.0)
    for i in range(1900):
        where, trends = history.record(1000.0 + 2.0 * i, [("n:1", float(i % 7), 0.5)])
    assert where.count == POINTS and where.step_s == 180.0
    rates = trends["n:1"].batches_per_s
    assert rates is not None and all(p is not None for p in rates), rates
    assert all(2.0 < p < 4.0 for p in rates if p is not None), rates  # each slot the mean of its 90
    assert trends["n:1"].data_wait == (0.5,) * POINTS
    assert len(history._seen["n:1"]) <= 4 * POINTS + 2


# --- the straggler held across refreshes -----------------------------------------------------------


def _named(read_waits: list[tuple[float, float]], fleet: Fleet) -> list[int | None]:
    """The straggler's rank at each refresh, the two nodes serving these loader waits in turn."""
    read = reader(ClusterOptions(fleet.nodes, None, None, None, 5.0, 0.0, trend_s=10.0))
    out: list[int | None] = []
    for waits in read_waits:
        fleet.set(waits)
        view = read()
        out.append(None if view.straggler is None else view.straggler.rank)
    return out


def test_a_straggler_at_the_edge_of_the_rule_does_not_flicker(fleet: Fleet) -> None:
    """A rank waiting 35% then 25% of its loader time (the other rank 2%), in turn: the rule names
    it at 30%, and a rank once named stays named at the local detector's hold thresholds (20%, 15
    points) while it stays the slowest; it went on and off at each refresh."""
    assert _named([(0.02, 0.35), (0.02, 0.25), (0.02, 0.35), (0.02, 0.25)], fleet) == [1, 1, 1, 1]


def test_a_held_straggler_goes_when_it_is_not_the_slowest_or_below_the_hold(fleet: Fleet) -> None:
    # a real straggler is named at once; another rank taking its place is named at once
    assert _named([(0.02, 0.35), (0.6, 0.02)], fleet) == [1, 0]
    # the held rank is no longer the slowest: no hold for it (and the new slowest is no straggler)
    assert _named([(0.02, 0.35), (0.3, 0.25)], fleet) == [1, None]
    # below the hold thresholds: gone
    assert _named([(0.02, 0.35), (0.02, 0.15)], fleet) == [1, None]
    # never named: 25% is below the rule's 30% without a hold
    assert _named([(0.02, 0.25), (0.02, 0.25)], fleet) == [None, None]


def test_a_rank_only_its_node_named_is_not_held_by_the_cross_node_rule(fleet: Fleet) -> None:
    """Rank 1 waits 25% (below the rule's 30%), named only because dlmon on its node holds a
    straggler verdict on it; that verdict then clears (the node finds it recovered). The reader
    held it at the rule's hold thresholds as if the rule had named it, and went on naming it for as
    long as it waited 20 to 30%."""
    verdict = Alert("straggler", "warning", "loader train.py:40", "m", "a", 0.0, {"rank": 1, "cause": "cpu"})
    read = reader(ClusterOptions(fleet.nodes, None, None, None, 5.0, 0.0, trend_s=10.0))
    named: list[int | None] = []
    for alerts in ((verdict,), (), ()):
        fleet.set((0.02, 0.25))
        fleet.exporters[1](dataclasses.replace(_ranked(fleet.snapshot, 1, 0.25), alerts=alerts))
        view = read()
        named.append(None if view.straggler is None else view.straggler.rank)
    assert named == [1, None, None], named


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("0", "more than 0"),
        ("abc", "a number of seconds"),
        ("1e9", "at most 604800"),
        ("nan", "a finite number"),
    ],
)
def test_a_bad_trend_is_one_line(value: str, words: str) -> None:
    done = subprocess.run(
        dlmon_cmd("cluster", "127.0.0.1:1", "--once", "--trend", value), capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and f"--trend must be {words}" in done.stderr


# --- range queries that fail or answer oddly ---------------------------------------------------------


def _prometheus_like(range_body: bytes, asked: list[str] | None = None) -> tuple[ThreadingHTTPServer, str]:
    """Instant queries answered with one node's batches/s; /api/v1/query_range with ``range_body``
    (each such request's path appended to ``asked``)."""
    instant = {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [
                {
                    "metric": {"__name__": "dlmon_loader_batches_per_second", "instance": "n0:9108"},
                    "value": [1.0, "20"],
                }
            ],
        },
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ranged = self.path.startswith("/api/v1/query_range")
            if ranged and asked is not None:
                asked.append(self.path)
            body = range_body if ranged else json.dumps(instant).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


# not numbers, not finite, not pairs; a dict raised KeyError, an integer past a float OverflowError
ODD_POINTS: list[object] = [[1, "NaN"], ["x", "1"], [2], 5, {"a": 1}, [1e400, 1], [10**400, 1]]


@pytest.mark.parametrize(
    ("range_body", "note"),
    [
        (b"<html>no</html>", "no trends: "),
        (json.dumps({"status": "error", "error": "too many points"}).encode(), "no trends: "),
        (  # a matrix with values that are not numbers, not finite, or not pairs (a dict raised
            # KeyError, an integer past a float OverflowError: a traceback): those points skipped
            json.dumps(
                {
                    "status": "success",
                    "data": {
                        "resultType": "matrix",
                        "result": [
                            {
                                "metric": {"instance": "n0:9108"},
                                "values": ODD_POINTS,
                            },
                            {"metric": {"instance": "n0:9108"}, "values": "nope"},
                        ],
                    },
                }
            ).encode(),
            None,
        ),
    ],
)
def test_range_queries_that_fail_or_answer_oddly_leave_the_trend_n_a(
    range_body: bytes, note: str | None
) -> None:
    server, url = _prometheus_like(range_body)
    try:
        view = reader(ClusterOptions((), url, None, None, 5.0, 0.0))()
    finally:
        server.shutdown()
        server.server_close()
    (node,) = view.nodes
    assert node.batches_per_s == 20.0  # the figures of now stand
    assert node.batches_per_s_trend is None and node_cells(node)[2] == "n/a"
    if note is None:
        assert view.trend_note is None and view.trend_step_s == 15.0
    else:
        assert (
            view.trend_note is not None and view.trend_note.startswith(note) and "\n" not in view.trend_note
        )
        assert view.trend_step_s is None and view.trend_note in table(view)


def test_the_range_queries_are_asked_once_a_slot_not_at_every_refresh() -> None:
    """--trend 300 is 20 slots of 15 s; the screen refreshes every 2 s. Both range queries were
    asked again at every refresh, over the whole --trend (a week's, at 512 nodes, loads Prometheus
    with every sample of it each time, failing or not); the answer now stands until a slot has passed."""
    matrix = {
        "status": "success",
        "data": {"resultType": "matrix", "result": [{"metric": {"instance": "n0:9108"}, "values": []}]},
    }
    asked: list[str] = []
    server, url = _prometheus_like(json.dumps(matrix).encode(), asked)
    try:
        read = reader(ClusterOptions((), url, None, None, 5.0, 0.0, trend_s=300.0))
        views = [read() for _ in range(3)]
    finally:
        server.shutdown()
        server.server_close()
    assert len(asked) == 2, asked  # the two range queries, once
    assert all(v.trend_step_s == 15.0 and v.trend_note is None for v in views)


# --- range queries on a real Prometheus ------------------------------------------------------------


def _train_and_validation(snapshot: Snapshot, rank: int) -> Snapshot:
    """Rank ``rank``'s node: its training loader at 5 batches/s, a validation loader at 50."""
    train = _ranked(snapshot, rank, 0.1, rate=5.0).loaders[0]
    val = dataclasses.replace(
        train, id=f"{200 + rank}:1", name="train.py:60", role="validation", batches_per_s=50.0
    )
    return dataclasses.replace(
        _ranked(snapshot, rank, 0.1), loaders=(dataclasses.replace(train, role="train"), val)
    )


def test_the_range_query_s_batches_per_s_is_the_training_loader_s_as_the_figure_of_now(
    snapshot: Snapshot, tmp_path: Path
) -> None:
    """Each rank's training loader (role train), else its busiest, as the batch/s column: the range
    query took every rank's busiest, so a validation loader at 50 batches/s beside the training
    one at 5 drew a trend ten times the figure next to it."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed")
    exporters = [Exporter(), Exporter()]
    for rank, exporter in enumerate(exporters):
        exporter(_train_and_validation(snapshot, rank))
    servers = [serve(e, Address("127.0.0.1", 0)) for e in exporters]
    targets = [f"127.0.0.1:{s.port}" for s in servers]
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: fleet\n"
        f"    static_configs:\n      - targets: {json.dumps(targets)}\n"
    )
    web = free_port()
    with open(tmp_path / "prometheus.log", "wb") as log:
        prometheus = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{web}",
            ],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        read = reader(ClusterOptions((), f"http://127.0.0.1:{web}", "fleet", None, 5.0, 2.0, trend_s=20.0))

        def trended() -> object:
            try:
                view = read()
            except Exception:
                return None
            full = all(
                len([p for p in n.batches_per_s_trend or () if p is not None]) >= 3 for n in view.nodes
            )
            return view if len(view.nodes) == 2 and full else None

        view = wait_for(trended, timeout=90, every=1.0)
        assert view is not None, (tmp_path / "prometheus.log").read_text()[-2000:]
        for node in view.nodes:
            assert node.batches_per_s == 5.0, node
            assert {p for p in node.batches_per_s_trend or () if p is not None} == {5.0}, node
    finally:
        kill_group(prometheus)
        for server in servers:
            server.close()


def test_the_screenshot_key_saves_each_press_in_its_own_svg(
    fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s twice within a second: the cluster screen named both dlmon-cluster-<second>.svg, the
    second over the first (the dashboard's own key numbers them; now one helper for both)."""
    import asyncio

    from dlmon.ui.cluster_screen import ClusterApp

    monkeypatch.chdir(tmp_path)
    (tmp_path / "screenshots").mkdir()
    read = reader(ClusterOptions(fleet.nodes, None, None, None, 5.0, 0.0))
    first = read()

    async def drive() -> None:
        app = ClusterApp(read, 60.0, first)
        async with app.run_test(size=(160, 20)) as pilot:
            await pilot.pause(0.2)
            await pilot.press("s")
            await pilot.press("s")
            await pilot.pause(0.2)
            await pilot.press("q")

    asyncio.run(drive())
    saved = sorted((tmp_path / "screenshots").glob("dlmon-cluster-*.svg"))
    assert len(saved) == 2, saved
    assert all("<svg" in p.read_text()[:500] for p in saved)
