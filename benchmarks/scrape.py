"""What a Prometheus scrape of dlmon costs, and what publishing a snapshot costs the sampler.

Builds a snapshot of a big job from a real one (this process, sampled for real), widened to
1 main + ``--workers`` workers, 2 loaders, 8 GPUs, 4 disks and 5 alerts, then measures:

- publish: ``Exporter(snapshot)`` — on the sampling thread, once per tick;
- render: the /metrics body (``generate_latest``) — on the HTTP thread, once per new snapshot;
- HTTP: a GET of /metrics over loopback, end to end (client included), of a snapshot already
  rendered (cached bytes) and right after a new snapshot (renders);
- a real ``Sampler.sample()`` of this small process, for scale.

    python benchmarks/scrape.py                  # 32 workers, 2000 rounds
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
import urllib.request

from dlmon.analysis import Analyzer
from dlmon.collect.sampler import Sampler
from dlmon.export.prometheus import Address, Exporter, exposition, serve
from dlmon.model import Alert, DiskSample, GpuDevice, LoaderSample, Snapshot


def big_snapshot(workers: int) -> Snapshot:
    sampler = Sampler(os.getpid())
    sampler.sample()
    time.sleep(0.2)
    real = Analyzer()(sampler.sample())
    sampler.close()
    main = real.processes[0]
    procs = [main] + [
        dataclasses.replace(main, pid=100_000 + i, role="worker", worker_id=i % (workers // 2 or 1))
        for i in range(workers)
    ]
    half = workers // 2
    loaders = tuple(
        LoaderSample(
            id=f"{main.pid}:{n}",
            name=f"train.py:{40 + n}",
            pid=main.pid,
            num_workers=half,
            batch_size=64,
            batches_total=12345,
            samples_total=12345 * 64,
            batches_per_s=30.0,
            samples_per_s=1920.0,
            data_wait_fraction=0.1,
            worker_pids=tuple(100_000 + n * half + i for i in range(half)),
            batches_per_worker=tuple(1000 for _ in range(half)),
        )
        for n in range(2)
    )
    gpus = tuple(GpuDevice(i, "H100", f"GPU-{i}", 40 << 30, 80 << 30, 97.0) for i in range(8))
    disks = tuple(DiskSample(f"nvme{i}n1", 10.0, 5.0, 1e8, 1e7, 40.0, 0.2, 0.5, 1.5) for i in range(4))
    alerts = tuple(
        Alert("memory_growth", "warning", f"worker {i} (pid {100_000 + i})", "grows", "fix", time.time())
        for i in range(5)
    )
    return dataclasses.replace(
        real, processes=tuple(procs), loaders=loaders, gpus=gpus, disks=disks, alerts=alerts
    )


def per_call_us(fn: object, rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - start) / rounds * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2000)
    args = p.parse_args()
    snapshot = big_snapshot(args.workers)
    exporter = Exporter()
    publish = per_call_us(lambda: exporter(snapshot), args.rounds)
    body = exposition(exporter)
    render = per_call_us(lambda: exposition(exporter), args.rounds // 4)
    server = serve(exporter, Address("127.0.0.1", 0))
    url = f"http://127.0.0.1:{server.port}/metrics"
    get = lambda: urllib.request.urlopen(url).read()  # noqa: E731
    get()
    cached = per_call_us(get, args.rounds // 10)
    fresh = per_call_us(lambda: (exporter(snapshot), get()), args.rounds // 10)
    server.close()
    sampler = Sampler(os.getpid())
    sampler.sample()
    tick = per_call_us(sampler.sample, 50)
    sampler.close()
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    print(f"snapshot: 1 main + {args.workers} workers, 2 loaders, 8 GPUs, 4 disks, 5 alerts")
    print(f"/metrics body: {len(body) / 1024:.1f} KiB, {series} series")
    print(f"publish (sampler thread, per tick)   {publish:9.1f} us")
    print(f"render (HTTP thread, once per new snapshot) {render:9.1f} us")
    print(f"HTTP GET, snapshot already rendered (cached) {cached:9.1f} us")
    print(f"HTTP GET after a new snapshot (renders)      {fresh:9.1f} us")
    print(f"for scale: Sampler.sample() of this one small process {tick:9.1f} us")


if __name__ == "__main__":
    main()
