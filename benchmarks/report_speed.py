"""``dlmon report`` end to end against a plain ``json.loads`` loop over the same file (issue 26).

A recording is built from real snapshots: ``--source FILE`` (a ``dlmon record``/``run --record``
file of a real job; its snapshot lines are repeated, times shifted, to ``--lines``), or, without
it, snapshots of this process sampled for real. Then, each in a fresh interpreter and alternated
``--rounds`` times (the machine's load drifts alike for all):

- ``json.loads``: ``for line in open(path, "rb"): json.loads(line)`` — the floor any reader pays;
- ``report``: ``python -m dlmon report FILE`` to /dev/null — reading, checks, summary, text;
- ``--before DIR``: the same command from another dlmon tree (``git archive REV dlmon | tar -x
  -C DIR``), e.g. the code before a change.

It prints each round, the median lines/s of each and the ratio of the medians, what a day at 1 Hz
(86 400 such lines) would take, then (``--parts``) the cost of each stage in this process, per
line (the fastest of the rounds): json.loads alone, the report's checked reader (json.loads and
the checks), the full reader (typed Snapshots), and the summary of already-read records. Last,
the time to read a gzip of ``--blank`` million blank lines (skipped at the byte level).

    python benchmarks/report_speed.py --source run.jsonl --lines 20000 --parts
    python benchmarks/report_speed.py --lines 20000 --blank 400 --before /tmp/before
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOADS = "import json, sys\nfor line in open(sys.argv[1], 'rb'):\n    json.loads(line)\n"


def source_lines(source: str | None) -> list[dict[str, object]]:
    if source:
        lines = [json.loads(x) for x in Path(source).read_bytes().splitlines() if x.strip()]
        return [x for x in lines if x.get("type") == "snapshot"]
    from dlmon.collect.sampler import Sampler
    from dlmon.model.serialize import snapshot_to_dict

    sampler = Sampler(os.getpid())
    out = []
    for _ in range(20):
        out.append(snapshot_to_dict(sampler.sample()))
        time.sleep(0.05)
    sampler.close()
    return out


def build(path: Path, snaps: list[dict[str, object]], lines: int) -> int:
    first, last = float(snaps[0]["time"]), float(snaps[-1]["time"])  # type: ignore[arg-type]
    span = max(1.0, last - first + 1.0)
    size = 0
    with open(path, "wb") as fh:
        for i in range(lines):
            snap = dict(snaps[i % len(snaps)])
            snap["time"] = float(snap["time"]) + (i // len(snaps)) * span  # type: ignore[arg-type]
            data = (json.dumps(snap, separators=(",", ":")) + "\n").encode()
            size += len(data)
            fh.write(data)
        fh.write(b'{"type":"end","time":1,"reason":"duration"}\n')
    return size


def timed(args: list[str], root: Path = ROOT) -> float:
    """Seconds ``args`` took with ``root``'s dlmon: run from there too, since ``python -m`` puts
    the working directory ahead of PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    t = time.perf_counter()
    subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env, cwd=root)
    return time.perf_counter() - t


def parts(path: Path, lines: int, rounds: int) -> None:
    """Each stage's CPU time per line in this process, the fastest of ``rounds``."""
    from dlmon.flow.records import iter_checked_records, iter_records
    from dlmon.flow.summary import Summarizer

    raw = path.read_bytes().splitlines()
    records = list(iter_checked_records(str(path)))

    def loads() -> None:
        for line in raw:
            json.loads(line)

    def checked() -> None:
        for _ in iter_checked_records(str(path)):
            pass

    def full() -> None:
        for _ in iter_records(str(path)):
            pass

    def summary() -> None:
        summarizer = Summarizer(str(path))
        for record in records:
            summarizer.feed(record)
        summarizer.result()

    stages: list[tuple[str, Callable[[], None]]] = [
        ("json.loads alone", loads),
        ("checked reader (report)", checked),
        ("full reader (typed Snapshots)", full),
        ("summary of read records", summary),
    ]
    best = {name: float("inf") for name, _ in stages}
    for _ in range(rounds):
        for name, stage in stages:
            t = time.process_time()
            stage()
            best[name] = min(best[name], time.process_time() - t)
    for name, _ in stages:
        print(f"  {name:30s}: {best[name] / lines * 1e6:6.1f} us a line")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--source", help="a record file of a real job (default: this process, sampled)")
    p.add_argument("--lines", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--blank", type=int, default=100, help="million blank lines in the gzip case")
    p.add_argument("--before", type=Path, help="a dlmon tree whose report is timed alongside")
    p.add_argument("--parts", action="store_true", help="also each stage's cost in this process")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dlmon-report-bench-") as tmp:
        path = Path(tmp, "run.jsonl")
        snaps = source_lines(a.source)
        size = build(path, snaps, a.lines)
        print(f"{a.lines} lines, {size / a.lines / 1024:.1f} KiB a line ({len(snaps)} distinct snapshots)")
        report = [sys.executable, "-m", "dlmon", "report", str(path)]
        contenders: list[tuple[str, Callable[[], float]]] = [
            ("json.loads loop", lambda: timed([sys.executable, "-c", LOADS, str(path)])),
            ("dlmon report", lambda: timed(report)),
        ]
        if a.before:
            before = a.before.resolve()
            contenders.append((f"report of {before}", lambda: timed(report, before)))
        times: dict[str, list[float]] = {name: [] for name, _ in contenders}
        for i in range(a.rounds):
            for name, run in contenders:
                times[name].append(run())
            print(f"round {i + 1}: " + ", ".join(f"{name} {times[name][-1]:.2f} s" for name, _ in contenders))
        median = {name: statistics.median(t) for name, t in times.items()}
        loads = median["json.loads loop"]
        print(f"medians of {a.rounds} rounds (interpreter start included):")
        for name, _ in contenders:
            m = median[name]
            print(f"  {name:30s}: {a.lines / m:9.0f} lines/s ({m:.2f} s), {m / loads:.2f}x json.loads' time")
        day = 86_400 * median["dlmon report"] / a.lines
        print(f"a day at 1 Hz (86 400 such lines) at this rate: ~{day:.0f} s")
        if a.parts:
            print("per stage, in this process (CPU time, fastest round):")
            parts(path, a.lines, a.rounds)
        blank = Path(tmp, "blank.jsonl.gz")
        with gzip.open(blank, "wb") as fh:
            fh.write(path.read_bytes().split(b"\n", 1)[0] + b"\n")
            for _ in range(a.blank):
                fh.write(b"\n" * 1_000_000)
            fh.write(b'{"type":"end","time":1,"reason":"duration"}\n')
        took = timed([sys.executable, "-m", "dlmon", "report", str(blank)])
        mib = blank.stat().st_size / 2**20
        print(f"gzip of {a.blank} M blank lines ({mib:.1f} MiB): report in {took:.2f} s")


if __name__ == "__main__":
    main()
