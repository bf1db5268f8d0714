"""``dlmon report`` end to end against a plain ``json.loads`` loop over the same file (issue 26).

A recording is built from real snapshots: ``--source FILE`` (a ``dlmon record``/``run --record``
file of a real job; its snapshot lines are repeated, times shifted, to ``--lines``), or, without
it, snapshots of this process sampled for real. Then, each in a fresh interpreter and alternated
``--rounds`` times (the machine's load drifts alike for both):

- ``json.loads``: ``for line in open(path, "rb"): json.loads(line)`` — the floor any reader pays;
- ``report``: ``python -m dlmon report FILE`` to /dev/null — reading, checks, summary, text.

It prints lines/s of each (best round) and their ratio, then the time to read a gzip of
``--blank`` million blank lines (skipped at the byte level).

    python benchmarks/report_speed.py --source run.jsonl --lines 20000
    python benchmarks/report_speed.py --lines 20000 --blank 400
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
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


def timed(args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--source", help="a record file of a real job (default: this process, sampled)")
    p.add_argument("--lines", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blank", type=int, default=100, help="million blank lines in the gzip case")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dlmon-report-bench-") as tmp:
        path = Path(tmp, "run.jsonl")
        snaps = source_lines(a.source)
        size = build(path, snaps, a.lines)
        print(f"{a.lines} lines, {size / a.lines / 1024:.1f} KiB a line ({len(snaps)} distinct snapshots)")
        loads, report = [], []
        for _ in range(a.rounds):
            loads.append(timed([sys.executable, "-c", LOADS, str(path)]))
            report.append(timed([sys.executable, "-m", "dlmon", "report", str(path)]))
        lo, re_ = min(loads), min(report)
        print(f"json.loads loop : {a.lines / lo:9.0f} lines/s ({lo:.2f} s, interpreter start included)")
        print(f"dlmon report    : {a.lines / re_:9.0f} lines/s ({re_:.2f} s)")
        print(f"report / json.loads time: {re_ / lo:.2f}x")
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
