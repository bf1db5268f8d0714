"""dlmon SIGKILLed mid-record: every line is whole JSON (a torn last line at most, which replay skips
and reports), and the training does not notice."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlmon.flow.sources import read_record

from .support import Job, dlmon_record, env_with_dlmon, record_lines, wait_until

pytestmark = pytest.mark.slow

KILLS = 4


def test_sigkill_mid_record_leaves_whole_lines_and_the_training_unchanged(tmp_path: Path) -> None:
    rng = random.Random(13)
    with Job({"workers": 2, "persistent": True}) as job:
        job.wait_batches(30)
        without = job.measure(3.0)
        rates: list[float] = []
        for k in range(KILLS):
            out = tmp_path / f"kill{k}.jsonl"
            with dlmon_record(job.pid, out, 0.1) as rec:
                wait_until(lambda out=out: out.exists() and out.stat().st_size > 0, 60, "a record line")
                t0 = time.monotonic()
                time.sleep(rng.uniform(0.5, 1.5))  # a random point of a tick, many lines in
                rec.send_signal(signal.SIGKILL)
                rec.wait()
                rates.append(job.measure(1.0))
                del t0
            lines = record_lines(out)
            assert len(lines) >= 3
            for line in lines[:-1]:
                json.loads(line)  # whole JSON, or this raises
            last_whole = lines[-1].endswith(b"\n")
            replay = read_record(str(out))
            assert len(replay.snapshots) >= len(lines) - 1
            if not last_whole:  # a torn last line: skipped and reported, the rest replays
                assert [p.line for p in replay.problems] == [len(lines)]
            else:
                assert not replay.problems
        with_kills = sum(rates) / len(rates)
    print(f"batches/s without dlmon {without:.1f}, while recorded and killed {with_kills:.1f}")
    # the training never waits on dlmon: a killed recorder cannot slow it (generous: loaded CI)
    assert with_kills > 0.5 * without


def test_replay_of_a_torn_last_line_says_so_and_shows_the_rest(tmp_path: Path) -> None:
    """What the user sees when the file ends mid-line (a recorder killed mid-write)."""
    with Job({"workers": 1, "persistent": True}) as job:
        job.wait_batches(5)
        out = tmp_path / "torn.jsonl"
        with dlmon_record(job.pid, out, 0.1) as rec:
            wait_until(lambda: out.exists() and len(record_lines(out)) >= 3, 60, "three record lines")
            rec.send_signal(signal.SIGKILL)
            rec.wait()
    whole = out.read_bytes()
    out.write_bytes(whole + whole.splitlines(keepends=True)[0][:57])  # the torn write
    result = subprocess.run(
        [sys.executable, "-m", "dlmon", "report", str(out)],
        capture_output=True, text=True, timeout=120, env=env_with_dlmon(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert f"line {len(record_lines(out))}" in result.stdout + result.stderr, (result.stdout, result.stderr)
