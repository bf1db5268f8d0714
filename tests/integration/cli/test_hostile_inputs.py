"""The second adversarial round (issue 26): hostile inputs that failed, each a real process.

Rows that fit the command-line table live in test_adversarial_cli.py beside this file; these need
more set-up (an agent under a flood, a stopped training, a long TMPDIR, a FIFO, a record read back).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlmon.collect.agent_client import AgentClient
from support.agent import private_agent_env
from support.paths import ROOT, TESTS

SCRIPTS = TESTS / "agent_scripts"


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    with private_agent_env("dlmon-hostile-") as e:
        e["PYTHONPATH"] = str(ROOT)  # the script starts the agent itself (--start)
        yield e


@pytest.fixture
def agent(env: dict[str, str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A real process serving an agent (tests/agent_scripts/idle.py): (process, socket path)."""
    p = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "idle.py"), "--start"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert p.stdout is not None
    ready = json.loads(p.stdout.readline()[3:])
    assert ready["serving"], ready
    yield p, ready["serving"]
    p.kill()
    p.wait()


def _dlmon(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlmon", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )


def _snapshots(path: Path) -> list[dict[str, object]]:
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x for x in lines if x.get("type", "snapshot") == "snapshot"]


# -- item 1: one nested JSON line silenced the agent ----------------------------------------------


def test_nested_json_gets_bad_request_and_never_delays_the_next_client(
    agent: tuple[subprocess.Popen[str], str],
) -> None:
    _, path = agent
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(path)
    s.sendall(b"[" * 4000 + b"\n")
    assert s.recv(4096).startswith(b'{"error": "bad request'), "a nested line got no answer"
    s.close()

    stop = threading.Event()

    def flood() -> None:  # ~20 nested lines a second, each on its own connection, left open
        held: list[socket.socket] = []
        while not stop.is_set():
            c = socket.socket(socket.AF_UNIX)
            try:
                c.connect(path)
                c.sendall(b"[" * 4000 + b"\n")
                held.append(c)
            except OSError:
                c.close()
            stop.wait(0.05)
        for c in held:
            c.close()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    client = AgentClient()
    answered = 0
    try:
        for _ in range(20):
            answered += client.poll(agent[0].pid) is not None
            time.sleep(0.1)
    finally:
        stop.set()
        flooder.join()
    assert answered == 20, f"only {answered} of 20 polls answered under a flood of nested lines"
    assert client.unanswered_note() is None


def test_an_agent_that_stops_answering_is_said_in_the_record_and_on_stderr(
    agent: tuple[subprocess.Popen[str], str], env: dict[str, str], tmp_path: Path
) -> None:
    proc, _ = agent
    os.kill(proc.pid, signal.SIGSTOP)  # its socket still takes requests; nobody reads them
    try:
        out = tmp_path / "r.jsonl"
        got = _dlmon("record", str(proc.pid), "-o", str(out), "--duration", "4", "--interval", "0.5", env=env)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert got.returncode == 0, got.stderr
    snaps = _snapshots(out)
    assert snaps and all(not s["loaders"] for s in snaps)
    notes = [s.get("agent_note") for s in snaps]
    assert notes[-1] and "not answering" in str(notes[-1]), notes  # after UNANSWERED_NOTE_S
    assert got.stderr.count("not answering") == 1, got.stderr


def test_one_late_reply_during_an_import_is_no_note(env: dict[str, str], tmp_path: Path) -> None:
    """The GIL held by torch's import delays a reply past 200 ms now and then: that is no news."""
    code = (
        "import dlmon.agent, time; dlmon.agent.start(); print('READY', flush=True); time.sleep(0.5)\n"
        "import torch; time.sleep(2)"
    )
    job = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert job.stdout is not None and job.stdout.readline().strip() == "READY"
    out = tmp_path / "r.jsonl"
    try:
        got = _dlmon("record", str(job.pid), "-o", str(out), "--interval", "0.2", env=env)
    finally:
        job.kill()
        job.wait()
    assert "not answering" not in got.stderr, got.stderr
    assert not any(s.get("agent_note") for s in _snapshots(out))


# -- item 2: a long TMPDIR left the agent unable to bind --------------------------------------------

LOADER_SCRIPT = """
import time, torch
from torch.utils.data import DataLoader
for _ in range(400):
    for batch in DataLoader(list(range(64)), batch_size=8):
        time.sleep(0.01)
    if time.monotonic() > START + 4:
        break
"""


def test_a_long_tmpdir_still_gets_loaders_from_a_short_private_directory(tmp_path: Path) -> None:
    long_tmp = tmp_path / ("t" * (120 - len(str(tmp_path)) - 1))
    long_tmp.mkdir()
    assert len(str(long_tmp)) == 120
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env.update(TMPDIR=str(long_tmp), PYTHONPATH=str(ROOT))
    out = tmp_path / "r.jsonl"
    script = "import time; START = time.monotonic()\n" + LOADER_SCRIPT
    got = _dlmon(
        "run", "--headless", "--interval", "0.5", "--record", str(out), "--",
        sys.executable, "-c", script, env=env, timeout=120,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    snaps = _snapshots(out)
    with_loaders = [s for s in snaps if s["loaders"]]
    notes = [s.get("agent_note") for s in snaps]
    assert with_loaders, f"no snapshot of {len(snaps)} has loaders; notes: {notes}"


# -- item 11: /metrics answered every method, and HEAD with a body ---------------------------------


def test_metrics_answers_get_and_head_only(tmp_path: Path) -> None:
    import http.client

    from support.export import dlmon_serving, kill_group

    job = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        with dlmon_serving(["export", str(job.pid), "--prometheus", "127.0.0.1:0"], tmp_path / "err") as (
            _,
            port,
        ):

            def ask(method: str) -> tuple[int, bytes, str | None]:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.request(method, "/metrics")
                r = conn.getresponse()
                body = r.read()
                conn.close()
                return r.status, body, r.getheader("Content-Length")

            status, body, _ = ask("GET")
            assert status == 200 and b"dlmon_" in body
            status, _, length = ask("HEAD")
            assert status == 200 and length is not None and int(length) > 0
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # what is on the wire
                raw.sendall(b"HEAD /metrics HTTP/1.0\r\n\r\n")
                wire = b""
                while chunk := raw.recv(65536):
                    wire += chunk
            assert wire.split(b"\r\n\r\n", 1)[1] == b"", "HEAD sent a body"
            for method in ("POST", "DELETE", "PUT", "TRACE", "OPTIONS"):
                assert ask(method)[0] == 405, method
    finally:
        kill_group(job)


# -- item 11: report on a short recording counted from the job's start without a word ----------------

EPOCHS_SCRIPT = """
import sys, time, torch
from torch.utils.data import DataLoader
print("READY", flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    for batch in DataLoader(list(range(32)), batch_size=8, num_workers=1):
        time.sleep(0.05)
"""


def test_report_on_a_late_recording_says_it_counts_from_the_jobs_start(tmp_path: Path) -> None:
    with private_agent_env("dlmon-hostile-late-") as env:
        job = subprocess.Popen(
            [sys.executable, "-c", EPOCHS_SCRIPT], stdout=subprocess.PIPE, text=True, env=env
        )
        try:
            assert job.stdout is not None and job.stdout.readline().strip() == "READY"
            started = time.monotonic()
            time.sleep(max(0.0, 12 - (time.monotonic() - started)))  # past LATE_START_S
            out = tmp_path / "late.jsonl"
            got = _dlmon(
                "record", str(job.pid), "-o", str(out), "--duration", "2", "--interval", "0.5", env=env
            )
            assert got.returncode == 0, got.stderr
        finally:
            job.kill()
            job.wait()
        report = _dlmon("report", str(out), env=env)
    assert report.returncode == 0, report.stderr
    epochs = next(x for x in report.stdout.splitlines() if "epochs finished" in x)
    assert "counted from the job's start at" in epochs and "before this recording began" in epochs, epochs


# -- item 7: record -o FIFO with no reader blocked in open() ------------------------------------------


RECORD_3S = ("--duration", "3", "--interval", "0.5")


def test_a_fifo_reader_that_comes_late_gets_whole_lines_and_the_end(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sleeper = subprocess.Popen(["sleep", "60"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        rec = subprocess.Popen(
            [sys.executable, "-m", "dlmon", "record", str(sleeper.pid), "-o", str(fifo), *RECORD_3S],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        time.sleep(1.2)
        with open(fifo, "rb") as reader:  # the reader comes while the recording runs
            data = reader.read()
        assert rec.wait(timeout=30) == 0
    finally:
        sleeper.kill()
        sleeper.wait()
    lines = [json.loads(x) for x in data.splitlines()]
    assert lines and lines[-1]["type"] == "end" and lines[-1]["reason"] == "duration"
    assert any(x["type"] == "snapshot" for x in lines)


# -- item 9: tune --resume ran the command stored in the file without showing it ---------------------


def _sweep_file(tmp_path: Path, command: list[str]) -> Path:
    from dlmon.tune.report import FORMAT

    saved = tmp_path / "sweep.json"
    plan = {"workers": [0], "batch_sizes": [8], "pin_memory": [None], "prefetch_factors": [None]}
    saved.write_text(json.dumps({"format": FORMAT, "command": command, "plan": plan, "results": []}))
    return saved


def _tune(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return _dlmon("tune", "--no-plot", *args, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=timeout)


def test_resume_shows_the_stored_command_and_runs_it_only_with_yes(tmp_path: Path) -> None:
    mark = tmp_path / "ran"
    saved = _sweep_file(tmp_path, ["sh", "-c", f"touch {mark}"])
    got = _tune("--resume", str(saved))
    assert got.returncode == 2, got.stderr
    assert f"touch {mark}" in got.stderr and "--yes" in got.stderr and got.stderr.count("\n") == 1
    assert not mark.exists(), "the command stored in the sweep file ran without being shown"
    other = _tune("--resume", str(saved), "--", "sh", "-c", "true")
    assert other.returncode == 2 and "you gave: sh -c true" in other.stderr, other.stderr
    ran = _tune("--resume", str(saved), "--yes", "--warmup-timeout", "2")
    assert f"resuming {saved}: sh -c 'touch {mark}'" in ran.stderr, ran.stderr
    assert mark.exists()


TUNE_ONE = (sys.executable, "-m", "dlmon", "tune", "--no-plot", "--workers", "0", "--batch-sizes", "8")


def test_tune_interrupted_before_any_result_gives_no_resume_advice(tmp_path: Path) -> None:
    out = tmp_path / "never.json"
    proc = subprocess.Popen(
        [*TUNE_ONE, "--json", str(out), "--", sys.executable, "-c", "import time; time.sleep(60)"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert proc.stderr is not None
    assert "worker counts" in proc.stderr.readline()  # the sweep has begun
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert not out.exists()
    assert "--resume" not in err, err
    assert "nothing to resume" in err


# -- item 4: tune left one daemon per configuration, silently ---------------------------------------


def test_tune_names_a_daemon_each_configuration_left(tmp_path: Path) -> None:
    from integration.cli.test_adversarial_cli import DAEMON

    got = _tune("--workers", "0", "--batch-sizes", "8", "--", sys.executable, "-c", DAEMON)
    named = [x for x in got.stderr.splitlines() if "left running after the training ended" in x]
    pids = [int(p) for line in named for p in line.split("stop them with: kill ", 1)[1].split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert named and "sleep 600" in named[0], got.stderr


# -- item 3: tune stopped a batch that fits as "would OOM" ------------------------------------------


@pytest.mark.slow
def test_tune_does_not_stop_a_one_time_allocation_that_fits(tmp_path: Path) -> None:
    cgroup_v1 = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0 or not (cgroup_v1 / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    group = cgroup_v1 / f"dlmon-hostile-{os.getpid()}"
    group.mkdir()
    out = tmp_path / "sweep.json"
    try:
        (group / "memory.limit_in_bytes").write_text(str(700 * 2**20))
        shell = f'echo $$ > {group}/cgroup.procs && exec "$@"'
        script = str(TESTS / "tune_scripts" / "alloc_once.py")
        args = ("--workers", "0", "--batch-sizes", "64", "--seconds-per-config", "3", "--json", str(out))
        job = ("--", sys.executable, script)
        got = subprocess.run(
            ["sh", "-c", shell, "sh", sys.executable, "-m", "dlmon", "tune", "--no-plot", *args, *job],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
        )
        oom_control = (group / "memory.oom_control").read_text()
    finally:
        for _ in range(100):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert got.returncode == 0, got.stderr
    result = json.loads(out.read_text())["results"][0]
    assert result["outcome"] == "ok", (result["outcome"], result["detail"], got.stdout)
    assert "oom_kill 0" in oom_control


# -- item 8: blank lines were read one readline at a time --------------------------------------------


def test_blank_lines_are_skipped_in_bulk_and_lines_keep_their_numbers(tmp_path: Path) -> None:
    import gzip

    from dlmon.flow.records import iter_records
    from dlmon.flow.sources import _read_from

    path = tmp_path / "blank.jsonl.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(b"\n" * 3_000_000 + b"  \r\n\t\n" + b"not json\n" + b"\n" * 70_000 + b"[1]\n")
    got = [(type(r).__name__, getattr(r, "line", None)) for r in iter_records(str(path))]
    assert got == [("RecordProblem", 3_000_003), ("RecordProblem", 3_070_004)]
    replayed = [x.line for x in _read_from(str(path), 0, 1)]  # the replay's reader: the same numbers
    assert replayed == [3_000_003, 3_070_004]


def test_record_to_dev_stdout_redirected_to_a_file_is_not_refused(tmp_path: Path) -> None:
    """Review: ``-o /dev/stdout > file`` (a symlink to our own stdout, a regular file) was refused
    as "a symlink: not followed", although the user's own shell opened that file for us."""
    sleeper = subprocess.Popen(["sleep", "30"])
    out = tmp_path / "out.jsonl"
    args = ["record", str(sleeper.pid), "-o", "/dev/stdout", "--duration", "1"]
    try:
        with out.open("wb") as fh:
            done = subprocess.run(
                [sys.executable, "-m", "dlmon", *args],
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                cwd=ROOT,
                timeout=60,
            )
    finally:
        sleeper.kill()
        sleeper.wait()
    assert done.returncode == 0, done.stderr
    assert _snapshots(out), out.read_text()[:300]


def test_a_clock_that_stepped_back_loses_no_snapshot_but_a_lone_early_line_is_skipped(tmp_path: Path) -> None:
    """Review: the time-order check dropped every snapshot after an NTP step back until the clock
    passed its old maximum (200 lines, 150 s back after line 100: the last 100 lost)."""
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        got = _dlmon(
            "record",
            str(sleeper.pid),
            "-o",
            str(tmp_path / "one.jsonl"),
            "--duration",
            "1.5",
            "--interval",
            "0.5",
            env=dict(os.environ),
        )
        assert got.returncode == 0, got.stderr
    finally:
        sleeper.kill()
        sleeper.wait()
    first = _snapshots(tmp_path / "one.jsonl")[0]
    t0 = float(first["time"])  # type: ignore[arg-type]
    times = [t0 + i for i in range(100)] + [t0 + 99 - 150 + i for i in range(100)]
    stepped = tmp_path / "stepped.jsonl"
    stepped.write_text("".join(json.dumps({**first, "time": t}) + "\n" for t in times))
    report = _dlmon("report", str(stepped), env=dict(os.environ))
    assert report.returncode == 0, report.stderr
    assert "skipping line" not in report.stderr and "(200 snapshots)" in report.stdout, report.stdout
    assert "-" not in report.stdout.split("duration", 1)[1].split("\n", 1)[0]
    lone = tmp_path / "lone.jsonl"  # one line two hours early among lines in order: skipped
    lone.write_text("".join(json.dumps({**first, "time": t}) + "\n" for t in (t0, t0 + 1, t0 - 7200, t0 + 2)))
    report = _dlmon("report", str(lone), env=dict(os.environ))
    assert "skipping line 3" in report.stderr and "(3 snapshots)" in report.stdout, report.stdout
