"""`dlmon report`'s fast path (issue 26): the summary reads each snapshot in its JSON form.

The summary must come out the same, byte for byte, as from typed Snapshots: figure by figure
against the typed readings, and on real recordings made here (`dlmon run --headless --record`),
gzip'd and with damaged lines mixed in, through both readers and through the commands.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dlmon.analysis.job_gpus import job_vram_bytes
from dlmon.export.html import format_html
from dlmon.export.metrics import Published, process_series
from dlmon.export.text import format_markdown, format_text
from dlmon.flow.records import CheckedSnapshot, RecordProblem, iter_checked_records, iter_records
from dlmon.flow.summary import PEAKS, SERIES, Summarizer, Thinned, slot_name, slot_names, summarize
from dlmon.model.serialize import MAX_BYTES, snapshot_to_dict
from dlmon.model.snapshot import Snapshot
from support.export import LOADER_JOB, dlmon_cmd
from support.ui import make_snapshot
from unit.model.test_checked_records import exact, full_snapshot, line_of, replaced

pytestmark = pytest.mark.slow

DEATH_JOB = str(Path(LOADER_JOB).parent / "worker_death_job.py")  # worker 1 SIGKILLs itself


def typed_figures(s: Snapshot) -> dict[str, float | None]:
    """PEAKS' and SERIES' figures as the report read them from a typed Snapshot before issue 26."""

    def total(values: Any) -> float | None:
        known = [v for v in values if v is not None]
        return float(sum(known)) if known else None

    def most(values: Any) -> float | None:
        known = [v for v in values if v is not None]
        return float(max(known)) if known else None

    vram = job_vram_bytes(s)
    moving = any(lo.batches_total for lo in s.loaders)
    samples = total(lo.samples_per_s for lo in s.loaders)
    return {
        "job_pss": s.memory.pss_sum_bytes,
        "rss_sum": s.memory.rss_sum_bytes,
        "job_uss": s.memory.uss_sum_bytes,
        "rss_anon": total(p.rss_anon_bytes for p in s.processes),
        "rss_file": total(p.rss_file_bytes for p in s.processes),
        "swap": total(p.swap_bytes for p in s.processes),
        "shm_used": s.shm.used_bytes if s.shm else None,
        "pinned": s.pinned.bytes if s.pinned else None,
        "cgroup": s.cgroup.current_bytes if s.cgroup else None,
        "vram": None if vram is None else float(vram),
        "fds": total(p.num_fds for p in s.processes),
        "throughput": None
        if not moving
        else samples
        if samples is not None
        else total(lo.batches_per_s for lo in s.loaders),
        "data_wait": most(lo.data_wait_fraction for lo in s.loaders),
        "disk_read": total(d.read_bytes_per_s for d in s.disks),
        "disk_write": total(d.write_bytes_per_s for d in s.disks),
        "disk_util": most(d.util_percent for d in s.disks),
    }


def assert_same_figures(s: Snapshot) -> None:
    data = snapshot_to_dict(s)
    want = typed_figures(s)
    for fig in (*PEAKS, *SERIES):
        assert exact(fig.read(data)) == exact(want[fig.key]), fig.key
    # the report names processes as the exporter's labels with pids did (its slots predate the
    # exporter's pid-less default, and a diff of two reports must keep reading them)
    series = process_series(Published(s, pid_labels=True))
    typed = [(slot_name(labels, s.target.pid), p.pid) for labels, p in series]
    assert [(name, p["pid"]) for name, p in slot_names(data)] == typed


def test_figures_from_the_json_form_are_those_of_the_typed_snapshot() -> None:
    s = full_snapshot()
    variants = [
        s,
        make_snapshot(gpus=0, loaders=False, alerts=False),
        make_snapshot(workers=6, zombie=True),
        dataclasses.replace(s, shm=None, cgroup=None, pinned=None, gpus=(), disks=()),
        # a zombie listed first, and a worker whose loader does not list it: slots as Prometheus names them
        dataclasses.replace(s, processes=tuple(reversed(s.processes))),
        dataclasses.replace(s, loaders=()),
        # no NVML figure per process (a container's pids): torch's reserved memory on the job's GPUs,
        # never a MIG card's, nor a GPU where the job holds nothing
        dataclasses.replace(
            s,
            processes=tuple(dataclasses.replace(p, gpu_memory_bytes=None) for p in s.processes),
            gpus=(
                dataclasses.replace(s.gpus[0], torch_reserved_bytes=3 << 30, processes=()),
                dataclasses.replace(s.gpus[1], mig_mode=True, mig_index=None, torch_reserved_bytes=5 << 30),
                dataclasses.replace(s.gpus[1], index=2, torch_reserved_bytes=0, torch_allocated_bytes=0),
            ),
        ),
        dataclasses.replace(s, loaders=tuple(dataclasses.replace(lo, batches_total=0) for lo in s.loaders)),
        dataclasses.replace(
            s, loaders=tuple(dataclasses.replace(lo, samples_per_s=None) for lo in s.loaders)
        ),
    ]
    for variant in variants:
        assert_same_figures(variant)


def test_thinned_buckets_as_the_list_based_version_did() -> None:
    """Thinned keeps running figures for its bucket now: same points, -0.0 and ties included."""

    def reference(capacity: int, keep_max: bool, values: list[float]) -> tuple[tuple[float, float], ...]:
        points: list[tuple[float, float]] = []
        bucket: list[tuple[float, float]] = []
        stride = 1

        def merge(group: list[tuple[float, float]]) -> tuple[float, float]:
            vs = [v for _, v in group]
            return group[0][0], max(vs) if keep_max else sum(vs) / len(vs)

        for i, v in enumerate(values):
            bucket.append((i * 0.5, v))
            if len(bucket) >= stride:
                points.append(merge(bucket))
                bucket = []
                if len(points) >= capacity:
                    points = [merge(points[j : j + 2]) for j in range(0, len(points), 2)]
                    stride *= 2
        return tuple(points + ([merge(bucket)] if bucket else []))

    values = [float((i * 7919) % 1000) * 1.37 for i in range(5000)] + [-0.0, 0.0, -0.0, 3.0, 3.0]
    for capacity in (2, 3, 16, 512):
        for keep_max in (False, True):
            for n in (0, 1, 7, 513, 1025, len(values)):
                thinned = Thinned(capacity, keep_max)
                for i, v in enumerate(values[:n]):
                    thinned.add(i * 0.5, v)
                assert repr(thinned.result()) == repr(reference(capacity, keep_max, values[:n]))


# --- real recordings ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A healthy DataLoader job and one whose worker is SIGKILLed (a death, alerts, a verdict),
    recorded by `dlmon run --headless --record` side by side, and a gzip'd copy."""
    tmp = tmp_path_factory.mktemp("fast-path")
    paths = {"healthy": tmp / "healthy.jsonl", "death": tmp / "death.jsonl"}
    job = [LOADER_JOB, "--store", "tensor", "--items", "20000", "--workers", "2", "--rate", "40"]
    runs = [
        subprocess.Popen(
            dlmon_cmd("run", "--headless", "--interval", "0.2", "--record", str(paths[name]), *argv),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, argv in (("healthy", [*job, "--seconds", "8"]), ("death", [DEATH_JOB, "16"]))
    ]
    for run in runs:
        assert run.wait(timeout=240) == 0
    paths["death_gz"] = tmp / "death.jsonl.gz"
    paths["death_gz"].write_bytes(gzip.compress(paths["death"].read_bytes()))
    return paths


def full_summary(path: Path) -> Any:
    """The summary from the full reader: a typed Snapshot per line."""
    summarizer = Summarizer(str(path))
    for record in iter_records(str(path)):
        summarizer.feed(record)
    return summarizer.result()


def assert_same_report(path: Path) -> None:
    fast, full = summarize(str(path)), full_summary(path)
    assert fast == full
    assert format_text(fast) == format_text(full)
    assert format_markdown(fast) == format_markdown(full)
    assert format_html(fast) == format_html(full)


def damaged(lines: list[bytes]) -> list[bytes]:
    """Each kind of line the reader skips or must see through, among the real ones."""
    good = [json.loads(x) for x in lines if x.strip() and json.loads(x).get("type") == "snapshot"]
    mid = good[len(good) // 2]

    def tweak(path: tuple[Any, ...], value: Any) -> bytes:
        return json.dumps(replaced(mid, path, value), allow_nan=True).encode()

    early = dict(mid, time=good[0]["time"] - 50.0)
    older = {k: v for k, v in mid.items() if k not in ("exceptions", "analysis_error")}  # an older dlmon
    widened = replaced(mid, ("time",), math.floor(mid["time"]))  # an int time: the full reader widens it
    bad = [
        lines[3][: len(lines[3]) // 2],  # torn
        b"",
        b"   ",
        b"[1, 2]",
        b'{"type":"mystery"}',
        tweak(("processes", 0, "rss_bytes"), -4096),
        tweak(("processes", 0, "pss_bytes"), int(MAX_BYTES) * 2),
        tweak(("loaders", 0, "data_wait_fraction"), 1.5) if mid["loaders"] else tweak(("host",), 3),
        tweak(("memory", "pss_sum_bytes"), "lots"),
        tweak(("time",), 1e18),
        tweak(("target", "start_unix_time"), -5.0),
        tweak(("disks", 0, "util_percent"), math.nan) if mid["disks"] else tweak(("time",), math.nan),
        tweak(("schema",), 99),
        line_of(early),  # out of time order, alone
        line_of(older),
        line_of(widened),
    ]
    out = list(lines)
    for i, line in enumerate(bad):
        out.insert(2 + i * max(1, len(lines) // (len(bad) + 1)), line)
    return out


def test_real_recordings_report_the_same_by_both_readers(real: dict[str, Path], tmp_path: Path) -> None:
    for name in ("healthy", "death", "death_gz"):
        assert_same_report(real[name])
        records = list(iter_checked_records(str(real[name])))
        checked = sum(isinstance(r, CheckedSnapshot) for r in records)
        assert checked >= len(records) - 1, (name, checked, len(records))  # all but the end marker
    death = summarize(str(real["death"]))
    assert death.deaths and death.alerts and death.verdict  # the recording has what it must agree on
    for name in ("healthy", "death"):
        copy = tmp_path / f"{name}-damaged.jsonl"
        copy.write_bytes(b"\n".join(damaged(real[name].read_bytes().splitlines())) + b"\n")
        assert_same_report(copy)
        problems = [r for r in iter_checked_records(str(copy)) if isinstance(r, RecordProblem)]
        assert problems == [r for r in iter_records(str(copy)) if isinstance(r, RecordProblem)]
        assert len(problems) >= 11, problems
        gz = tmp_path / f"{name}-damaged.jsonl.gz"
        gz.write_bytes(gzip.compress(copy.read_bytes()))
        assert_same_report(gz)


def test_report_and_diff_commands_on_a_damaged_real_recording(real: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "death-damaged.jsonl"
    copy.write_bytes(b"\n".join(damaged(real["death"].read_bytes().splitlines())) + b"\n")
    report = subprocess.run(dlmon_cmd("report", str(copy)), capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "Worker deaths (1)" in report.stdout
    summary = full_summary(copy)
    for problem in summary.problems[:5]:
        assert f"skipping line {problem.line} of {copy}: {problem.reason}" in report.stderr
    out = subprocess.run(
        dlmon_cmd("diff", str(real["healthy"]), str(copy)), capture_output=True, text=True, timeout=120
    )
    assert "alerts new in B: " in out.stdout and "worker_died" in out.stdout
