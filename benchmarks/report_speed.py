"""``dlmon report`` end to end against a plain ``json.loads`` loop over the same file (issue 26).

A recording is built from real snapshots: ``--source FILE`` (a ``dlmon record``/``run --record``
file of a real job; its snapshot lines are repeated, times shifted, to ``--lines``), or, without
it, snapshots of this process sampled for real. Then, each in a fresh interpreter and alternated
``--rounds`` times (the machine's load drifts alike for all):

- ``json.loads``: ``for line in open(path, "rb"): json.loads(line)`` — the floor any reader pays;
- ``report, sidecar``: ``python -m dlmon report FILE`` to /dev/null, FILE with the summary
  checkpoint the recorder leaves beside it (``FILE.dlmon-summary``, made here by feeding each line
  to the recorder's own :class:`~dlmon.flow.sidecar.CheckpointWriter`): hashing the covered bytes,
  then the lines after them;
- ``report, no sidecar``: the same command on a copy without it (an older recording, a copy of
  the record alone) — reading every line, checks, summary, text;
- with ``--gz``, both again on a gzip'd record (each line fully flushed, as the recorder writes);
- ``--before DIR``: the same command from another dlmon tree (``git archive REV dlmon | tar -x
  -C DIR``), e.g. the code before a change.

It prints each round, the median lines/s of each and the ratio of the medians, what a day at 1 Hz
(86 400 such lines) would take, then (``--parts``) the cost of each stage in this process, per
line (the fastest of the rounds): json.loads alone, the report's checked reader (json.loads and
the checks), the full reader (typed Snapshots), and the summary of already-read records. Last,
the time to read a gzip of ``--blank`` million blank lines (skipped at the byte level). With
``--recording`` it measures, in this process, what the checkpoints cost the recorder: each
``RecordWriter.write`` with and without them, and one checkpoint's save.

    python benchmarks/report_speed.py --source run.jsonl --lines 20000 --parts
    python benchmarks/report_speed.py --lines 20000 --blank 400 --before /tmp/before
    python benchmarks/report_speed.py --source run.jsonl --lines 86400 --gz --recording
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
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


def add_sidecar(path: Path) -> float:
    """Feed each line of ``path`` to the recorder's checkpoint writer and save: the sidecar
    ``dlmon record`` would have left. Returns the CPU seconds it took a line."""
    from dlmon.flow.sidecar import CheckpointWriter

    t = time.process_time()
    writer = CheckpointWriter(str(path), time.monotonic)
    lines = 0
    with open(path, "rb") as fh:
        for line in fh:
            writer.add(line)
            lines += 1
    writer.close()
    assert writer.stopped == "closed", writer.stopped
    return (time.process_time() - t) / lines


def add_sidecar_gz(path: Path, gz: Path) -> None:
    """The sidecar of ``gz``: ``path``'s (it covers the uncompressed stream, the same bytes)."""
    from dlmon.flow.sidecar import sidecar_path

    shutil.copyfile(sidecar_path(str(path)), sidecar_path(str(gz)))


def gzip_as_recorded(path: Path, out: Path) -> None:
    """``path`` gzip'd line by line with a full flush after each, as RecordWriter writes .gz."""
    z = zlib.compressobj(6, zlib.DEFLATED, 31)
    with open(path, "rb") as src, open(out, "wb") as dst:
        for line in src:
            dst.write(z.compress(line) + z.flush(zlib.Z_FULL_FLUSH))
        dst.write(z.flush(zlib.Z_FINISH))


def recording_cost(path: Path, ticks: int, rounds: int) -> None:
    """CPU time of ``RecordWriter.write`` per snapshot with and without checkpoints (the fastest
    of ``rounds``), and of one checkpoint's save, in this process."""
    from dlmon.flow.recording import RecordWriter
    from dlmon.flow.sidecar import CheckpointWriter
    from dlmon.model.serialize import snapshot_from_dict

    with open(path, "rb") as fh:
        raw = [json.loads(x) for x in itertools.islice(fh, ticks)]
    snaps = [snapshot_from_dict(x) for x in raw if x.get("type") == "snapshot"]
    best = {True: float("inf"), False: float("inf")}
    with tempfile.TemporaryDirectory(prefix="dlmon-record-bench-") as tmp:
        for _ in range(rounds):
            for checkpoints in (False, True):
                out = os.path.join(tmp, f"r{checkpoints}.jsonl")
                writer = RecordWriter(out, checkpoints=checkpoints, clock=lambda: 0.0)  # no save, no fsync
                t = time.process_time()
                for snap in snaps:
                    writer.write(snap)
                best[checkpoints] = min(best[checkpoints], (time.process_time() - t) / len(snaps))
                writer.close()
        saver = CheckpointWriter(os.path.join(tmp, "s.jsonl"), time.monotonic)
        with open(path, "rb") as fh:
            for line in fh:
                saver.add(line)
        saves = []
        for _ in range(rounds):
            saver._saved_bytes = -1  # save again
            t = time.process_time()
            saver.save()
            saves.append(time.process_time() - t)
        size = os.path.getsize(saver.path)
    plain, checked = best[False], best[True]
    print(f"recording cost per tick ({len(snaps)} snapshots, CPU, fastest of {rounds}):")
    print(f"  RecordWriter.write, no checkpoints  : {plain * 1e6:7.1f} us")
    print(
        f"  RecordWriter.write, with checkpoints: {checked * 1e6:7.1f} us (+{(checked - plain) * 1e6:.1f} us)"
    )
    print(f"  one checkpoint's save ({size / 1024:.0f} KiB; every 30 s): {min(saves) * 1e3:.1f} ms")


def timed(args: list[str], root: Path = ROOT) -> float:
    """Seconds ``args`` took with ``root``'s dlmon: run from there too, since ``python -m`` puts
    the working directory ahead of PYTHONPATH. Its CPU time (user + system) goes to ``CPU``."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env, cwd=root)
    took = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU[" ".join(args)] = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return took


CPU: dict[str, float] = {}  # the CPU seconds of the last run of each command


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
    p.add_argument("--gz", action="store_true", help="also the reports of a gzip'd record")
    p.add_argument("--recording", action="store_true", help="also what checkpoints cost the recorder")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="dlmon-report-bench-") as tmp:
        path = Path(tmp, "run.jsonl")
        snaps = source_lines(a.source)
        size = build(path, snaps, a.lines)
        print(f"{a.lines} lines, {size / a.lines / 1024:.1f} KiB a line ({len(snaps)} distinct snapshots)")
        bare = Path(tmp, "copied-alone.jsonl")
        shutil.copyfile(path, bare)
        feed = add_sidecar(path)
        print(f"sidecar made by the recorder's writer: {feed * 1e6:.1f} us a line")

        def report(record: Path) -> list[str]:
            return [sys.executable, "-m", "dlmon", "report", str(record)]

        contenders: list[tuple[str, Callable[[], float]]] = [
            ("json.loads loop", lambda: timed([sys.executable, "-c", LOADS, str(path)])),
            ("dlmon report, sidecar", lambda: timed(report(path))),
            ("dlmon report, no sidecar", lambda: timed(report(bare))),
        ]
        if a.gz:
            gz, gz_bare = Path(tmp, "run.jsonl.gz"), Path(tmp, "copied-alone.jsonl.gz")
            gzip_as_recorded(path, gz)
            shutil.copyfile(gz, gz_bare)
            add_sidecar_gz(path, gz)
            contenders += [
                ("report .gz, sidecar", lambda: timed(report(gz))),
                ("report .gz, no sidecar", lambda: timed(report(gz_bare))),
            ]
        if a.before:
            before = a.before.resolve()
            contenders.append((f"report of {before}", lambda: timed(report(bare), before)))
        times: dict[str, list[float]] = {name: [] for name, _ in contenders}
        cpu: dict[str, list[float]] = {name: [] for name, _ in contenders}
        for i in range(a.rounds):
            for name, run in contenders:
                CPU.clear()
                times[name].append(run())
                cpu[name].append(sum(CPU.values()))
            print(f"round {i + 1}: " + ", ".join(f"{name} {times[name][-1]:.2f} s" for name, _ in contenders))
        median = {name: statistics.median(t) for name, t in times.items()}
        loads = median["json.loads loop"]
        print(f"medians of {a.rounds} rounds (interpreter start included):")
        for name, _ in contenders:
            m = median[name]
            c = statistics.median(cpu[name])
            print(
                f"  {name:26s}: {a.lines / m:9.0f} lines/s ({m:.2f} s), {m / loads:.2f}x json.loads' time;"
                f" CPU {c:.2f} s ({a.lines / c:.0f} lines/s of CPU)"
            )
        for name in ("dlmon report, sidecar", "dlmon report, no sidecar"):
            day = 86_400 * median[name] / a.lines
            print(f"a day at 1 Hz (86 400 such lines), {name}, at this rate: ~{day:.1f} s")
        if a.recording:
            recording_cost(path, 200, a.rounds)
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
