"""``dlmon cluster``: a real two-node torchrun job (each node its own ``dlmon run --prometheus`` in
its own UTS namespace, so the hosts have different names), read directly and through a real
Prometheus; first balanced (no straggler may be named), then with node-b's loader slowed (its rank
must be named, with a cause). Bad sources and nodes are one line or a row, never a traceback."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlmon.cluster.exposition import NotExposition, parse
from dlmon.cluster.hosts import HostsError, expand_nodelist, read_hosts_file, with_port
from dlmon.cluster.readings import NEEDED, NodeReading
from dlmon.cluster.view import cluster_view, node_row
from dlmon.collect.sampler import Sampler
from dlmon.export.prometheus import Exporter, exposition
from dlmon.model import Alert, LoaderSample, Snapshot
from support.export import PORT_LINE, dlmon_cmd, free_port, http_get, kill_group, wait_for
from support.paths import TESTS

SCRIPT = TESTS / "agent_scripts" / "ddp_straggler.py"
HOSTS = ("node-a", "node-b")


# --- the parts, on real exporter output ------------------------------------------------------------


def test_node_lists_in_slurm_form() -> None:
    assert expand_nodelist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_nodelist("gpu-a,rack[1-2]-n[8-9]") == [
        "gpu-a",
        "rack1-n8",
        "rack1-n9",
        "rack2-n8",
        "rack2-n9",
    ]
    for bad in ("node[3-1]", "node[01-", "node]", "node[a-b]"):
        with pytest.raises(HostsError):
            expand_nodelist(bad)
    assert read_hosts_file("# nodes\nnode01\n\nnode02:9200  # other port\n") == ["node01", "node02:9200"]
    assert [with_port(n, 9108) for n in ("a", "a:1", "[::1]", "[::1]:2", "http://a/metrics")] == [
        "a:9108",
        "a:1",
        "[::1]:9108",
        "[::1]:2",
        "http://a/metrics",
    ]


def test_an_exposition_parses_and_other_pages_do_not() -> None:
    text = 'a_b{x="1",y="q\\"uote"} 2.5\n# HELP z z\nz NaN\nc 3 1700000000000\n'
    series = parse(text)
    assert [(s.name, s.labels, s.value) for s in series] == [
        ("a_b", (("x", "1"), ("y", 'q"uote')), 2.5),
        ("c", (), 3.0),
    ]
    for page in ("<!doctype html><html><body>login</body></html>", '{"status": "success"}'):
        with pytest.raises(NotExposition):
            parse(page)


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
    return dataclasses.replace(snapshot, loaders=(loader,), host=f"n{rank}", time=time.time())


def _reading(
    snapshot: Snapshot, address: str, read_at: float | None = None, drop: tuple[str, ...] = ()
) -> NodeReading:
    """What a real exporter serves for ``snapshot``, as a node reading (some families dropped)."""
    exporter = Exporter()
    exporter(snapshot)
    text = exposition(exporter).decode()
    kept = "\n".join(line for line in text.splitlines() if line.split("{")[0].split(" ")[0] not in drop)
    return NodeReading(address, parse(kept), time.time() if read_at is None else read_at)


def test_reading_only_the_needed_families_reads_them_all(snapshot: Snapshot) -> None:
    """The fast path (families skipped by their # TYPE line) keeps every sample a full parse has."""
    exporter = Exporter()
    loud = Alert("input_bound", "warning", "loader x", "m", "a", 0.0, {"cause": "cpu"})
    exporter(dataclasses.replace(_ranked(snapshot, 0, 0.2), alerts=(loud,)))
    text = exposition(exporter).decode()
    wanted = frozenset(NEEDED)
    assert parse(text, wanted) == tuple(s for s in parse(text) if s.name in wanted)
    assert {s.name for s in parse(text, wanted)} >= {
        "dlmon_loader_batches_total",
        "dlmon_alert",
        "dlmon_host_info",
    }


def test_ranks_at_the_same_pace_and_wait_have_no_straggler(snapshot: Snapshot) -> None:
    view = cluster_view([_reading(_ranked(snapshot, r, 0.05), f"h{r}:9108") for r in (0, 1)], "test", 0.0)
    assert view.straggler is None and "no straggler" in view.straggler_note
    assert {n.host for n in view.nodes} == {"n0", "n1"} and all(len(n.ranks) == 1 for n in view.nodes)


def test_a_rank_waiting_far_longer_with_fewer_workers_is_the_straggler(snapshot: Snapshot) -> None:
    slow = _ranked(snapshot, 1, 0.6)
    slow = dataclasses.replace(slow, loaders=(dataclasses.replace(slow.loaders[0], num_workers=1),))
    view = cluster_view(
        [_reading(_ranked(snapshot, 0, 0.05), "h0:9108"), _reading(slow, "h1:9108")], "test", 0.0
    )
    assert view.straggler is not None
    assert (view.straggler.rank, view.straggler.host, view.straggler.cause) == (1, "n1", "fewer_workers")
    assert view.straggler.severity == "critical" and view.nodes[0].host == "n1"
    assert "it has 1 DataLoader workers, the other ranks 2 or more" in view.straggler_note


def test_a_node_with_an_older_dlmon_is_read_with_n_a(snapshot: Snapshot) -> None:
    growth = Alert("memory_growth", "warning", "job", "m", "a", 0.0, {"eta_s": 600.0})
    old = _reading(
        dataclasses.replace(_ranked(snapshot, 0, 0.1), alerts=(growth,)),
        "old-node:9108",
        drop=(
            "dlmon_host_info",
            "dlmon_alert",
            "dlmon_alerts_active",
            "dlmon_memory_growth_eta_seconds",
            "dlmon_loader_batches_per_second",
            "dlmon_job_data_wait_wall_ratio",
        ),
    )
    row = node_row(old)
    assert row.answered and row.host == "old-node" and row.time_to_oom_s is None
    assert row.ranks[0].batches_per_s is None and row.batches_per_s is None
    assert row.verdict is not None and row.verdict.reason == "memory_growth: job"  # from dlmon_alert_active
    assert any("older dlmon" in note for note in row.notes)


def test_memory_growth_gives_the_time_to_oom_and_the_verdict_line(snapshot: Snapshot) -> None:
    growth = Alert(
        "memory_growth", "warning", "job", "m", "a", 0.0, {"eta_s": 600.0, "cause": "copy_on_read"}
    )
    row = node_row(_reading(dataclasses.replace(_ranked(snapshot, 0, 0.1), alerts=(growth,)), "h0:9108"))
    assert row.time_to_oom_s == 600.0 and row.headroom_bytes and row.headroom_of in ("cgroup", "machine")
    assert row.verdict is not None and row.verdict.severity == "warning"
    assert (
        row.verdict.reason
        == "memory_growth: memory keeps growing, headroom gone in about 10.0 min (cause: copy on read)"
    )


def test_a_node_whose_training_ended_says_so(snapshot: Snapshot) -> None:
    ended = _ranked(snapshot, 0, 0.1)
    ended = dataclasses.replace(ended, target=dataclasses.replace(ended.target, alive=False))
    row = node_row(_reading(ended, "h0:9108"))
    assert row.training_up is False and "its training is not running (dlmon_target_up 0)" in row.notes


def test_a_node_whose_clock_disagrees_says_so_and_keeps_its_figures(snapshot: Snapshot) -> None:
    ahead = _reading(_ranked(snapshot, 0, 0.1), "h0:9108", read_at=time.time() - 120)
    row = node_row(ahead)
    assert row.clock_offset_s is None and any("clock is 120 s ahead" in n for n in row.notes), row.notes
    assert row.ranks[0].loader_wait == pytest.approx(0.1)
    in_step = node_row(_reading(_ranked(snapshot, 0, 0.1), "h0:9108"))
    assert in_step.clock_offset_s is not None and not in_step.notes


# --- a real two-node job -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TwoNodes:
    nodes: tuple[str, ...]  # 127.0.0.1:PORT of node-a's and node-b's dlmon
    prometheus: str
    balanced: dict[str, Any]  # `dlmon cluster NODES --once --json` before the slowdown
    balanced_prometheus: dict[str, Any]
    slowed: dict[str, Any]  # ... after node-b's loader was slowed
    slowed_prometheus: dict[str, Any]


def cluster(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dlmon_cmd("cluster", *args), capture_output=True, text=True, timeout=timeout)


def cluster_json(*args: str) -> dict[str, Any] | None:
    done = cluster(*args, "--once", "--json")
    try:
        return dict(json.loads(done.stdout))
    except ValueError:
        return None


def _both_ranks(view: dict[str, Any] | None) -> bool:
    if not view:
        return False
    return sorted(r["rank"] for n in view["nodes"] for r in n["ranks"] if r["batches_per_s"]) == [0, 1]


def _with_cause(view: dict[str, Any] | None) -> dict[str, Any] | None:
    named = view is not None and view["straggler"] and view["straggler"]["cause"] != "not_measured"
    return view if named else None


def _node(host: str, node_rank: int, master_port: int, flag: Path, err: Path) -> subprocess.Popen[bytes]:
    inner = dlmon_cmd("run", "--headless", "--interval", "0.5", "--prometheus", "127.0.0.1:0", "--")
    inner += [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank)]
    inner += ["--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(master_port)]
    inner += [
        str(SCRIPT),
        "--seconds",
        "600",
        "--slow-rank",
        "1",
        "--sleep-ms",
        "8",
        "--slow-when",
        str(flag),
    ]
    shell = f"hostname {host} && exec {shlex.join(inner)}"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    with open(err, "wb") as fh:
        return subprocess.Popen(
            ["unshare", "-u", "sh", "-c", shell],
            stdout=subprocess.DEVNULL,
            stderr=fh,
            env=env,
            start_new_session=True,
        )


@contextlib.contextmanager
def _prometheus(nodes: tuple[str, ...], tmp: Path) -> Iterator[str]:
    config = tmp / "prometheus.yml"
    config.write_text(
        textwrap.dedent(
            f"""\
            global:
              scrape_interval: 1s
            scrape_configs:
              - job_name: train
                static_configs:
                  - targets: {json.dumps(list(nodes))}
              - job_name: gone
                static_configs:
                  - targets: ["127.0.0.1:{free_port()}"]
            """
        )
    )
    web = free_port()
    with open(tmp / "prometheus.log", "wb") as log:
        server = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{web}",
            ],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{web}"
        assert wait_for(lambda: _ready(url), timeout=60, every=0.25), (tmp / "prometheus.log").read_text()[
            -2000:
        ]
        yield url
    finally:
        kill_group(server)


def _ready(url: str) -> bool:
    try:
        return bool(http_get(f"{url}/-/ready"))
    except OSError:
        return False


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    pytest.importorskip("torch")
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed")
    if subprocess.run(["unshare", "-u", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -u is not allowed here (needs CAP_SYS_ADMIN)")
    tmp = tmp_path_factory.mktemp("two_nodes")
    flag, master = tmp / "slow-now", free_port()
    procs = [_node(host, i, master, flag, tmp / f"{host}.err") for i, host in enumerate(HOSTS)]
    try:
        ports = []
        for host in HOSTS:
            match = wait_for(lambda h=host: PORT_LINE.search((tmp / f"{h}.err").read_text()), timeout=60)  # type: ignore[misc]
            assert match, (tmp / f"{host}.err").read_text()[-2000:]
            ports.append(match.group(2))
        nodes = tuple(f"127.0.0.1:{port}" for port in ports)
        with _prometheus(nodes, tmp) as url:
            balanced = wait_for(
                lambda: (v := cluster_json(*nodes)) and _both_ranks(v) and v, timeout=90, every=0.5
            )
            assert balanced, [(tmp / f"{h}.err").read_text()[-2000:] for h in HOSTS]
            prom = ("--prometheus", url, "--job", "train")
            balanced_prom = wait_for(lambda: (v := cluster_json(*prom)) and _both_ranks(v) and v, timeout=30)
            assert balanced_prom, "Prometheus never held both ranks"
            flag.touch()
            # named at once; its cause once node-b's own dlmon holds its verdict (after its hold)
            slowed = wait_for(lambda: _with_cause(cluster_json(*nodes)), timeout=60, every=0.5)
            slowed_prom = wait_for(lambda: _with_cause(cluster_json(*prom)), timeout=30)
            yield TwoNodes(nodes, url, balanced, balanced_prom, slowed or {}, slowed_prom or {})
    finally:
        for proc in procs:
            kill_group(proc)


@pytest.mark.slow
def test_a_balanced_two_node_job_names_no_straggler(two_nodes: TwoNodes) -> None:
    for view in (two_nodes.balanced, two_nodes.balanced_prometheus):
        assert view["straggler"] is None, view["straggler_note"]
        assert sorted(n["host"] for n in view["nodes"]) == list(HOSTS)
        assert all(n["severity"] == "ok" and n["verdict"] is None for n in view["nodes"]), view["nodes"]
        assert all(n["notes"] == [] and n["clock_offset_s"] is not None for n in view["nodes"]), view["nodes"]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["direct", "prometheus"])
def test_the_slowed_node_s_rank_is_named_with_its_cause(two_nodes: TwoNodes, source: str) -> None:
    view = two_nodes.slowed if source == "direct" else two_nodes.slowed_prometheus
    assert view, "no straggler was named within the wait"
    straggler = view["straggler"]
    assert (straggler["host"], straggler["rank"]) == ("node-b", 1), straggler
    assert straggler["cause"] != "not_measured" and "why: " in straggler["line"], straggler
    assert straggler["line"].startswith("rank 1 on node-b sets the pace"), straggler["line"]
    first, second = view["nodes"]
    assert first["host"] == "node-b" and second["host"] == "node-a"  # worst first
    assert [(r["rank"], r["node_rank"]) for r in first["ranks"]] == [(1, 1)]
    assert [(r["rank"], r["node_rank"]) for r in second["ranks"]] == [(0, 0)]
    assert first["ranks"][0]["loader_wait"] > 0.3 > second["ranks"][0]["loader_wait"]
    assert first["headroom_bytes"] and first["headroom_of"] in ("cgroup", "machine")


@pytest.mark.slow
def test_the_table_shows_both_nodes_and_the_straggler_line(two_nodes: TwoNodes) -> None:
    done = cluster(*two_nodes.nodes, "--once", "--window", "0")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("straggler: ") and "node" in lines[1] and "verdict" in lines[1]
    assert any(line.startswith("node-a") for line in lines) and any(
        line.startswith("node-b") for line in lines
    )
    assert "  rank 0" in done.stdout and "  rank 1" in done.stdout


@pytest.mark.slow
def test_prometheus_with_a_window_shorter_than_its_scrapes_reads_the_last_values(two_nodes: TwoNodes) -> None:
    view = cluster_json("--prometheus", two_nodes.prometheus, "--job", "train", "--window", "0")
    assert view is not None and _both_ranks(view), view
    assert all(r["loader_wait"] is not None for n in view["nodes"] for r in n["ranks"]), view["nodes"]


@pytest.mark.slow
def test_prometheus_range_queries_give_each_node_s_trend(two_nodes: TwoNodes) -> None:
    """Each node's batches/s and data wait over the last minute, from /api/v1/query_range: both
    nodes moving, the slowed node-b waiting more than node-a; on the table as sparklines."""
    prom = ("--prometheus", two_nodes.prometheus, "--job", "train", "--trend", "60")

    def filled(view: dict[str, Any] | None) -> bool:  # 15 s of Prometheus's history, however soon run
        if not view:
            return False
        return all(
            len([p for p in n["batches_per_s_trend"] or () if p is not None]) >= 5 for n in view["nodes"]
        )

    view = wait_for(lambda: (v := cluster_json(*prom)) and filled(v) and v, timeout=60, every=1.0)
    view = view or cluster_json(*prom)
    assert view is not None and view["trend_step_s"] == 3.0 and view["trend_note"] is None, view
    nodes = {n["host"]: n for n in view["nodes"]}
    for host in HOSTS:
        rates = [p for p in nodes[host]["batches_per_s_trend"] if p is not None]
        waits = [p for p in nodes[host]["data_wait_trend"] if p is not None]
        assert len(nodes[host]["batches_per_s_trend"]) == 20 and len(rates) >= 5, nodes[host]
        assert all(r > 0 for r in rates) and len(waits) >= 5, nodes[host]
    b_waits = [p for p in nodes["node-b"]["data_wait_trend"][-3:] if p is not None]
    a_waits = [p for p in nodes["node-a"]["data_wait_trend"][-3:] if p is not None]
    assert b_waits and a_waits and max(b_waits) > max(a_waits), (b_waits, a_waits)
    done = cluster(*prom, "--once")
    assert done.returncode == 0 and "batch/s trend" in done.stdout, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith(("node-a", "node-b"))]
    assert len(rows) == 2 and all(any(c in row for c in "▁▂▃▄▅▆▇█") for row in rows), done.stdout


@pytest.mark.slow
def test_a_target_prometheus_cannot_scrape_is_a_row_saying_so(two_nodes: TwoNodes) -> None:
    view = cluster_json("--prometheus", two_nodes.prometheus, "--match", '{job=~"train|gone"}')
    assert view is not None, "no view"
    gone = [n for n in view["nodes"] if not n["answered"]]
    assert len(gone) == 1 and gone[0]["problem"] == "Prometheus's last scrape of it failed (up == 0)", gone
    assert sorted(n["host"] for n in view["nodes"] if n["answered"]) == list(HOSTS)


# --- bad sources and nodes --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_node_that_does_not_answer_or_is_not_dlmon_is_a_row_saying_so(two_nodes: TwoNodes) -> None:
    closed = f"127.0.0.1:{free_port()}"
    not_dlmon = two_nodes.prometheus.removeprefix("http://")  # Prometheus's own /metrics: no dlmon series
    html = f"{two_nodes.prometheus}/graph"  # a web page
    view = cluster_json(two_nodes.nodes[0], closed, not_dlmon, html, "--window", "0")
    assert view is not None
    rows = {n["address"]: n for n in view["nodes"]}
    assert "connection refused" in rows[closed]["problem"]
    assert rows[not_dlmon]["problem"] == "answered, but with no dlmon series (not a dlmon exporter?)"
    assert rows[html]["problem"].startswith("not a Prometheus exposition")
    assert rows[two_nodes.nodes[0]]["answered"] and rows[two_nodes.nodes[0]]["problem"] is None
    assert [n["address"] for n in view["nodes"]][-1] == two_nodes.nodes[0]  # the answering node last
    nobody = cluster(closed, "--once", "--window", "0")
    assert nobody.returncode == 1 and "Traceback" not in nobody.stderr


@pytest.mark.slow
def test_bad_prometheus_urls_are_one_line_and_exit_2(two_nodes: TwoNodes) -> None:
    cases = [
        (f"http://127.0.0.1:{free_port()}", (), "cannot reach Prometheus at"),
        (f"http://{two_nodes.nodes[0]}", (), "not a Prometheus server"),  # a dlmon exporter
        (
            two_nodes.prometheus,
            ("--job", "nosuch"),
            'no dlmon series for {job="nosuch"} (jobs with dlmon series: train)',
        ),
        (two_nodes.prometheus, ("--match", "{job=~"), "refused"),
    ]
    for url, extra, words in cases:
        done = cluster("--prometheus", url, *extra, "--once", "--json")
        assert done.returncode == 2 and done.stdout == "", (url, done.stdout, done.stderr)
        assert done.stderr.count("\n") == 1 and words in done.stderr, (url, done.stderr)


def test_slurm_nodelist_names_the_nodes(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    env = {**os.environ, "SLURM_JOB_NODELIST": "127.0.0.[1-1]"}
    done = subprocess.run(
        dlmon_cmd("cluster", "--port", str(ports[0]), "--once", "--json", "--window", "0"),
        capture_output=True,
        text=True,
        env=env,
    )
    view = json.loads(done.stdout)
    assert [n["address"] for n in view["nodes"]] == [f"127.0.0.1:{ports[0]}"] and done.returncode == 1


# --- the screen ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_screen_folds_each_node_s_ranks_under_it(two_nodes: TwoNodes) -> None:
    from textual.widgets import DataTable

    from dlmon.cluster.command import ClusterOptions, reader
    from dlmon.ui.cluster_screen import ClusterApp

    def rows(app: ClusterApp) -> list[str]:
        table = app.query_one(DataTable)
        return [" ".join(str(c) for c in table.get_row_at(i)) for i in range(table.row_count)]

    async def drive() -> None:
        app = ClusterApp(reader(ClusterOptions(two_nodes.nodes, None, None, None, 5.0, 1.0)), 1.0)
        async with app.run_test(size=(180, 30)) as pilot:
            for _ in range(300):
                await pilot.pause(0.1)
                if app.view is not None and app.view.straggler is not None:
                    break
            assert app.view is not None and app.view.straggler is not None, app.view
            assert app.view.straggler_note.startswith("rank 1 on node-b sets the pace")
            folded = rows(app)
            assert len(folded) == 2 and folded[0].startswith("▸ node-b (1 rank)"), folded
            assert folded[1].startswith("▸ node-a (1 rank)"), folded
            await pilot.press("enter")  # the cursor is on the first row: node-b
            unfolded = rows(app)
            assert unfolded[0].startswith("▾ node-b") and unfolded[1].startswith("  └ rank 1"), unfolded
            assert "ddp_straggler.py:" in unfolded[1] and len(unfolded) == 3
            await pilot.press("enter")
            assert len(rows(app)) == 2
            await pilot.press("q")

    import asyncio

    asyncio.run(drive())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
@pytest.mark.parametrize("source", ["direct", "prometheus"])
def test_the_screen_in_a_real_terminal(two_nodes: TwoNodes, source: str) -> None:
    from support.terminal import Tmux

    tmux = Tmux(f"cluster-{source}")
    env = {**os.environ, "TERM": "xterm-256color"}
    nodes = (
        two_nodes.nodes if source == "direct" else ("--prometheus", two_nodes.prometheus, "--job", "train")
    )
    command = shlex.join([*dlmon_cmd("cluster", *nodes, "--interval", "1")])
    subprocess.run(
        ["tmux", "-L", tmux.socket, "new-session", "-d", "-s", "t", "-x", "160", "-y", "30", command],
        check=True,
        env=env,
    )
    try:
        screen = tmux.wait_for("rank 1 on node-b sets the pace", timeout=60)
        assert "node-a" in screen and "▸ node-b (1 rank)" in screen, screen
        assert "batch/s trend" in screen and any(c in screen for c in "▁▂▃▄▅▆▇█"), screen
        tmux("send-keys", "-t", "t", "Enter")
        screen = tmux.wait_for("└ rank 1", timeout=10)
        tmux("send-keys", "-t", "t", "q")
        assert wait_for(lambda: "no server" in tmux("list-sessions") or not tmux("list-sessions"), timeout=10)
    finally:
        subprocess.run(["tmux", "-L", tmux.socket, "kill-server"], capture_output=True)
