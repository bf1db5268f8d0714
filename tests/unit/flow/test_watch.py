"""One builder for every watch (dlmon/flow/watch.py): what each command assembles from its
options, in the order it asks, and where the plugs' sinks (the Prometheus exporter) sit: after
the analysis and the record, fed the analysed snapshot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import Spawn
from dlmon.collect.sampler import NoSuchProcess
from dlmon.flow.recording import END_DURATION, END_TARGET_EXITED
from dlmon.flow.sources import HasFaults, Paced, Seekable, read_record, wait_for_end
from dlmon.flow.watch import SnapshotSink, Watch, WatchOptions, open_watch, record_notes
from dlmon.model import Snapshot
from support.paths import ROOT


def test_a_headless_watch_records_then_feeds_the_plugs_and_the_sinks_in_order(
    spawn: Spawn, tmp_path: Path
) -> None:
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(60)')
    out = tmp_path / "rec.jsonl"
    calls: list[str] = []
    plugged: list[Snapshot] = []

    def plug() -> SnapshotSink:
        calls.append("plug started")

        def sink(snapshot: Snapshot) -> None:
            assert out.read_text().count("\n") == len(plugged) + 1  # the record has the line first
            plugged.append(snapshot)
            calls.append("plug")

        return sink

    options = WatchOptions(
        0.2,
        str(out),
        duration=0.7,
        plugs=(plug,),
        sinks=(lambda s: calls.append("sink"),),
    )
    watch = open_watch(proc.pid, options)
    assert calls == ["plug started"]
    assert watch.run() == END_DURATION
    assert calls[1:] == ["plug", "sink"] * len(plugged) and len(plugged) >= 3
    replay = read_record(str(out))
    assert replay.snapshots == plugged and replay.end_reason == END_DURATION


def test_plugs_start_once_and_a_missing_process_starts_none(tmp_path: Path) -> None:
    started: list[int] = []

    def plug() -> SnapshotSink:
        started.append(1)
        return lambda s: None

    options = WatchOptions(record_path=str(tmp_path / "r.jsonl"), plugs=(plug,))
    with pytest.raises(NoSuchProcess):
        open_watch(2**22 + 12345, options)
    assert started == [] and not (tmp_path / "r.jsonl").exists()
    watch = Watch(options)
    watch.start_plugs()
    watch.start_plugs()
    assert started == [1]


def test_a_required_record_that_cannot_open_raises_another_is_a_fault(tmp_path: Path) -> None:
    missing = str(tmp_path / "no" / "r.jsonl")
    watch = Watch(WatchOptions(record_path=missing, record_required=True))
    with pytest.raises(FileNotFoundError):
        watch.open_record()
    said: list[str] = []
    watch = Watch(WatchOptions(record_path=missing, report=said.append))
    assert watch.open_record() is None
    assert watch.faults.record_stopped and said and said[0].startswith("recording stopped: cannot write")


def test_the_live_source_is_the_same_watch(spawn: Spawn, tmp_path: Path) -> None:
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(0.8)')
    out = tmp_path / "rec.jsonl"
    out.write_text('{"type":"end","time":0,"reason":"interrupted"}\n')  # a record, to be replaced
    kept: list[Snapshot] = []
    watch = Watch(WatchOptions(0.2, str(out), sinks=(kept.append,)))
    watch.open_sampler(proc.pid)
    watch.open_record()
    assert record_notes(watch.writer) == [f"replacing the existing record {out} (47 bytes)"]
    source = watch.live_source()
    assert isinstance(source, HasFaults) and isinstance(source, Paced) and not isinstance(source, Seekable)
    assert source.faults is watch.faults
    shown: list[Snapshot] = []
    assert wait_for_end(source, shown.append, timeout=20) == END_TARGET_EXITED
    assert shown == kept and read_record(str(out)).snapshots == shown
    replay = watch.replay_source(str(out), None)
    assert isinstance(replay, Seekable) and not isinstance(replay, HasFaults)
    assert os.path.getsize(out) > 47


def test_only_the_watch_builder_makes_an_analyzer() -> None:
    """Every command's analysis is the watch's (``advise`` and ``export --all-jobs`` built their
    own): outside dlmon/analysis, the name ``Analyzer`` appears in dlmon/flow/watch.py only."""
    import ast

    root = ROOT / "dlmon"
    named: list[str] = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent).as_posix()
        if where.startswith("dlmon/analysis/") or where == "dlmon/flow/watch.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), where)):
            names = [a.asname or a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            used = (isinstance(node, ast.Name) and node.id == "Analyzer") or (
                isinstance(node, ast.Attribute) and node.attr == "Analyzer"  # analysis.Analyzer()
            )
            if used or "Analyzer" in names:
                named.append(f"{where}:{node.lineno}")
    assert named == []
