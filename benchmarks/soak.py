"""Soak: dlmon recording a churning training job for a long time (an hour per release).

    python benchmarks/soak.py --duration 3600 --interval 0.1

The job (tests/faults/job.py) respawns its DataLoader workers every epoch (persistent_workers=False),
leaks memory in its main process for a window of epochs and then frees it, and writes + fsyncs an
IO burst every few epochs. ``dlmon record`` samples it at --interval. Every 5 s the soak reads
dlmon's RSS, CPU seconds and open fds. At the end it prints: RSS and CPU slopes (least squares
over the run after a warm-up), fds min/max, record lines whole/torn, and each alert kind with how
often it was raised and cleared, so a reader can check them against the scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from dlmon.flow.sources import read_record  # noqa: E402
from faults.support import Job, cpu_seconds, env_with_dlmon, fd_count, rss_bytes  # noqa: E402


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y)."""
    n = len(points)
    if n < 2:
        return float("nan")
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / den if den else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds (default: an hour)")
    ap.add_argument(
        "--interval", type=float, default=0.1, help="dlmon's sampling interval (default 0.1 s: 10 Hz)"
    )
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds left out of the slopes")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dlmon-soak-"))
    record = work / "soak.jsonl"
    leak = (0.1 * args.duration, 0.4 * args.duration)  # seconds: the leak runs, then is freed
    cfg = {
        "workers": 2, "persistent": False, "epochs": 0, "batches": 40, "batch": 16, "sample_sleep_s": 0.004,
        "leak_mb_per_epoch": 4, "leak_from_s": leak[0], "leak_until_s": leak[1],
        "io_burst_every": 7, "io_burst_mb": 64, "agent": True,
    }  # fmt: skip
    env = env_with_dlmon({"XDG_RUNTIME_DIR": str(work), "DLMON_JOB_TMP": str(work)})
    from dlmon.agent.sitecustomize_hook import pythonpath_with_bootstrap

    env["PYTHONPATH"] = pythonpath_with_bootstrap(env["PYTHONPATH"])
    os.chmod(work, 0o755)
    with Job(cfg, env=env) as job:
        job.wait_batches(5)
        dl = subprocess.Popen(
            [sys.executable, "-m", "dlmon", "record", str(job.pid), "-o", str(record),
             "--interval", str(args.interval)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
        )  # fmt: skip
        start = time.monotonic()
        rss: list[tuple[float, float]] = []
        cpu: list[tuple[float, float]] = []
        fds: list[int] = []
        while time.monotonic() - start < args.duration and dl.poll() is None and job.p.poll() is None:
            time.sleep(5.0)
            t = time.monotonic() - start
            try:
                rss.append((t, rss_bytes(dl.pid) / 2**20))
                cpu.append((t, cpu_seconds(dl.pid)))
                fds.append(fd_count(dl.pid))
            except OSError:
                break
        dl.send_signal(signal.SIGINT)
        try:
            dl.wait(30)
        except subprocess.TimeoutExpired:
            dl.kill()
        epochs = job.epochs
        batches = job.batches()
    lines = record.read_bytes().splitlines(keepends=True)
    whole = 0
    for line in lines:
        try:
            json.loads(line)
            whole += 1
        except ValueError:
            pass
    replay = read_record(str(record))
    raised: dict[str, int] = {}
    cleared: dict[str, int] = {}
    active: set[str] = set()
    for s in replay.snapshots:
        now = {a.kind for a in s.alerts}
        for kind in now - active:
            raised[kind] = raised.get(kind, 0) + 1
        for kind in active - now:
            cleared[kind] = cleared.get(kind, 0) + 1
        active = now
    steady_rss = [(t, y) for t, y in rss if t >= args.warmup]
    steady_cpu = [(t, y) for t, y in cpu if t >= args.warmup]
    elapsed = time.monotonic() - start
    figures = {
        "scenario": f"workers respawn every epoch; leak 4 MiB/epoch from {leak[0]:.0f} s to {leak[1]:.0f} s, "
        "then freed; 64 MiB written+fsynced every 7 epochs",
        "duration_s": round(elapsed),
        "interval_s": args.interval,
        "snapshots": len(replay.snapshots),
        "epochs": epochs,
        "batches": batches,
        "dlmon_rss_mib_first_last": [round(rss[0][1], 1), round(rss[-1][1], 1)] if rss else None,
        "dlmon_rss_slope_mib_per_hour": round(slope(steady_rss) * 3600, 2),
        "dlmon_cpu_percent_of_core": round(100 * slope(steady_cpu), 2),
        "dlmon_cpu_percent_first_half_second_half": _halves(steady_cpu),
        "dlmon_fds_min_max": [min(fds), max(fds)] if fds else None,
        "record_lines": len(lines),
        "record_lines_whole": whole,
        "record_problems": [(p.line, p.reason) for p in replay.problems],
        "end_reason": replay.end_reason,
        "alerts_raised": raised,
        "alerts_cleared": cleared,
        "alerts_active_at_end": sorted(active),
        "dlmon_stderr_tail": (dl.stderr.read().decode(errors="replace")[-300:] if dl.stderr else ""),
    }
    for key, value in figures.items():
        print(f"{key:45} {value}")
    if args.json:
        print(json.dumps(figures))


def _halves(points: list[tuple[float, float]]) -> list[float] | None:
    if len(points) < 4:
        return None
    mid = len(points) // 2
    return [round(100 * slope(points[:mid]), 2), round(100 * slope(points[mid:]), 2)]


if __name__ == "__main__":
    main()
