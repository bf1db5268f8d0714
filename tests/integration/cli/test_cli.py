"""The command line as a user meets it: real subprocesses, real targets, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import Spawn

SLEEPER = 'print("READY", flush=True)\nimport time; time.sleep(300)'


def dlmon(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlmon", *args], capture_output=True, text=True, timeout=timeout
    )


def unused_pid() -> int:
    pid = 32767
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def read_records(path: Path) -> list[dict[str, object]]:
    text = path.read_text()
    assert text.endswith("\n"), "a half-written last line"
    return [json.loads(line) for line in text.splitlines()]


def assert_one_line_error(result: subprocess.CompletedProcess[str], words: str) -> None:
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("dlmon: error: ") and words in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["attach", "abc"], "not a process id"),
        (["attach", "-5"], "-5"),
        (["attach"], "Missing argument 'PID'"),
        (["frobnicate"], "No such command"),
        (["attach", "0"], "not a process id"),
        (["record", "12x", "-o", "/tmp/x.jsonl"], "not a process id"),
        (["attach", "1", "--interval", "0"], "--interval"),
        (["attach", "1", "--interval", "fast"], "--interval"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_2(args: list[str], words: str) -> None:
    assert_one_line_error(dlmon(*args), words)


def test_no_such_pid() -> None:
    pid = unused_pid()
    assert_one_line_error(dlmon("attach", str(pid), "--once", "--json"), f"no such process: {pid}")
    assert_one_line_error(dlmon("record", str(pid), "-o", "/tmp/never.jsonl"), "no such process")


@pytest.mark.parametrize("path", ["/nonexistent-dir/out.jsonl", "/proc/dlmon-cannot-write", "/tmp"])
def test_unwritable_record_path(spawn: Spawn, path: str) -> None:
    proc = spawn(SLEEPER)
    assert_one_line_error(dlmon("record", str(proc.pid), "-o", path), "cannot write")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_attach_once_json_is_a_full_snapshot_with_rates(spawn: Spawn) -> None:
    proc = spawn(
        """
        import os, time
        if os.fork() == 0:
            time.sleep(300); os._exit(0)
        print("READY", flush=True)
        end = time.time() + 300
        while time.time() < end:
            pass
        """
    )
    cpu_before, wall_before = _cpu_seconds(proc.pid), time.monotonic()
    result = dlmon("attach", str(proc.pid), "--once", "--json")
    # the oracle: the busy loop's own CPU share over the whole call (the kernel's utime + stime)
    oracle = 100 * (_cpu_seconds(proc.pid) - cpu_before) / (time.monotonic() - wall_before)
    assert result.returncode == 0, result.stderr
    snap = json.loads(result.stdout)
    assert snap["schema"] == 1 and snap["type"] == "snapshot"
    assert snap["target"]["pid"] == proc.pid and snap["target"]["alive"] is True
    assert "-c" in snap["target"]["cmdline"]
    main, child = snap["processes"]
    assert main["role"] == "main" and child["role"] == "child"
    # the busy loop, measured over the ~1 s between samples; on a loaded machine it gets less than
    # a core, so it is compared with what the kernel says it got, not with a fixed share
    assert main["cpu_percent"] > 0.5 * oracle > 2, (main["cpu_percent"], oracle)
    assert snap["interval_s"] == pytest.approx(1.0, abs=0.3)
    for proc_row in snap["processes"]:  # --once reads PSS of everything
        assert proc_row["pss_bytes"] > 0 and proc_row["pss_age_s"] < 0.5
    assert snap["memory"]["pss_sum_bytes"] < snap["memory"]["rss_sum_bytes"]
    assert snap["gpu"]["available"] in (True, False)


def test_record_ends_when_the_target_exits(spawn: Spawn, tmp_path: Path) -> None:
    # 3 s: dlmon's own start-up on a loaded machine took most of 1.5 s (CI: 3 snapshots, not 4)
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(3.0)')
    out = tmp_path / "rec.jsonl"
    result = dlmon("record", str(proc.pid), "-o", str(out), "--interval", "0.2")
    assert result.returncode == 0, result.stderr
    records = read_records(out)
    assert records[-1]["type"] == "end" and records[-1]["reason"] == "target_exited"
    snapshots = records[:-1]
    assert len(snapshots) >= 4
    assert all(r["type"] == "snapshot" for r in snapshots)
    assert snapshots[-1]["target"]["alive"] is False  # type: ignore[index]
    assert all(s["target"]["alive"] for s in snapshots[:-1])  # type: ignore[index]


def test_record_duration(spawn: Spawn, tmp_path: Path) -> None:
    proc = spawn(SLEEPER)
    out = tmp_path / "rec.jsonl"
    started = time.monotonic()
    result = dlmon("record", str(proc.pid), "-o", str(out), "--interval", "0.25", "--duration", "1")
    assert result.returncode == 0 and time.monotonic() - started < 10
    records = read_records(out)
    assert records[-1] == {**records[-1], "type": "end", "reason": "duration"}
    assert 4 <= len(records) - 1 <= 6


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_record_stops_cleanly_on_signals(spawn: Spawn, tmp_path: Path, sig: signal.Signals) -> None:
    proc = spawn(SLEEPER)
    out = tmp_path / "rec.jsonl"
    recorder = subprocess.Popen(
        [sys.executable, "-m", "dlmon", "record", str(proc.pid), "-o", str(out), "--interval", "0.1"],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while (not out.exists() or out.stat().st_size == 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    recorder.send_signal(sig)
    _, err = recorder.communicate(timeout=20)
    assert recorder.returncode == 0, err
    assert "Traceback" not in err
    records = read_records(out)
    assert records[-1]["type"] == "end" and records[-1]["reason"] == "interrupted"
    assert len(records) > 3


def test_attach_prints_a_line_per_tick_and_records(spawn: Spawn, tmp_path: Path) -> None:
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(1.2)')
    out = tmp_path / "rec.jsonl"
    result = dlmon("attach", str(proc.pid), "--interval", "0.3", "--record", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) >= 3 and f"pid {proc.pid}" in lines[0] and "PSS" in lines[0]
    assert "EXITED" in lines[-1]
    assert read_records(out)[-1]["reason"] == "target_exited"


def test_help_is_quick_to_import() -> None:
    result = dlmon("--help")
    assert result.returncode == 0 and "attach" in result.stdout and "record" in result.stdout


def test_record_keeps_watching_orphans_after_the_target_dies(spawn: Spawn, tmp_path: Path) -> None:
    proc = spawn(
        """
        import os, time
        if os.fork() == 0:
            time.sleep(2.5)          # outlives its parent, like a DataLoader worker of a killed trainer
            os._exit(0)
        print("READY", flush=True)
        time.sleep(0.6)
        os._exit(0)
        """
    )
    out = tmp_path / "rec.jsonl"
    result = dlmon("record", str(proc.pid), "-o", str(out), "--interval", "0.2")
    assert result.returncode == 0, result.stderr
    records = read_records(out)
    assert records[-1]["reason"] == "target_exited"
    after_death = [r for r in records[:-1] if not r["target"]["alive"]]  # type: ignore[index]
    assert len(after_death) >= 5  # ~2 s of the orphan, not one snapshot
    assert any(r["processes"] for r in after_death)
    assert all(p["ppid"] != proc.pid for p in after_death[0]["processes"])  # type: ignore[index]


@pytest.mark.parametrize(("seconds", "snapshots", "span"), [("2", 3, 2.0), ("2.5", 4, 2.5)])
def test_advise_measures_ticks_of_at_most_a_second_ending_on_the_last(
    spawn: Spawn, seconds: str, snapshots: int, span: float
) -> None:
    proc = spawn(SLEEPER)
    result = dlmon("advise", str(proc.pid), "--seconds", seconds, "--json")
    assert result.returncode == 0, result.stderr
    advice = json.loads(result.stdout)
    assert advice["pid"] == proc.pid and advice["snapshots"] == snapshots
    assert abs(advice["duration_s"] - span) < 0.5, advice["duration_s"]


def test_advise_on_a_target_that_exits_advises_from_what_it_measured_before(spawn: Spawn) -> None:
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(1.5)')
    result = dlmon("advise", str(proc.pid), "--seconds", "10", "--json")
    assert result.returncode == 0, result.stderr
    advice = json.loads(result.stdout)
    said = [line for line in result.stderr.splitlines() if "exited during the measurement" in line]
    assert said == [f"dlmon: process {proc.pid} exited during the measurement: advice from its "
                    f"{advice['snapshots']} sample(s) before that"]  # fmt: skip
    assert 1 <= advice["snapshots"] <= 3
