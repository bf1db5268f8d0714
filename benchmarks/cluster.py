"""What ``dlmon cluster`` costs for a fleet: 64 (or 512) nodes x 8 ranks of synthetic exporters.

A child process serves ``--nodes`` real dlmon exporters on loopback (``dlmon.export.prometheus.
serve``), each pinned to a snapshot widened from a real sample of this process to ``--ranks``
ranks (a trainer and 4 DataLoader workers each, a loader per rank, 8 GPUs, 2 disks, 2 alerts,
one rank slowed). Measured in this process, side by side over the same exporters:

- baseline: fetching every node's /metrics concurrently, bodies read, nothing parsed;
- direct: ``dlmon cluster``'s refresh, one scrape per node (``--window 0``): fetch, parse, view;
- parse+view: the same on bodies already fetched (the CPU dlmon adds to the fetch);
- prometheus (with ``--prometheus``, when the server is installed): a real Prometheus scraping
  every exporter, read through its HTTP API as ``dlmon cluster --prometheus`` does.

Each reports wall time and this process's CPU time per refresh (median of ``--rounds``), and the
series each node serves.

    python benchmarks/cluster.py                       # 64 nodes x 8 ranks, 10 rounds
    python benchmarks/cluster.py --prometheus
    python benchmarks/cluster.py --nodes 512 --prometheus --scrape-interval 15 --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dlmon.analysis import Analyzer
from dlmon.cluster.command import ClusterOptions, reader
from dlmon.cluster.exposition import parse
from dlmon.cluster.promapi import read_trends
from dlmon.cluster.readings import NodeReading
from dlmon.cluster.scrape import NEEDED_SET
from dlmon.cluster.trend import slots
from dlmon.cluster.view import cluster_view
from dlmon.collect.sampler import Sampler
from dlmon.export.prometheus import Address, Exporter, serve
from dlmon.model import Alert, DiskSample, GpuDevice, LoaderSample, Snapshot

WORKERS_PER_RANK = 4


def node_snapshot(node: int, ranks: int, slow_rank: int) -> Snapshot:
    sampler = Sampler(os.getpid())
    sampler.sample()
    time.sleep(0.1)
    real = Analyzer()(sampler.sample())
    sampler.close()
    main = real.processes[0]
    procs, loaders = [], []
    for local in range(ranks):
        rank = node * ranks + local
        trainer = 10_000 + local * 10
        workers = [trainer + 1 + w for w in range(WORKERS_PER_RANK)]
        ranked = {"rank": rank, "local_rank": local, "node_rank": node}
        procs.append(dataclasses.replace(main, pid=trainer, role="child", **ranked))
        procs += [
            dataclasses.replace(main, pid=w, role="worker", worker_id=i, **ranked)
            for i, w in enumerate(workers)
        ]
        wait = 0.55 if rank == slow_rank else 0.04
        loaders.append(
            LoaderSample(
                id=f"{trainer}:1",
                name="train.py:40",
                pid=trainer,
                num_workers=WORKERS_PER_RANK,
                batch_size=64,
                batches_total=12345,
                samples_total=12345 * 64,
                batches_per_s=30.0,
                samples_per_s=1920.0,
                data_wait_fraction=wait,
                wall_wait_fraction=wait,
                worker_pids=tuple(workers),
                batches_per_worker=(3000,) * WORKERS_PER_RANK,
                role="train",
                rank=rank,
                local_rank=local,
                node_rank=node,
                world_size=ranks * 64,
            )
        )
    gpus = tuple(GpuDevice(i, "H100", f"GPU-{i}", 40 << 30, 80 << 30, 97.0) for i in range(8))
    disks = tuple(DiskSample(f"nvme{i}n1", 100.0, 10.0, 1e8, 1e6, 20.0, 0.5, 1.0, 0.3) for i in range(2))
    alerts = (
        Alert("input_bound", "warning", "loader x", "m", "a", 0.0, {"cause": "cpu"}),
        Alert("memory_growth", "info", "job", "m", "a", 0.0, {"eta_s": 3600.0}),
    )
    return dataclasses.replace(
        real,
        host=f"node{node:03d}",
        processes=tuple(procs),
        loaders=tuple(loaders),
        gpus=gpus,
        disks=disks,
        alerts=alerts,
        time=time.time(),
    )


def serve_fleet(nodes: int, ranks: int) -> None:
    """The child: serve ``nodes`` exporters, print their ports as one JSON line, wait for stdin."""
    ports = []
    for node in range(nodes):
        exporter = Exporter()
        exporter(node_snapshot(node, ranks, slow_rank=ranks * (nodes // 2) + 3))
        ports.append(serve(exporter, Address("127.0.0.1", 0)).port)
    print(json.dumps(ports), flush=True)
    sys.stdin.read()


def timed(fn: Callable[[], object], rounds: int) -> tuple[float, float, object]:
    """(median wall s, median CPU s of this process, the last result)."""
    walls, cpus = [], []
    result: object = None
    for _ in range(rounds):
        w0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus), result


def fetch_all(urls: list[str]) -> list[bytes]:
    def get(url: str) -> bytes:
        with urllib.request.urlopen(url, timeout=10) as response:
            return bytes(response.read())

    with ThreadPoolExecutor(max_workers=min(64, len(urls))) as pool:
        return list(pool.map(get, urls))


def prometheus_run(nodes: list[str], rounds: int, scrape_s: float) -> tuple[float, float, object] | None:
    if shutil.which("prometheus") is None:
        print("prometheus: not installed, skipped")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(
            f"global:\n  scrape_interval: {scrape_s:g}s\n  scrape_timeout: {scrape_s:g}s\n"
            "scrape_configs:\n  - job_name: fleet\n"
            f"    static_configs:\n      - targets: {json.dumps(nodes)}\n"
        )
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp}/data",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            options = ClusterOptions((), f"http://127.0.0.1:{port}", "fleet", None, 30.0, 2.0)
            read = reader(options)
            deadline = time.monotonic() + 90 + 10 * scrape_s
            while time.monotonic() < deadline:
                try:
                    view = read()
                    if len(view.nodes) == len(nodes) and all(len(n.ranks) > 0 for n in view.nodes):
                        break
                except Exception:
                    pass
                time.sleep(1)
            time.sleep(3 * scrape_s)  # a window of scrapes for avg_over_time, a trend of a few slots
            where = slots(options.trend_s, time.time())
            trends = timed(lambda: read_trends(options.prometheus or "", "fleet", None, where, 30.0), rounds)
            print(
                f"prometheus, the 2 range queries (trends) alone: {trends[0] * 1000:.0f} ms wall, "
                f"{trends[1] * 1000:.0f} ms CPU"
            )
            return timed(read, rounds)
        finally:
            server.terminate()
            server.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--prometheus", action="store_true")
    ap.add_argument("--scrape-interval", type=float, default=1.0, help="Prometheus's, seconds")
    ap.add_argument("--no-direct", action="store_true", help="only the baseline and Prometheus")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve_fleet(args.nodes, args.ranks)
        return
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--nodes", str(args.nodes), "--ranks", str(args.ranks)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        ports = json.loads(child.stdout.readline())
        nodes = [f"127.0.0.1:{p}" for p in ports]
        urls = [f"http://{n}/metrics" for n in nodes]
        fetch_all(urls)  # warm: each exporter renders its snapshot once, then serves cached bytes
        bodies = fetch_all(urls)
        per_node = [len(parse(b.decode())) for b in bodies]
        print(
            f"{args.nodes} nodes x {args.ranks} ranks: {statistics.median(per_node):.0f} series per node, "
            f"{sum(per_node)} in all, {statistics.median(len(b) for b in bodies) / 1024:.0f} KiB per node"
        )
        base = timed(lambda: fetch_all(urls), args.rounds)
        options = ClusterOptions(tuple(nodes), None, None, None, 10.0, 0.0)
        direct = timed(reader(options), 1 if args.no_direct else args.rounds)

        def parse_and_view() -> object:
            now = time.time()
            readings = [
                NodeReading(n, parse(b.decode(), NEEDED_SET), now) for n, b in zip(nodes, bodies, strict=True)
            ]
            return cluster_view(readings, "bench", now)

        local = timed(parse_and_view, args.rounds)
        view = direct[2]
        print(f"straggler found: {getattr(view, 'straggler_note', '?')[:100]}")
        print(f"{'':34} {'wall/refresh':>13} {'CPU/refresh':>12}")
        rows = [
            ("baseline: fetch every /metrics", base),
            ("dlmon cluster (direct scrape)", direct),
            ("  of which parse + view (no I/O)", local),
        ]
        if args.prometheus:
            prom = prometheus_run(nodes, args.rounds, args.scrape_interval)
            if prom is not None:
                rows.append(("dlmon cluster --prometheus", prom))
                trends = sum(1 for n in getattr(prom[2], "nodes", ()) if n.batches_per_s_trend is not None)
                print(f"prometheus: {trends} of {len(nodes)} nodes with a trend (range queries)")
        for name, (wall, cpu, _) in rows:
            print(f"{name:34} {wall * 1000:10.0f} ms {cpu * 1000:9.0f} ms")
        print(f"direct / baseline: wall {direct[0] / base[0]:.1f}x, CPU {direct[1] / base[1]:.1f}x")
    finally:
        child.kill()
        child.wait()


if __name__ == "__main__":
    main()
