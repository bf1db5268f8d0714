"""Summary checkpoints beside a record (issue 26): `RUN.jsonl.dlmon-summary`.

The recorder saves the report summary's state with the SHA-256 of the bytes it covers; report
and diff resume from it where the record still starts with those bytes. Whatever happened to the
record or the sidecar, the user sees the same report, byte for byte, as without the sidecar:
on real recordings made here by `dlmon run --record` and `dlmon record`, plain and gzip'd.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dlmon.collect.sampler import Sampler
from dlmon.export.html import format_html
from dlmon.export.text import format_markdown, format_text
from dlmon.flow import sidecar
from dlmon.flow.recording import RecordWriter
from dlmon.flow.records import iter_checked_records
from dlmon.flow.sidecar import CheckpointWriter, resumed_summary, sidecar_path
from dlmon.flow.summary import RESERVOIR_SIZE, Reservoir, Summarizer, Thinned, summarize
from integration.export.test_report_fast_path import DEATH_JOB, damaged, full_summary
from support.export import LOADER_JOB, dlmon_cmd

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A healthy DataLoader job and one whose worker is SIGKILLed, by `dlmon run --record` (the
    second gzip'd), and `dlmon record` of a running job."""
    tmp = tmp_path_factory.mktemp("sidecar")
    paths = {
        "healthy": tmp / "healthy.jsonl",
        "death_gz": tmp / "death.jsonl.gz",
        "recorded": tmp / "rec.jsonl",
    }
    job = [LOADER_JOB, "--store", "tensor", "--items", "20000", "--workers", "2", "--rate", "40"]
    logs = {name: tmp / f"{name}.out" for name in ("healthy", "death_gz")}
    runs = [
        subprocess.Popen(
            dlmon_cmd("run", "--headless", "--interval", "0.2", "--record", str(paths[name]), *argv),
            stdout=logs[name].open("wb"),
            stderr=subprocess.STDOUT,
        )
        for name, argv in (("healthy", [*job, "--seconds", "6"]), ("death_gz", [DEATH_JOB, "16"]))
    ]
    target = subprocess.Popen([sys.executable, *job, "--seconds", "8"], stdout=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        record = dlmon_cmd("record", str(target.pid), "-o", str(paths["recorded"]), "--interval", "0.2")
        assert subprocess.run([*record, "--duration", "4"], capture_output=True, timeout=120).returncode == 0
    finally:
        target.kill()
        target.wait()
    for run, log in zip(runs, logs.values(), strict=True):
        assert run.wait(timeout=240) == 0, log.read_text()[-3000:]
    return paths


@contextlib.contextmanager
def sidecar_aside(path: Path) -> Iterator[None]:
    """``path`` without its sidecar for a while (the report names the record: same path)."""
    side = Path(sidecar_path(str(path)))
    aside = side.with_name(side.name + ".aside")
    moved = side.exists() or side.is_symlink()
    if moved:
        side.rename(aside)
    try:
        yield
    finally:
        if moved:
            aside.rename(side)


def uncompressed(path: Path) -> bytes:
    return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()


def reports(path: Path) -> tuple[str, str, str, str]:
    """Text, Markdown and HTML of the report in this process, and the skipped-line notes."""
    summary = summarize(str(path))
    notes = "\n".join(f"{p.line}: {p.reason}" for p in summary.problems) + f"\n{summary.problems_total}"
    return format_text(summary), format_markdown(summary), format_html(summary), notes


def commands(tmp: Path, path: Path, other: Path) -> list[Any]:
    """What `dlmon report` (text, --md, --html) and `dlmon diff` print and write."""
    html = tmp / "out.html"
    out: list[Any] = []
    for argv in (
        ("report", str(path)),
        ("report", "--md", str(path)),
        ("report", "--no-charts", "--html", str(html), str(path)),
        ("diff", str(other), str(path)),
        ("diff", str(path), str(other)),
    ):
        run = subprocess.run(dlmon_cmd(*argv), capture_output=True, timeout=120)
        out.append((argv[0], run.returncode, run.stdout, run.stderr))
    out.append(html.read_bytes())
    return out


def test_recordings_carry_a_checkpoint_of_the_whole_record(real: dict[str, Path]) -> None:
    for name, path in real.items():
        data = uncompressed(path)
        checkpoint = sidecar.read_checkpoint(str(path))
        assert checkpoint is not None, name
        assert (checkpoint.bytes, checkpoint.lines) == (len(data), data.count(b"\n")), name
        assert b'"type":"end"' in data.splitlines()[-1], name  # the end line is covered too
        assert resumed_summary(str(path)) is not None, name


def test_commands_print_the_same_with_and_without_the_sidecar(real: dict[str, Path], tmp_path: Path) -> None:
    for name, other in (
        ("healthy", real["death_gz"]),
        ("death_gz", real["recorded"]),
        ("recorded", real["healthy"]),
    ):
        path = real[name]
        assert resumed_summary(str(path)) is not None
        with_sidecar = commands(tmp_path, path, other)
        with sidecar_aside(path), sidecar_aside(other):
            assert resumed_summary(str(path)) is None
            without = commands(tmp_path, path, other)
        assert with_sidecar == without, name
        assert (
            with_sidecar[0][1] == 0 and b"Worker deaths" in commands(tmp_path, real["death_gz"], path)[0][2]
        )


def copy_of(path: Path, tmp: Path, name: str) -> Path:
    copy = tmp / name
    shutil.copyfile(path, copy)
    shutil.copyfile(sidecar_path(str(path)), sidecar_path(str(copy)))
    return copy


def assert_same_without(path: Path, resumed: bool) -> tuple[str, str, str, str]:
    """The report of ``path`` is the same with and without its sidecar, which is (or is not) used."""
    assert (resumed_summary(str(path)) is not None) == resumed
    with_sidecar = reports(path)
    with sidecar_aside(path):
        without = reports(path)
    assert with_sidecar == without
    return with_sidecar


def test_lines_appended_after_the_checkpoint_are_read(real: dict[str, Path], tmp_path: Path) -> None:
    copy = copy_of(real["healthy"], tmp_path, "appended.jsonl")
    lines = copy.read_bytes().splitlines()
    snaps = [json.loads(x) for x in lines if b'"type":"snapshot"' in x[:20]]
    later = [dict(s, time=s["time"] + 600.0) for s in snaps[-5:]]
    extra = [json.dumps(s, separators=(",", ":")).encode() for s in later]
    with open(copy, "ab") as fh:  # a recorder killed after its last checkpoint, then more lines
        fh.write(b"\n".join([extra[0], b"", b"   ", extra[1], b"not json", *extra[2:]]) + b"\n")
        fh.write(extra[0][:100])  # torn
    text = assert_same_without(copy, resumed=True)[0]
    assert text != reports(real["healthy"])[0]  # the appended lines count
    summary = summarize(str(copy))
    assert summary.snapshots == full_summary(copy).snapshots == len(snaps) + 5
    assert summary.problems_total == 2


def test_a_record_edited_before_the_checkpoint_is_read_in_full(real: dict[str, Path], tmp_path: Path) -> None:
    copy = copy_of(real["recorded"], tmp_path, "edited.jsonl")
    data = copy.read_bytes()
    at = data.index(b'"host":"') + len(b'"host":"')
    edited = data[:at] + (b"X" if data[at : at + 1] != b"X" else b"Y") + data[at + 1 :]  # same length
    copy.write_bytes(edited)
    text = assert_same_without(copy, resumed=False)[0]
    assert text != reports(real["recorded"])[0]  # the edit shows: a sidecar taken blindly would hide it


def test_a_truncated_record_is_read_in_full(real: dict[str, Path], tmp_path: Path) -> None:
    for name in ("healthy", "death_gz"):
        path = real[name]
        copy = copy_of(path, tmp_path, f"cut-{path.name}")
        data = uncompressed(path)
        cut = data[: len(data) // 2 + 17]  # mid-line
        copy.write_bytes(gzip.compress(cut) if name.endswith("gz") else cut)
        assert_same_without(copy, resumed=False)
        assert summarize(str(copy)).problems_total >= 1
    gz = real["death_gz"]  # a gzip cut short: its stream ends mid-way, before the covered bytes
    copy = copy_of(gz, tmp_path, "cut-raw.jsonl.gz")
    copy.write_bytes(gz.read_bytes()[: gz.stat().st_size // 2])
    assert_same_without(copy, resumed=False)


def test_a_damaged_foreign_or_future_sidecar_is_ignored(real: dict[str, Path], tmp_path: Path) -> None:
    good = json.loads(Path(sidecar_path(str(real["death_gz"]))).read_bytes())
    other = Path(sidecar_path(str(real["healthy"]))).read_bytes()

    def with_field(key: str, value: Any) -> bytes:
        return json.dumps({**good, key: value}).encode()

    def with_state(key: str, value: Any) -> bytes:
        return json.dumps({**good, "summary": {**good["summary"], key: value}}).encode()

    alert = {"kind": "k", "subject": "s", "severity": "warning", "message": "m", "start": 1.0, "end": 2.0}
    alert |= {"open_at_end": False, "cause": None}

    bad = {
        "garbage": os.urandom(4096),
        "empty": b"",
        "half": json.dumps(good).encode()[:5000],
        "a list": b"[1, 2]",
        "foreign": other,  # another record's checkpoint
        "future": with_field("version", 2),
        "other dlmon": with_field("dlmon", "0.0.1"),
        "other figures": with_field("tables", [[], [], []]),
        "covers a string": with_field("covers", {"bytes": "1", "lines": 1, "sha256": "x"}),
        "no summary": with_field("summary", None),
        "a count that is text": with_state("count", "12"),
        "a peak that is text": with_state("peaks", [["job_pss", "1", 1.0, "PSS"]]),
        "a forged last snapshot": with_state("last", {"time": 1.0, "schema": 1}),
        "a reservoir too big": with_state(
            "reservoirs", {k: {**r, "seen": 1} for k, r in good["summary"]["reservoirs"].items()}
        ),
        "a death with a stray key": with_state("deaths", [{"nope": 1}]),
        # a record's reader lets none of these through; the report then raised while formatting
        "a NaN start": with_state("start", float("nan")),
        "an end past the year 5138": with_state("end", 1e300),
        "an alert starting at text": with_state("closed_alerts", [alert | {"start": "noon"}]),
        "a slot peak of no basis": with_state("slots", [["main", 1.0, 1.0, "XYZ"]]),
        "an infinite peak": with_state("peaks", [["job_pss", float("inf"), 1.0, "PSS"]]),
        "a bucket fuller than its stride": with_state(
            "series", {k: {**t, "count": t["stride"]} for k, t in good["summary"]["series"].items()}
        ),
    }
    path = copy_of(real["death_gz"], tmp_path, "d.jsonl.gz")
    side = Path(sidecar_path(str(path)))
    expected = assert_same_without(path, resumed=True)
    for name, data in bad.items():
        side.write_bytes(data)
        assert resumed_summary(str(path)) is None, name
        assert reports(path) == expected, name
    run = subprocess.run(dlmon_cmd("report", str(path)), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "Traceback" not in run.stderr and run.stderr == "", run.stderr


def record_one_snapshot(path: Path) -> None:
    """A recording of this process, one snapshot long, by the recorder (its sidecar included)."""
    writer = RecordWriter(str(path))
    sampler = Sampler(os.getpid())
    try:
        writer.write(sampler.sample())
    finally:
        sampler.close()
        writer.close()


def test_a_symlinked_sidecar_is_never_followed(real: dict[str, Path], tmp_path: Path) -> None:
    path = copy_of(real["healthy"], tmp_path, "s.jsonl")
    side = Path(sidecar_path(str(path)))
    target = tmp_path / "elsewhere.json"
    side.rename(target)
    side.symlink_to(target)  # the right checkpoint, but through a link: not read
    assert_same_without(path, resumed=False)
    # nor written through: a recording over this path leaves the link and its target alone
    before = target.read_bytes()
    record_one_snapshot(path)
    assert side.is_symlink() and target.read_bytes() == before
    assert resumed_summary(str(path)) is None and summarize(str(path)).snapshots == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_sidecar_of_another_owner_is_ignored(real: dict[str, Path], tmp_path: Path) -> None:
    """In /tmp anyone may plant FILE.dlmon-summary beside a record they can read, with the right
    hash and figures of their own: only one owned by the record's owner is read."""
    path = copy_of(real["healthy"], tmp_path, "planted.jsonl")
    os.chown(sidecar_path(str(path)), 65534, 65534)
    assert_same_without(path, resumed=False)
    os.chown(path, 65534, 65534)
    assert_same_without(path, resumed=True)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_checkpoints_while_recording_resume_exactly(tmp_path: Path, suffix: str) -> None:
    """Checkpoints taken mid-recording (a clock that runs 7 s a call) are read while the record
    grows, and after: the same summary as reading every line, a clock that stepped back included."""
    path = tmp_path / f"live{suffix}"
    clock = itertools.count(0.0, 7.0).__next__
    writer = RecordWriter(str(path), clock=clock)
    sampler = Sampler(os.getpid())
    used = 0
    try:
        for i in range(16):
            snapshot = sampler.sample()
            if i in (6, 11):  # a lone early line (skipped), then a clock that steps back (kept)
                snapshot = replace(snapshot, time=snapshot.time - 30.0)
            if i == 12:
                snapshot = replace(snapshot, time=snapshot.time - 29.0)
            writer.write(snapshot)
            checkpoint = sidecar.read_checkpoint(str(path))
            if checkpoint is not None and resumed_summary(str(path)) is not None:
                used += 1
                assert checkpoint.lines <= i + 1
                assert_same_without(path, resumed=True)
            time.sleep(0.02)
        writer.end("duration")
    finally:
        sampler.close()
        writer.close()
    assert used >= 3
    assert assert_same_without(path, resumed=True) == reports(path)
    summary = summarize(str(path))
    assert summary == full_summary(path)
    assert [p.reason[:17] for p in summary.problems] == ["out of time order"]


def test_a_checkpoint_at_any_line_of_a_damaged_real_recording(real: dict[str, Path], tmp_path: Path) -> None:
    """The summary's state saved after any line (problems, deaths, alerts, lines out of time
    order among them) and resumed gives the summary of reading every line."""
    lines = damaged(gzip.decompress(real["death_gz"].read_bytes()).splitlines())
    lines = [x for x in lines if x.strip()]  # a recorder writes no blank lines
    path = tmp_path / "damaged.jsonl"
    path.write_bytes(b"".join(x + b"\n" for x in lines))
    whole = full_summary(path)
    resumed = 0
    for k in range(0, len(lines) + 1, 3):
        Path(sidecar_path(str(path))).unlink(missing_ok=True)
        writer = CheckpointWriter(str(path), time.monotonic)
        for line in lines[:k]:
            writer.add(line + b"\n")
        writer.save()
        assert writer.stopped is None
        resumed += resumed_summary(str(path)) is not None
        assert summarize(str(path)) == whole, k
    assert resumed >= len(lines) // 3 - 2  # only a line held back for time order delays a checkpoint


def test_series_and_reservoirs_resume_past_their_caps() -> None:
    """Past their caps, a series thins (strides) and a reservoir draws from its seeded random: a
    resumed one goes on exactly as the one that was never stopped (a day at 1 Hz passes both)."""
    values = [float((i * 7919) % 1000) for i in range(3 * RESERVOIR_SIZE)]
    for stop in (10, RESERVOIR_SIZE + 5, 2 * RESERVOIR_SIZE + 1):
        whole, first = Reservoir(), Reservoir()
        for v in values:
            whole.add(v)
        for v in values[:stop]:
            first.add(v)
        resumed = Reservoir.from_state(json.loads(json.dumps(first.to_state())))
        for v in values[stop:]:
            resumed.add(v)
        assert (resumed.values, resumed.stats()) == (whole.values, whole.stats()), stop
        for keep_max in (True, False):
            series, part = Thinned(keep_max=keep_max), Thinned(keep_max=keep_max)
            for i, v in enumerate(values):
                series.add(float(i), v)
            for i, v in enumerate(values[:stop]):
                part.add(float(i), v)
            thinned = Thinned.from_state(json.loads(json.dumps(part.to_state())), keep_max)
            for i, v in enumerate(values[stop:], start=stop):
                thinned.add(float(i), v)
            assert thinned.result() == series.result(), (stop, keep_max)


def test_a_name_near_name_max_still_records(tmp_path: Path) -> None:
    """A record name 14 bytes short of NAME_MAX leaves no room for the sidecar's suffix: the
    record is still written (the sidecar's ENAMETOOLONG failed the record's open, after it had
    truncated the file)."""
    path = tmp_path / ("r" * 243 + ".jsonl")
    record_one_snapshot(path)
    assert summarize(str(path)).snapshots == 1
    run = subprocess.run(dlmon_cmd("report", str(path)), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_no_sidecar_beside_a_link_to_the_file_written(tmp_path: Path) -> None:
    """`-o /dev/stdout` with stdout redirected to a file opens a regular file through a link: as
    root its sidecar went into /dev. Here the link is ours: /proc/self/fd/N, then a plain one."""
    real_file = tmp_path / "out.jsonl"
    fd = os.open(real_file, os.O_WRONLY | os.O_CREAT, 0o644)
    links = [tmp_path / "stdout", tmp_path / "link.jsonl"]
    links[0].symlink_to(f"/proc/self/fd/{fd}")
    links[1].symlink_to(real_file)
    sampler = Sampler(os.getpid())
    try:
        for link in links:
            writer = RecordWriter(str(link))
            writer.write(sampler.sample())
            writer.close()
            assert not os.path.lexists(sidecar_path(str(link))), link
            assert summarize(str(real_file)).snapshots == 1
    finally:
        sampler.close()
        os.close(fd)


def test_a_fifo_beside_a_stale_sidecar_is_read_in_full(real: dict[str, Path], tmp_path: Path) -> None:
    """A record path that is now a FIFO, beside the sidecar of the file it once was: hashing the
    covered bytes consumed them, so the full read after a mismatch found the pipe empty."""
    path = copy_of(real["healthy"], tmp_path, "fifo.jsonl")
    data = path.read_bytes()
    at = data.index(b'"host":"') + len(b'"host":"')
    data = data[:at] + (b"X" if data[at : at + 1] != b"X" else b"Y") + data[at + 1 :]  # no match
    path.unlink()
    os.mkfifo(path)
    feeder = threading.Thread(target=path.write_bytes, args=(data,), daemon=True)  # one writer
    feeder.start()
    summaries: list[Any] = []
    reader = threading.Thread(target=lambda: summaries.append(summarize(str(path))), daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive():  # waiting for a writer that is gone: release it
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
    feeder.join(timeout=10)
    whole = full_summary(copy_of(real["healthy"], tmp_path, "same.jsonl"))
    assert [s.snapshots for s in summaries] == [whole.snapshots], "the report lost the pipe's lines"


def test_the_sidecar_is_as_private_as_the_record(tmp_path: Path) -> None:
    """It holds the command line and the last snapshot: a record kept 0600 (umask 077, or a
    chmod while recording) must not get a world-readable sidecar (it was always 0644)."""
    path = tmp_path / "private.jsonl"
    old = os.umask(0o077)
    try:
        writer = RecordWriter(str(path), clock=itertools.count(0.0, 40.0).__next__)
    finally:
        os.umask(old)
    sampler = Sampler(os.getpid())
    side = Path(sidecar_path(str(path)))
    try:
        writer.write(sampler.sample())
        writer.write(sampler.sample())  # the clock passed 30 s: a checkpoint
        assert oct(side.stat().st_mode & 0o777) == oct(path.stat().st_mode & 0o777) == "0o600"
        path.chmod(0o640)
        writer.write(sampler.sample())
        writer.write(sampler.sample())
    finally:
        sampler.close()
        writer.close()
    assert oct(side.stat().st_mode & 0o777) == "0o640"
    assert resumed_summary(str(path)) is not None


def test_a_resumed_summary_that_raises_gives_way_to_the_full_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A saved state that reads back but trips on a later line (what from_state does not check):
    the report reads every line instead of printing a traceback."""
    path = tmp_path / "r.jsonl"
    record_one_snapshot(path)
    whole = full_summary(path)

    class Tripping(Summarizer):
        def feed(self, record: Any) -> None:
            raise KeyError("a basis no peak has")

    def resumed(record: str) -> Any:
        return Tripping(record), iter_checked_records(record)

    monkeypatch.setattr(sidecar, "resumed_summary", resumed)
    assert summarize(str(path)) == whole
