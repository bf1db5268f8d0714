"""The process tracker of this tree beside a baseline's, on one real tree, ticks interleaved.

    python benchmarks/tracker_build.py --baseline main             # 32 workers, 2% busy each
    python benchmarks/tracker_build.py --baseline HEAD~1 --busy 0 --runs 5

Builds the tree of ``benchmarks/sampler.py`` (1 main + ``--workers`` forked workers, each
computing ``--busy`` of a core so its row is built anew every tick) and samples it with two
``ProcessTracker``\\ s: this tree's and the one in ``dlmon/collect/processes.py`` at git ref
``--baseline`` (loaded beside it; its imports are this tree's, so only a change of that module is
compared). Their ticks alternate, first one then the other, on the same processes at the same
moments, so the machine's load hits both alike: the CPU of each phase is printed as a ratio,
this tree / baseline, never as a timed target. Which processes had status and io read differs
between the two only by when each looked (a worker's CPU moves in 10 ms steps): the counts of
processes read by one tracker only are printed, both ways, as a check of the cadence.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from sampler import build_tree

from dlmon.collect import processes
from dlmon.collect.smaps_budget import SmapsBudget

ROOT = Path(__file__).resolve().parent.parent


def baseline_module(ref: str, into: str) -> ModuleType:
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:dlmon/collect/processes.py"],
        check=True,
        capture_output=True,
    ).stdout
    path = Path(into) / "processes_baseline.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("processes_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it is executed
    spec.loader.exec_module(module)
    return module


def one_run(base: ModuleType, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    main_pid = build_tree(args.workers, args.gib, busy=args.busy)
    try:
        trackers = {
            "baseline": base.ProcessTracker(main_pid, SmapsBudget(unlimited=True)),
            "this tree": processes.ProcessTracker(main_pid, SmapsBudget(unlimited=True)),
        }
        phases: dict[str, dict[str, list[float]]] = {n: {"reads": [], "build": []} for n in trackers}
        status_reads = {n: 0 for n in trackers}
        only = {n: 0 for n in trackers}  # processes whose status one read and the other did not
        for tick in range(args.ticks):
            read: dict[str, set[int]] = {}
            for name in sorted(trackers, reverse=tick % 2 == 1):
                tracker = trackers[name]
                tracker.sample()
                read[name] = set(tracker.status_read_last_tick)
                if tick >= args.warmup:
                    phases[name]["reads"].append(tracker.cost.reads)
                    phases[name]["build"].append(tracker.cost.build)
                    status_reads[name] += len(read[name])
            if tick >= args.warmup:
                only["baseline"] += len(read["baseline"] - read["this tree"])
                only["this tree"] += len(read["this tree"] - read["baseline"])
            time.sleep(args.interval)
        for tracker in trackers.values():
            tracker.close()
    finally:
        os.killpg(main_pid, signal.SIGKILL)
        os.waitpid(main_pid, 0)
    return {
        name: {
            "reads_ms": 1e3 * statistics.fmean(phases[name]["reads"]),
            "build_ms": 1e3 * statistics.fmean(phases[name]["build"]),
            "status_reads": status_reads[name] / (args.ticks - args.warmup),
            "only": only[name],
        }
        for name in trackers
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", required=True, help="a git ref whose processes.py runs beside")
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--gib", type=float, default=0.05, help="GiB the workers share")
    parser.add_argument("--busy", type=float, default=0.02, metavar="F", help="each worker's share of a core")
    parser.add_argument("--ticks", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = baseline_module(args.baseline, tmp)
        print(f"1 main + {args.workers} workers, each {args.busy:.0%} busy; {args.ticks} ticks per run")
        print("| run | build ms/tick, baseline / this tree | ratio | reads ms/tick | ratio |"
              " status reads/tick | read by one only (baseline / this tree) |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|")
        ratios = []
        for run in range(1, args.runs + 1):
            r = one_run(base, args)
            b, t = r["baseline"], r["this tree"]
            ratios.append(t["build_ms"] / b["build_ms"])
            print(
                f"| {run} | {b['build_ms']:.3f} / {t['build_ms']:.3f} | {ratios[-1]:.3f} |"
                f" {b['reads_ms']:.3f} / {t['reads_ms']:.3f} | {t['reads_ms'] / b['reads_ms']:.3f} |"
                f" {b['status_reads']:.1f} / {t['status_reads']:.1f} | {b['only']} / {t['only']} |"
            )
    print(f"build, this tree / baseline: median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
