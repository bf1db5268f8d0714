"""What the analysis costs per tick as its window fills, at 1 Hz and 10 Hz, with 1 to 64 workers.

    python benchmarks/analysis_cost.py [--rates 1 10] [--workers 1 32 64] [--seconds 180]
    python benchmarks/analysis_cost.py --baseline main      # the same, beside main's code
    python benchmarks/analysis_cost.py --profile 10 32      # cProfile of one configuration

A synthetic healthy job (1 trainer + N DataLoader workers, every process with its fd count and
limit as the sampler gives them, PSS read on a 10 s budget, one loader delivering 8 batches/s,
one disk) is fed tick by tick to one ``Analyzer``, as the live source does, for ``--seconds`` of
simulated time at each rate. CPU per ``Analyzer`` call (``time.process_time``) is averaged over
buckets of simulated time: the recent window (120 s) fills over the first two minutes, so a cost
that grows with the window grows across the first buckets and a bounded one does not. "share of a
core" is the steady per-tick CPU times the rate.

With ``--baseline REF`` each configuration is also run with the code of git ref REF (its
``dlmon/`` exported to a temporary directory, run in a subprocess), alternating with this tree's
code so that the machine's load drifts alike for both, and the ratio is printed: the target is a
ratio against the baseline run beside it, never a timed assertion.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dlmon.model import Snapshot

ROOT = Path(__file__).resolve().parent.parent
BUCKETS_S = (10.0, 30.0, 60.0, 90.0, 120.0)  # bucket ends; the last bucket runs to the end (steady)
MIB = 1024 * 1024


def _setup_path(code: str | None) -> None:
    sys.path.insert(0, str(ROOT / "tests"))  # the synthetic snapshot factories
    sys.path.insert(0, code or str(ROOT))


def snapshots(workers: int, rate: float, seconds: float, wait: float) -> Iterator[Snapshot]:
    """The synthetic job, one snapshot per tick (made lazily: building them is not timed)."""
    from dlmon.model import LoaderSample, Pressure, ProcessSample
    from support.snapshots import MAIN_PID, disk, snap

    interval = 1.0 / rate
    n = workers + 1
    refresh_s = 10.0
    pids = tuple(MAIN_PID + 1 + i for i in range(workers))
    for k in range(int(seconds * rate) + 1):
        t = k * interval
        procs = []
        for i in range(n):
            offset = (i * refresh_s / n) % refresh_s
            read_at = max(0.0, math.floor((t - offset) / refresh_s) * refresh_s + offset)
            main = i == 0
            uss = (300 if main else 40) * MIB + (i * 7919 + int(read_at)) % 5 * 0.1 * MIB
            procs.append(
                ProcessSample(
                    pid=MAIN_PID + i,
                    start_time=MAIN_PID + i,
                    ppid=None if main else MAIN_PID,
                    role="main" if main else "worker",
                    comm="python" if main else "pt_data_worker",
                    state="R" if main and k % 3 else "S",
                    worker_id=None if main else i - 1,
                    cpu_percent=95.0 if main else 30.0 + (k + i) % 7,
                    num_threads=12 if main else 1,
                    rss_bytes=int(uss + 400 * MIB),
                    rss_anon_bytes=int(uss + 100 * MIB),
                    shmem_bytes=int(2 * MIB),
                    uss_bytes=int(uss),
                    pss_bytes=int(uss + 400 * MIB / n),
                    swap_bytes=0,
                    pss_age_s=t - read_at,
                    read_bytes_per_s=0.0,
                    nonvoluntary_ctxt_switches_per_s=2.0,
                    num_fds=(64 if main else 12) + (k // 7 + i) % 3,  # sockets and pipes come and go
                    fd_limit=1024,
                )
            )
        batches = int(t * 8.0)
        loader = LoaderSample(
            id="L1",
            name="train.py:42",
            pid=MAIN_PID,
            num_workers=workers,
            batch_size=64,
            pin_memory=True,
            persistent_workers=True,
            prefetch_factor=2,
            batches_total=batches,
            batches_per_s=8.0 if k else None,
            samples_per_s=512.0 if k else None,
            data_wait_fraction=wait,
            wall_wait_fraction=wait,
            worker_pids=pids,
            batches_per_worker=tuple(
                batches // workers + (1 if j < batches % workers else 0) for j in range(workers)
            ),
            in_call_s=0.0 if k % 4 else 0.01,
        )
        yield snap(
            t,
            procs,
            interval=interval if k else None,
            disks=[disk(util=3.0 + k % 5)],
            pressure=Pressure(io_some_avg10=0.5, memory_some_avg10=0.0, cpu_some_avg10=1.0),
            loaders=[loader],
        )


def measure(workers: int, rate: float, seconds: float, wait: float) -> dict[str, object]:
    from dlmon.analysis import Analyzer

    a = Analyzer(cores=16)
    ends = [e for e in BUCKETS_S if e < seconds] + [seconds + 1.0]
    sums = [0.0] * len(ends)
    counts = [0] * len(ends)
    b = 0
    alerts: set[str] = set()
    for s in snapshots(workers, rate, seconds, wait):
        t = s.time - 1_700_000_000.0
        start = time.process_time()
        out = a(s)
        cost = time.process_time() - start
        while t >= ends[b]:
            b += 1
        sums[b] += cost
        counts[b] += 1
        alerts.update(x.kind for x in out.alerts)
    ms = [1000.0 * x / c if c else 0.0 for x, c in zip(sums, counts, strict=True)]
    return {
        "workers": workers,
        "rate": rate,
        "buckets": [
            f"{lo:.0f}-{hi:.0f} s" for lo, hi in zip([0.0, *ends[:-1]], [*ends[:-1], seconds], strict=True)
        ],
        "ms": ms,
        "steady_ms": ms[-1],
        "core_percent": ms[-1] * rate / 10.0,  # ms per tick x ticks/s / 1000 ms x 100 %
        "errors": a.errors,
        "alerts": sorted(alerts),
    }


def profile(workers: int, rate: float, seconds: float, wait: float, top: int) -> None:
    from dlmon.analysis import Analyzer

    a = Analyzer(cores=16)
    prof = cProfile.Profile()
    steady_from = min(seconds - 10.0, 130.0)
    for s in snapshots(workers, rate, seconds, wait):
        if s.time - 1_700_000_000.0 >= steady_from:
            prof.enable()
            a(s)
            prof.disable()
        else:
            a(s)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    ticks = int((seconds - steady_from) * rate)
    print(
        f"cProfile of the ticks from {steady_from:.0f} s on ({ticks} ticks), {workers} workers at {rate:g} Hz"
    )
    print(out.getvalue())


def _exported(ref: str, into: str) -> str:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "dlmon"], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


def _child(code: str | None, workers: int, rate: float, seconds: float, wait: float) -> dict[str, object]:
    argv = [sys.executable, __file__, "--one", str(workers), str(rate), "--seconds", str(seconds)]
    argv += ["--wait", str(wait)]
    if code:
        argv += ["--code", code]
    done = subprocess.run(
        argv, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"}
    )
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def _row(label: str, r: dict[str, object]) -> str:
    ms = " | ".join(f"{x:.3f}" for x in r["ms"])  # type: ignore[attr-defined]
    alerts = ",".join(r["alerts"]) or "-"  # type: ignore[arg-type]
    return f"| {label} | {r['workers']} | {r['rate']:g} Hz | {ms} | {r['core_percent']:.2f}% | {alerts} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 10.0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 32, 64])
    p.add_argument("--seconds", type=float, default=180.0, help="simulated time per configuration")
    p.add_argument("--wait", type=float, default=0.05, help="the loader's data wait (0.3: input-bound)")
    p.add_argument("--baseline", help="a git ref whose code runs beside this tree's")
    p.add_argument("--profile", type=float, nargs=2, metavar=("RATE", "WORKERS"))
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--one", type=float, nargs=2, metavar=("WORKERS", "RATE"), help=argparse.SUPPRESS)
    p.add_argument("--code", help=argparse.SUPPRESS)
    a = p.parse_args()
    _setup_path(a.code)
    if a.one:
        print(json.dumps(measure(int(a.one[0]), a.one[1], a.seconds, a.wait)))
        return
    if a.profile:
        profile(int(a.profile[1]), a.profile[0], a.seconds, a.wait, a.top)
        return
    with tempfile.TemporaryDirectory(prefix="dlmon-analysis-bench-") as tmp:
        base = _exported(a.baseline, tmp) if a.baseline else None
        header: list[str] | None = None
        rows: list[str] = []
        ratios: list[str] = []
        for rate in a.rates:
            for workers in a.workers:
                now = _child(None, workers, rate, a.seconds, a.wait)
                if header is None:
                    header = now["buckets"]  # type: ignore[assignment]
                rows.append(_row("this tree", now))
                if base is not None:
                    then = _child(base, workers, rate, a.seconds, a.wait)
                    rows.append(_row(a.baseline, then))
                    ratio = then["steady_ms"] / max(1e-9, now["steady_ms"])  # type: ignore[operator]
                    ratios.append(f"| {workers} | {rate:g} Hz | {ratio:.1f}x |")
                print(rows[-1], file=sys.stderr, flush=True)  # progress
        assert header is not None
        print(
            f"\nCPU per Analyzer call, ms, by simulated time ({a.seconds:.0f} s per rate, wait {a.wait:g})\n"
        )
        print(f"| code | workers | rate | {' | '.join(header)} | share of a core (steady) | alerts |")
        print("|---|---:|---:|" + "---:|" * len(header) + "---:|---|")
        print("\n".join(rows))
        if ratios:
            print(f"\n| workers | rate | {a.baseline} / this tree, steady ms per tick |\n|---:|---:|---:|")
            print("\n".join(ratios))


if __name__ == "__main__":
    main()
