"""How much reading smaps_rollup stalls the training it watches.

Reading /proc/PID/smaps_rollup walks the target's page tables under its mmap lock; the kernel
drops the lock between VMAs when someone waits for it, but not inside one, so an ``mmap`` or
``munmap`` in the training waits for the walk of a whole large VMA. This benchmark starts a
"trainer" holding one ``--gib`` GiB anonymous VMA (4 KiB pages: MADV_NOHUGEPAGE, the worst case)
that maps, touches and unmaps 64 KiB in a loop for ``--seconds`` and times every iteration, under:

- **alone**: nothing reads it;
- **naive**: smaps_rollup read every ``--naive-interval`` s (0.3 s: a monitor reading PSS often);
- **dlmon**: ``Sampler.sample()`` once a second with the default budget (the loop faults pages
  all the time, so dlmon sees the trainer moving and wants its PSS every second; the stall bound
  spaces the reads to at least the last read's wall time / ``max_stall_fraction``).

It prints, per mode, the iterations, their p50 / p99 / p99.9 / worst latency, the iterations over
1 ms, and the smaps reads made with their wall time. Modes alternate (alone, naive, dlmon, ...)
``--rounds`` times so machine noise hits them alike.

    python benchmarks/smaps_stall.py                    # 4 GiB VMA, 10 s per mode, 2 rounds
    python benchmarks/smaps_stall.py --gib 1 --seconds 5 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import statistics
import sys
import time

from dlmon.collect.sampler import Sampler

CHUNK = 64 * 1024


def trainer(gib: float, out_fd: int, go_fd: int) -> None:
    """Child: hold the big VMA, then time mmap/touch/munmap iterations until SIGTERM."""
    size = int(gib * 1024**3)
    big = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    big.madvise(mmap.MADV_NOHUGEPAGE)
    for i in range(0, size, 4096):
        big[i] = 1
    os.write(out_fd, b"R")
    stop = False

    def on_term(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    while True:  # one measurement per byte received on go_fd; EOF ends
        if not os.read(go_fd, 1):
            os._exit(0)
        stop = False
        latencies: list[int] = []
        clock = time.perf_counter_ns
        while not stop:
            start = clock()
            m = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m[0] = 1
            m[CHUNK - 1] = 1
            m.close()
            latencies.append(clock() - start)
        payload = json.dumps(summarize(latencies)).encode() + b"\n"
        os.write(out_fd, payload)


def summarize(latencies: list[int]) -> dict[str, float]:
    ordered = sorted(latencies)
    n = len(ordered)

    def pct(q: float) -> float:
        return ordered[min(n - 1, int(q * n))] / 1e6

    return {
        "n": n,
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "p999_ms": pct(0.999),
        "max_ms": ordered[-1] / 1e6,
        "over_1ms": sum(1 for x in ordered if x > 1_000_000),
    }


def read_line(fd: int) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            raise RuntimeError("the trainer died")
        data += chunk
    return data


def measure(
    mode: str, pid: int, go_w: int, out_r: int, seconds: float, naive_interval: float
) -> dict[str, float]:
    os.write(go_w, b"g")
    reads: list[float] = []
    end = time.monotonic() + seconds
    if mode == "naive":
        while time.monotonic() < end:
            start = time.perf_counter()
            with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
                fh.read()
            reads.append(time.perf_counter() - start)
            time.sleep(naive_interval)
    elif mode == "dlmon":
        sampler = Sampler(pid)
        next_tick = time.monotonic()
        while time.monotonic() < end:
            sampler.sample()
            tracker = sampler.processes
            if tracker.smaps_reads_last_tick:  # the read's own wall time, not the whole tick's
                wall = tracker._tracked[tracker.target_identity].smaps_wall_s
                reads.append(float("nan") if wall is None else wall)
            next_tick += 1.0
            time.sleep(max(0.0, next_tick - time.monotonic()))
        sampler.close()
    else:
        time.sleep(seconds)
    os.kill(pid, signal.SIGTERM)
    result = json.loads(read_line(out_r))
    result["reads"] = len(reads)
    result["read_ms"] = statistics.median(reads) * 1e3 if reads else float("nan")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--naive-interval", type=float, default=0.3)
    args = parser.parse_args()

    out_r, out_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(out_r)
        os.close(go_w)
        trainer(args.gib, out_w, go_r)
    os.close(out_w)
    os.close(go_r)
    try:
        if os.read(out_r, 1) != b"R":
            raise RuntimeError("the trainer did not start")
        modes = ("alone", "naive", "dlmon")
        results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                results[mode].append(measure(mode, pid, go_w, out_r, args.seconds, args.naive_interval))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print(f"trainer: one {args.gib:g} GiB VMA (4 KiB pages), 64 KiB mmap/touch/munmap in a loop;")
    print(f"{args.rounds} rounds x {args.seconds:g} s per mode, alternating")
    print()
    print("| mode | iterations | p50 ms | p99 ms | p99.9 ms | worst ms | > 1 ms | smaps reads | read ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, runs in results.items():
        for r in runs:
            print(
                f"| {mode} | {r['n']:.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['p999_ms']:.3f}"
                f" | {r['max_ms']:.2f} | {r['over_1ms']:.0f} | {r['reads']:.0f} | {r['read_ms']:.1f} |"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
