"""Live and replay sources deliver the same snapshots through the same protocol."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from pathlib import Path

import pytest

from conftest import Spawn
from dlmon.flow.recording import END_INTERRUPTED, END_TARGET_EXITED
from dlmon.flow.sources import REPLAY_FINISHED, LiveSource, ReplaySource, read_record, wait_for_end
from dlmon.model import Snapshot


def test_live_source_samples_on_its_thread_records_and_ends_with_the_target(
    spawn: Spawn, tmp_path: Path
) -> None:
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(1.0)')
    out = tmp_path / "rec.jsonl"
    source = LiveSource(proc.pid, interval=0.2, record_path=str(out))
    seen: list[Snapshot] = []
    threads: set[str] = set()

    def on_snapshot(s: Snapshot) -> None:
        seen.append(s)
        threads.add(threading.current_thread().name)

    assert wait_for_end(source, on_snapshot, timeout=20) == END_TARGET_EXITED
    assert threads == {"dlmon-sampler"}
    assert seen[-1].target.alive is False and all(s.target.alive for s in seen[:-1])
    replay = read_record(str(out))
    assert replay.snapshots == seen and replay.end_reason == END_TARGET_EXITED
    assert replay.problems == []


def test_live_source_keeps_sampling_while_the_consumer_is_slow(spawn: Spawn) -> None:
    """A consumer that blocks (a paused view) does not make the sampler skip or lose ticks."""
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(300)')
    source = LiveSource(proc.pid, interval=0.1)
    times: list[float] = []
    ended: list[str] = []
    source.start(lambda s: times.append(s.time), ended.append)
    time.sleep(1.0)
    source.stop()
    assert ended == [END_INTERRUPTED]
    assert len(times) >= 8


def test_replay_skips_corrupt_lines_and_replays_the_rest(spawn: Spawn, tmp_path: Path) -> None:
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(0.6)')
    out = tmp_path / "rec.jsonl"
    wait_for_end(LiveSource(proc.pid, interval=0.2, record_path=str(out)), lambda s: None, timeout=20)
    lines = out.read_text().splitlines()
    damaged = [lines[0], "{not json", '{"type": "mystery"}', '{"schema": 99, "type": "snapshot"}', *lines[1:]]
    (tmp_path / "bad.jsonl").write_text("\n".join(damaged)[:-7])  # and a half-written end line
    source = ReplaySource(str(tmp_path / "bad.jsonl"), speed=None)
    got: list[Snapshot] = []
    assert wait_for_end(source, got.append, timeout=10) == REPLAY_FINISHED
    assert len(got) == len(lines) - 1
    assert [p.line for p in source.record.problems] == [2, 3, 4, len(damaged)]
    assert "replay of" in source.description


def test_record_reader_streams_gzip_and_survives_deep_nesting_and_endless_lines(tmp_path: Path) -> None:
    """A line of 100,000 brackets, or one with no end, costs one skipped line, not the recording."""
    import gzip

    from dlmon.flow import records

    good = tmp_path / "good.jsonl"
    good.write_bytes(b"[" * 100_000 + b"\n" + b'{"type": "end", "time": 5, "reason": "duration"}\n')
    items = list(records.iter_records(str(good)))
    assert isinstance(items[0], records.RecordProblem) and items[0].line == 1
    assert items[1] == records.RecordEnd(2, 5.0, "duration")

    zipped = tmp_path / "run.jsonl.gz"
    with gzip.open(zipped, "wb") as fh:
        fh.write(b'{"type": "end", "reason": "target_exited"}\n')
    assert read_record(str(zipped)).end_reason == "target_exited"


def test_record_reader_caps_a_line_that_never_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dlmon.flow import records

    monkeypatch.setattr(records, "MAX_LINE_BYTES", 1024)
    path = tmp_path / "endless.jsonl"
    path.write_bytes(b"x" * 100_000 + b"\n" + b'{"type": "end", "reason": "r"}\n' + b"y" * 5000)
    items = list(records.iter_records(str(path)))
    assert [type(i).__name__ for i in items] == ["RecordProblem", "RecordEnd", "RecordProblem"]
    assert "longer than" in str(items[0])


def test_record_reader_stops_on_a_line_without_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dlmon replay /dev/zero`: bounded memory is not enough, the reader must also stop."""
    from dlmon.flow import records

    monkeypatch.setattr(records, "MAX_LINE_BYTES", 1 << 20)
    items = list(records.iter_records("/dev/zero"))
    assert len(items) == 1 and isinstance(items[0], records.RecordProblem)
    assert "never ends" in items[0].reason


def test_an_over_long_last_line_cut_off_by_a_crash_ended_with_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash mid-write tears the last line: it is cut off at the end of the file, which is not
    a line that never ends (/dev/zero, 16 times the cap without a newline)."""
    from dlmon.flow import records

    monkeypatch.setattr(records, "MAX_LINE_BYTES", 1024)
    path = tmp_path / "torn.jsonl"
    path.write_bytes(b'{"type": "end", "reason": "r"}\n' + b"y" * 5000)
    items = list(records.iter_records(str(path)))
    assert [type(i).__name__ for i in items] == ["RecordEnd", "RecordProblem"]
    assert isinstance(items[1], records.RecordProblem)
    assert items[1].line == 2 and items[1].reason == "longer than 0 MiB and cut off at the end of the file"
    path.write_bytes(b"y" * 5000 + b"\n" + b"z" * 5000)  # one skipped, then the torn one
    reasons = [i.reason for i in records.iter_records(str(path)) if isinstance(i, records.RecordProblem)]
    assert reasons == ["longer than 0 MiB: skipped", "longer than 0 MiB and cut off at the end of the file"]

    monkeypatch.setattr(records, "MAX_LINE_BYTES", 1 << 20)
    (endless,) = records.iter_records("/dev/zero")
    assert isinstance(endless, records.RecordProblem)
    assert endless.reason == "longer than 1 MiB and never ends: stopped"


def test_one_line_reader_gives_offsets_to_seek_back_to_and_reads_a_pipe_without_them(tmp_path: Path) -> None:
    """The replay and the report read lines through flow.records.read_lines_from: a line's offset
    reads the same records again from there, and without offsets (the report) a FIFO reads too."""
    import os

    from dlmon.flow import records

    path = tmp_path / "lines.jsonl"
    lines = [b"not json\n", b"\n", b"\n", b"[1]\n", b'{"type": "end", "time": 5, "reason": "r"}\n']
    path.write_bytes(b"".join(lines))
    got = list(records.read_lines_from(str(path)))
    assert [(at, line) for at, line, _ in got] == [(0, 1), (11, 4), (15, 5)]
    assert list(records.read_lines_from(str(path), 11, 4)) == got[1:]
    assert [r for _, _, r in got] == list(records.iter_records(str(path)))

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb") as fh:
            fh.write(b"".join(lines))

    read: list[object] = []
    reader = threading.Thread(target=lambda: read.extend(records.iter_records(str(fifo))), daemon=True)
    writer = threading.Thread(target=write, daemon=True)
    reader.start()
    writer.start()
    reader.join(30)  # bounded: a writer that never opens the pipe fails the test, not hangs it
    if reader.is_alive():  # opening the other end (O_RDWR never blocks on a FIFO) lets it go
        os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        reader.join(5)
    writer.join(5)
    assert not writer.is_alive()
    assert read == [r for _, _, r in got]


def test_the_line_reader_without_offsets_gives_none_for_each(tmp_path: Path) -> None:
    from dlmon.flow import records

    path = tmp_path / "lines.jsonl"
    path.write_bytes(b"[1]\n\n" + b'{"type": "end", "reason": "r"}\n')
    assert [(at, n) for at, n, _ in records.read_lines_from(str(path), offsets=False)] == [
        (None, 1),
        (None, 3),
    ]
    assert [(at, n) for at, n, _ in records.read_lines_from(str(path), 5, first_line=3)] == [(5, 3)]


class _CountingReplay(ReplaySource):
    """Counts how often the play thread looks for a request: a thread that waits looks twice a second."""

    looks = 0

    def _take_request(self) -> tuple[str, float] | None:
        self.looks += 1
        return super()._take_request()


def test_replay_at_its_end_waits_instead_of_spinning_after_a_next_alert_with_none_left(
    spawn: Spawn, tmp_path: Path
) -> None:
    """``]`` at the end of a recording without alerts used to leave the wake event set: the
    thread then looped on it at full CPU for as long as the dashboard stayed open."""
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(0.5)')
    out = tmp_path / "rec.jsonl"
    wait_for_end(LiveSource(proc.pid, interval=0.2, record_path=str(out)), lambda s: None, timeout=20)
    source = _CountingReplay(str(out), speed=None)
    ended = threading.Event()
    source.start(lambda s: None, lambda reason: ended.set())
    try:
        assert ended.wait(20)
        source.next_alert()  # nothing left to jump to: ignored
        time.sleep(0.3)
        before = source.looks
        time.sleep(1.0)
        assert source.looks - before < 50, "the replay thread spins at the end"
    finally:
        source.stop()


def test_replay_jumps_at_once_when_asked_while_it_delivers_a_frame(spawn: Spawn, tmp_path: Path) -> None:
    """A seek that lands while the thread is busy with a frame (the analyzer, the consumer) set
    the wake event just before the thread cleared it: at a slow pace the jump then waited a whole
    recorded gap (here: for ever)."""
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(0.8)')
    out = tmp_path / "rec.jsonl"
    wait_for_end(LiveSource(proc.pid, interval=0.2, record_path=str(out)), lambda s: None, timeout=20)
    source: ReplaySource

    def analyzer(snapshot: Snapshot) -> Snapshot:
        if source.position is not None and source.snapshots_read <= 2:
            source.seek(snapshot.time)  # asked while this frame is being delivered
        return snapshot

    source = ReplaySource(str(out), speed=1e-9, analyzer=analyzer)  # the next frame: never, unless asked
    seeks: list[float] = []
    source.on_seek = seeks.append
    source.start(lambda s: None, lambda reason: None)
    try:
        deadline = time.monotonic() + 20
        while not seeks:
            assert time.monotonic() < deadline, "the seek waited for the recorded gap"
            time.sleep(0.01)
    finally:
        source.stop()


def test_replay_of_a_gzip_damaged_mid_file_plays_up_to_the_damage_and_ends(
    spawn: Spawn, tmp_path: Path
) -> None:
    """Damaged deflate data raises zlib.error, not OSError: it killed the play thread, and the
    dashboard waited for ever on the last frame with no end and no reason."""
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(0.6)')
    out = tmp_path / "rec.jsonl"
    wait_for_end(LiveSource(proc.pid, interval=0.2, record_path=str(out)), lambda s: None, timeout=20)
    snapshots = [line for line in out.read_bytes().splitlines(keepends=True) if b'"type": "end"' not in line]
    body = b"".join(snapshots * 50)  # well past the reader's first buffer
    deflate = zlib.compressobj(6, zlib.DEFLATED, -15)
    damaged = tmp_path / "bad.jsonl.gz"
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    # then a block of the reserved type 3: "invalid block type"
    damaged.write_bytes(
        header + deflate.compress(body) + deflate.flush(zlib.Z_FULL_FLUSH) + b"\x07" + bytes(64)
    )
    with pytest.raises(zlib.error), gzip.open(damaged) as fh:
        fh.read()
    source = ReplaySource(str(damaged), speed=None)
    got: list[Snapshot] = []
    assert wait_for_end(source, got.append, timeout=20) == REPLAY_FINISHED
    assert got and any("unreadable" in p.reason for p in source.problems), source.problems


def test_record_reader_ends_a_gzip_damaged_mid_file_with_a_problem(tmp_path: Path) -> None:
    """Damaged deflate data raises zlib.error (not OSError): `dlmon replay damaged.gz` tracebacked."""
    import gzip

    from dlmon.flow import records

    path = tmp_path / "damaged.jsonl.gz"
    with gzip.open(path, "wb") as fh:
        for i in range(2000):
            fh.write(b'{"type": "end", "reason": "r%d"}\n' % i)
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    items = list(records.iter_records(str(path)))
    assert isinstance(items[-1], records.RecordProblem) and "unreadable" in items[-1].reason
    assert any(isinstance(i, records.RecordEnd) for i in items)
