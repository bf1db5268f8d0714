"""``dlmon cluster`` against odd and hostile sources (found in review): a node that answers a byte
at a time, a Prometheus that answers odd JSON, values that are not finite, digits that are not
ASCII, a node named twice, a disk shared by the ranks being compared. Each one a row, an "n/a" or
one line, never a traceback or a hang."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dlmon.cluster.command import ClusterOptions, as_dict, table
from dlmon.cluster.exposition import Series, parse
from dlmon.cluster.hosts import HostsError, expand_nodelist
from dlmon.cluster.promapi import PrometheusError, read_prometheus
from dlmon.cluster.readings import NodeReading
from dlmon.cluster.scrape import fetch, scrape_nodes
from dlmon.cluster.view import ClusterView, cluster_view, node_row
from dlmon.collect.sampler import Sampler
from dlmon.export.prometheus import Exporter, exposition
from dlmon.model import DiskSample, LoaderSample, ProcessSample, Snapshot
from support.export import dlmon_cmd, free_port, wait_for
from support.paths import ROOT

# --- a node that answers a byte at a time ------------------------------------------------------


@pytest.fixture
def trickling_node() -> Iterator[str]:
    """HTTP headers at once, then one byte every 0.2 s for as long as the client listens: every
    read is within a per-read timeout, the answer never ends."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    stop = threading.Event()

    def talk(conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")
                while not stop.is_set():
                    conn.sendall(b"#")
                    stop.wait(0.2)
            except OSError:
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=talk, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        server.close()


def _in_thread(call: Callable[[], object], cap_s: float) -> object:
    """``call()``'s result; a sentinel string when it had not returned after ``cap_s`` (a liveness
    cap far above the per-node timeout, so a hang fails the test instead of hanging it)."""
    out: list[object] = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(cap_s)
    return out[0] if out else "still reading"


def test_a_node_that_answers_a_byte_at_a_time_is_given_up_on(trickling_node: str) -> None:
    answer = _in_thread(lambda: fetch(trickling_node, 1.0), cap_s=60)
    assert isinstance(answer, str) and answer.startswith("no complete answer within"), answer


# --- a Prometheus that answers odd JSON --------------------------------------------------------


def _serving(body: bytes) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize(
    "answer",
    [
        {"status": "success", "data": None},
        {"status": "success", "data": []},
        {"status": "success", "data": {"resultType": "scalar", "result": [1, "2"]}},
        {"status": "success", "data": {"resultType": "vector", "result": [{"metric": [], "value": 1}]}},
        {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {"instance": 3}}]}},
    ],
)
def test_a_server_answering_other_json_is_one_line(answer: dict[str, object]) -> None:
    server, url = _serving(json.dumps(answer).encode())
    try:
        with pytest.raises(PrometheusError) as raised:
            read_prometheus(url, None, None, 2.0, 5.0)
        assert "\n" not in str(raised.value)
    finally:
        server.shutdown()
        server.server_close()


# --- odd values in an exposition ---------------------------------------------------------------


def test_values_that_are_not_finite_and_digits_that_are_not_ascii_read_as_n_a() -> None:
    body = (
        'dlmon_host_info{host="x"} 1\n'
        'dlmon_loader_batches_total{loader="1:1",rank="0",site="t.py:1"} 5\n'
        'dlmon_loader_batches_total{loader="1:2",rank="\u00b2",site="t.py:1"} 5\n'
        'dlmon_loader_workers{loader="1:1"} +Inf\n'
        'dlmon_loader_batches_per_second{loader="1:1"} -Inf\n'
        "dlmon_memory_growth_eta_seconds +Inf\n"
    )
    view = cluster_view([NodeReading("a:1", parse(body), time.time())], "test", 0.0)
    row = view.nodes[0]
    assert [r.rank for r in row.ranks] == [0]  # the rank "²" is not a rank
    assert row.ranks[0].workers is None and row.ranks[0].batches_per_s is None
    assert row.time_to_oom_s is None
    json.loads(json.dumps(as_dict(view)), parse_constant=lambda c: pytest.fail(f"{c} in --json"))
    assert "inf" not in table(view)


def test_a_node_list_with_digits_that_are_not_ascii_is_one_line() -> None:
    with pytest.raises(HostsError):
        expand_nodelist("node[\u00b2]")
    with pytest.raises(HostsError):
        expand_nodelist("node[1-\u00b3]")


# --- a node named twice ------------------------------------------------------------------------


def test_a_node_named_twice_is_one_row() -> None:
    port = free_port()
    twice = (f"127.0.0.1:{port}", "127.0.0.1", "--port", str(port))
    done = subprocess.run(
        dlmon_cmd("cluster", *twice, "--once", "--json", "--window", "0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert [n["address"] for n in json.loads(done.stdout)["nodes"]] == [f"127.0.0.1:{port}"]


# --- the straggler's cause ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def snapshot() -> Snapshot:
    sampler = Sampler(os.getpid())
    try:
        return sampler.sample()
    finally:
        sampler.close()


def _loader(rank: int, wait: float) -> LoaderSample:
    return LoaderSample(
        id=f"{100 + rank}:1",
        name="train.py:40",
        pid=100 + rank,
        num_workers=2,
        batches_total=500,
        batches_per_s=20.0,
        data_wait_fraction=wait,
        wall_wait_fraction=wait,
        rank=rank,
        local_rank=rank,
        node_rank=0,
        world_size=2,
    )


def _reading(snapshot: Snapshot, address: str) -> NodeReading:
    exporter = Exporter()
    exporter(snapshot)
    return NodeReading(address, parse(exposition(exporter).decode()), time.time())


def test_a_busy_disk_shared_with_the_other_ranks_is_not_the_straggler_s_cause(snapshot: Snapshot) -> None:
    """Both ranks on one node, its disk 90% busy: the disk serves the rank that does not wait as
    much as the one that does, so it tells them apart no more than nothing does (the local
    detector's rule: the disk is a rank's cause only if the others do not wait on it)."""
    busy = DiskSample("sda", 100.0, 0.0, 50e6, 0.0, 90.0, 5.0, 0.0, 1.0)
    one_node = dataclasses.replace(
        snapshot, loaders=(_loader(0, 0.05), _loader(1, 0.6)), disks=(busy,), host="n0", time=time.time()
    )
    row = node_row(_reading(one_node, "n0:9108"))
    assert row.disk_busy is not None and row.disk_busy >= 0.9
    view = cluster_view([_reading(one_node, "n0:9108")], "test", 0.0)
    assert view.straggler is not None and view.straggler.rank == 1
    assert view.straggler.cause != "io" and view.straggler.severity == "info", view.straggler


# --- a Prometheus URL that is not HTTP, or not a URL -------------------------------------------


@pytest.fixture
def not_http() -> Iterator[str]:
    """A port that answers as an ssh server does."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)

    def answer() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.recv(4096)
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
                except OSError:
                    pass

    threading.Thread(target=answer, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


def test_a_prometheus_url_that_is_not_http_or_not_a_url_is_one_line(not_http: str) -> None:
    for url, words in ((not_http, "does not answer HTTP"), ("http://[::1", "cannot use")):
        done = subprocess.run(
            dlmon_cmd("cluster", "--prometheus", url, "--once", "--json"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and done.stdout == "", (url, done.stderr)
        assert done.stderr.count("\n") == 1 and words in done.stderr, (url, done.stderr)


def _workers(rank: int, count: int, cpu_percent: float) -> tuple[ProcessSample, ...]:
    pids = [1000 * (rank + 1) + i for i in range(count)]
    return tuple(
        ProcessSample(
            pid,
            1,
            100 + rank,
            "worker",
            "pt_data_worker",
            "S",
            worker_id=i,
            cpu_percent=cpu_percent,
            rank=rank,
        )
        for i, pid in enumerate(pids)
    )


def test_more_workers_at_less_cpu_each_is_not_a_cpu_cause(snapshot: Snapshot) -> None:
    """The slow rank has 8 workers at 30% CPU each (2.4 cores), the other 2 at 60% (1.2 cores):
    none is CPU-bound and each of its workers is less busy, so CPU does not tell it apart (the
    local detector compares each worker's CPU and asks it to be busy)."""
    nodes = []
    for rank, wait, count, cpu in ((0, 0.05, 2, 60.0), (1, 0.6, 8, 30.0)):
        loader = dataclasses.replace(_loader(rank, wait), num_workers=count)
        loader = dataclasses.replace(loader, worker_pids=tuple(p.pid for p in _workers(rank, count, cpu)))
        snap = dataclasses.replace(
            snapshot,
            loaders=(loader,),
            processes=_workers(rank, count, cpu),
            disks=(),
            host=f"n{rank}",
            time=time.time(),
        )
        nodes.append(_reading(snap, f"n{rank}:9108"))
    view = cluster_view(nodes, "test", 0.0)
    assert view.straggler is not None and view.straggler.rank == 1
    assert view.straggler.cause != "cpu" and view.straggler.severity == "info", view.straggler


def test_busy_workers_well_above_the_others_are_the_cpu_cause(snapshot: Snapshot) -> None:
    nodes = []
    for rank, wait, cpu in ((0, 0.05, 40.0), (1, 0.6, 97.0)):
        loader = dataclasses.replace(
            _loader(rank, wait), worker_pids=tuple(p.pid for p in _workers(rank, 2, cpu))
        )
        snap = dataclasses.replace(
            snapshot,
            loaders=(loader,),
            processes=_workers(rank, 2, cpu),
            disks=(),
            host=f"n{rank}",
            time=time.time(),
        )
        nodes.append(_reading(snap, f"n{rank}:9108"))
    view = cluster_view(nodes, "test", 0.0)
    assert view.straggler is not None and view.straggler.cause == "cpu", view.straggler
    assert view.straggler.severity == "critical"


def test_a_series_read_twice_counts_once(snapshot: Snapshot) -> None:
    """The same series twice (two scrape jobs of one target, merged by instance; a proxy that
    repeats itself): a sum over a node's GPUs or workers must not double."""
    exporter = Exporter()
    exporter(dataclasses.replace(snapshot, loaders=(_loader(0, 0.1),), host="n0", time=time.time()))
    once = parse(exposition(exporter).decode())
    gpu = (
        Series("dlmon_gpu_memory_used_bytes", (("gpu", "0"),), 4e9),
        Series("dlmon_gpu_memory_total_bytes", (("gpu", "0"),), 8e9),
    )
    now = time.time()
    single = node_row(NodeReading("n0:9108", once + gpu, now))
    double = node_row(NodeReading("n0:9108", once + gpu + once + gpu, now))
    assert double.gpu_memory_used_bytes == single.gpu_memory_used_bytes == 4e9
    assert double == single


# --- a node that accepts and never answers -----------------------------------------------------


def test_a_node_that_never_answers_is_asked_once_a_refresh() -> None:
    """Three readings a refresh (--window 2): a node that missed the first is not asked again,
    each time costing the timeout; a silent node makes one connection a refresh."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])  # held open, never answered
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        [row] = scrape_nodes([f"127.0.0.1:{server.getsockname()[1]}"], 0.5, readings=3, every_s=0.0)
        assert row.error is not None and row.error.startswith("no answer within")
        assert len(accepted) == 1
    finally:
        stop.set()
        server.close()
        for conn in accepted:
            conn.close()


def test_the_screen_shows_the_reading_made_before_it_opened(snapshot: Snapshot) -> None:
    """`dlmon cluster` reads once before the screen opens (a bad source fails as one line): the
    screen shows that reading instead of reading the whole window again."""
    import asyncio

    from dlmon.cluster.command import run_cluster
    from dlmon.ui.cluster_screen import ClusterApp

    first = cluster_view([_reading(dataclasses.replace(snapshot, host="n0"), "n0:9108")], "test", 0.0)
    reads: list[int] = []

    def read() -> ClusterView:
        reads.append(1)
        return first

    handed: list[ClusterView | None] = []
    options = ClusterOptions(("127.0.0.1:1",), None, None, None, 1.0, 0.0)
    run_cluster(
        options, once=False, as_json=False, interval_s=60, screen=lambda r, i, f: handed.append(f) or 0
    )
    assert len(handed) == 1 and handed[0] is not None

    async def drive() -> None:
        app = ClusterApp(read, 60.0, first)
        async with app.run_test(size=(120, 20)) as pilot:
            await pilot.pause(0.2)
            assert app.view is first and reads == []
            await pilot.press("q")

    asyncio.run(drive())


def test_an_unproven_straggler_does_not_sort_above_a_node_with_a_warning(snapshot: Snapshot) -> None:
    """A straggler without a measured cause is said as info; its node must not outrank a node
    whose own dlmon holds a warning (it was sorted as a warning, ahead of it)."""
    from dlmon.model import Alert

    growth = Alert("memory_growth", "warning", "job", "m", "a", 0.0, {"eta_s": 600.0})
    nodes = [
        _reading(
            dataclasses.replace(snapshot, loaders=(_loader(0, 0.05),), alerts=(growth,), host="n0"), "n0:9108"
        ),
        _reading(dataclasses.replace(snapshot, loaders=(_loader(1, 0.6),), alerts=(), host="n1"), "n1:9108"),
    ]
    view = cluster_view(nodes, "test", 0.0)
    assert view.straggler is not None and view.straggler.severity == "info" and view.straggler.host == "n1"
    assert [n.host for n in view.nodes] == ["n0", "n1"]


def test_two_jobs_running_the_same_script_are_not_compared(snapshot: Snapshot) -> None:
    """A Prometheus scrape job holding the whole fleet (or no --job): two independent trainings of
    one script (a sweep under torchrun, each its own rank 0), one input-bound, one not, at similar
    rates. They do not wait on each other: naming one the other's straggler is a false alarm."""
    nodes = []
    for job, wait in (("a", 0.6), ("b", 0.05)):
        loader = dataclasses.replace(_loader(0, wait), id=f"{ord(job)}:1", pid=ord(job))
        snap = dataclasses.replace(snapshot, loaders=(loader,), disks=(), alerts=(), host=f"node-{job}")
        nodes.append(_reading(snap, f"node-{job}:9108"))
    view = cluster_view(nodes, "test", 0.0)
    assert view.straggler is None, view.straggler
    assert "more than one job" in view.straggler_note, view.straggler_note


# --- node lists that never end -----------------------------------------------------------------


def test_a_node_list_whose_ranges_multiply_past_the_bound_is_refused_before_it_is_built() -> None:
    with pytest.raises(HostsError, match="more than"):
        expand_nodelist("n[1-99999]-m[1-99999]")  # 10^10 names: a hang and GiBs, were they built


def test_a_hosts_file_that_never_ends_is_one_line() -> None:
    done = subprocess.run(
        dlmon_cmd("cluster", "--hosts-file", "/dev/zero", "--once", "--json"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-500:]
    assert "longer than" in done.stderr


# --- the documented host join, on `export --all-jobs` ------------------------------------------


@pytest.mark.slow
def test_the_documented_host_join_works_on_an_all_jobs_exporter(snapshot: Snapshot, tmp_path: Path) -> None:
    """`export --all-jobs` serves one dlmon_host_info per job (a `job` label, `exported_job` in
    Prometheus): the join docs/prometheus.md and the Grafana panel use must still match one
    info series per instance (it was a many-to-many error on a real Prometheus)."""
    import shutil
    from types import SimpleNamespace

    from dlmon.export.metrics import Published
    from dlmon.export.prometheus import Address, serve
    from dlmon.model import Alert
    from integration.cluster.test_cluster import _prometheus
    from integration.export.test_export_prometheus import dashboard_queries, query

    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed")
    alert = Alert("input_bound", "warning", "loader x", "m", "a", 0.0, {"cause": "cpu"})
    jobs = tuple(
        (str(pid), Published(dataclasses.replace(snapshot, loaders=(_loader(0, 0.5),), alerts=(alert,))))
        for pid in (11, 12)
    )
    server = serve(SimpleNamespace(latest=jobs), Address("127.0.0.1", 0))
    try:
        with _prometheus((f"127.0.0.1:{server.port}",), tmp_path) as url:
            assert wait_for(lambda: query(url, 'count(dlmon_host_info{job="train"}) == 2'), timeout=60)
            joins = [e for e in dashboard_queries() if "dlmon_host_info" in e]
            doc = (ROOT / "docs" / "prometheus.md").read_text()
            joins.append(re.search(r"`(dlmon_loader_batches_per_second \* on [^`]+)`", doc).group(1))  # type: ignore[union-attr]
            assert len(joins) == 2
            for expr in joins:
                result = query(url, expr.replace("$instance", ".*"))
                assert result and all(r["metric"]["host"] == snapshot.host for r in result), (expr, result)
    finally:
        server.close()


def test_a_json_stream_outlives_a_failed_refresh(
    snapshot: Snapshot, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dlmon cluster --prometheus URL --json` (no --once) streams a line a refresh: a refresh
    that fails after the first (Prometheus restarting) is a line on stderr, not the end of the
    stream; the first failing still is the one line and the exit status."""
    from dlmon.cluster import command

    view = cluster_view([_reading(dataclasses.replace(snapshot, host="n0"), "n0:9108")], "test", 0.0)
    calls: list[int] = []

    def read() -> ClusterView:
        calls.append(1)
        if len(calls) == 2:
            raise command.ClusterFailed("cannot reach Prometheus at http://p: Connection refused")
        if len(calls) == 4:
            raise KeyboardInterrupt  # the user's Ctrl-C ends the stream
        return view

    monkeypatch.setattr(command, "reader", lambda options: read)
    options = ClusterOptions((), "http://p", None, None, 1.0, 0.0)
    with pytest.raises(KeyboardInterrupt):
        command.run_cluster(options, once=False, as_json=True, interval_s=0.0, screen=None)
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 and "refresh failed" in err and "Connection refused" in err

    calls.clear()
    calls.append(1)  # the first read fails: the source is wrong
    with pytest.raises(command.ClusterFailed):
        command.run_cluster(options, once=False, as_json=True, interval_s=0.0, screen=None)
