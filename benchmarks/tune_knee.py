"""Is ``dlmon tune``'s knee where a manual run puts it? Side by side on the CPU-heavy test script.

    PYTHONPATH=. python benchmarks/tune_knee.py [--workers 0,1,2] [--seconds 4] [--batch-size 16]

For each worker count it runs tests/tune_scripts/cpu_heavy.py by hand (its own perf_counter
measurement after the same warm-up: 3 batches and 1 s), then ``dlmon tune`` over the same grid,
and prints both speeds, their ratio, and each side's knee (the fewest workers reaching 95% of the
best speed). The target (issue 10): the knee within 10%. Figures on a loaded machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from dlmon.tune.model import knee

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "tune_scripts" / "cpu_heavy.py"


def manual(workers: int, batch: int, seconds: float) -> float:
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--workers",
            str(workers),
            "--batch-size",
            str(batch),
            "--measure",
            str(seconds),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return float(out.stdout.split()[-1])


def tuned(workers: list[int], batch: int, seconds: float) -> dict[int, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sweep.json")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "dlmon",
                "tune",
                "--no-plot",
                "--workers",
                ",".join(map(str, workers)),
                "--batch-sizes",
                str(batch),
                "--seconds-per-config",
                str(seconds),
                "--json",
                path,
                "--",
                sys.executable,
                str(SCRIPT),
            ],
            check=True,
            timeout=900,
            capture_output=True,
        )
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    return {
        r["config"]["workers"]: r["samples_per_s"] or 0.0 for r in data["results"] if r["outcome"] == "ok"
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", default="0,1,2")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--batch-size", type=int, default=16)
    a = p.parse_args()
    workers = [int(w) for w in a.workers.split(",")]
    by_hand = {w: manual(w, a.batch_size, a.seconds) for w in workers}
    by_tune = tuned(workers, a.batch_size, a.seconds)
    print(f"{'workers':>7}  {'manual':>10}  {'dlmon tune':>10}  {'tune/manual':>11}")
    for w in workers:
        t = by_tune.get(w)
        ratio = f"{t / by_hand[w]:.2f}" if t else "n/a"
        print(f"{w:>7}  {by_hand[w]:>10.1f}  {t if t else float('nan'):>10.1f}  {ratio:>11}")
    k_hand = knee(sorted(by_hand.items()))
    k_tune = knee(sorted(by_tune.items()))
    print(f"knee: manual {k_hand} workers, dlmon tune {k_tune} workers")
    if k_hand is not None and k_tune is not None and k_tune in by_hand:
        gap = abs(by_hand[k_tune] - by_hand[k_hand]) / by_hand[k_hand]
        print(f"manual speed at tune's knee vs at the manual knee: {gap:.0%} apart (target: within 10%)")


if __name__ == "__main__":
    main()
