"""A training started without dlmon, loaded mid-epoch with ``--inject`` (or ``i`` on the dashboard):
the iterator that already runs (persistent workers, forked before the agent) is measured from its
next batch, its workers carry their worker ids, and a worker killed after the load is recorded
before torch raises."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import Spawn
from support.paths import ROOT
from support.terminal import Tmux

pytestmark = [
    pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed"),
    pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14+ injects with sys.remote_exec"),
]

# One long epoch of one persistent iterator (2 fork workers), built and started before any agent.
# It logs "unix_time batches" after every batch to LOG, for its own count of batches/s.
TRAINER = """
import os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):
    def __len__(self):
        return 1_000_000
    def __getitem__(self, i):
        return torch.tensor([float(i)])

LOG, STOP = sys.argv[1], sys.argv[2]
loader = DataLoader(Squares(), batch_size=4, num_workers=2, persistent_workers=True)
it = iter(loader)
print("READY", flush=True)
print("WORKERS", *[w.pid for w in it._workers], flush=True)
batches = 0
with open(LOG, "w", buffering=1) as log:
    for batch in it:
        batches += 1
        time.sleep(0.02)
        log.write(f"{time.time()} {batches}\\n")
        if os.path.exists(STOP):
            break
print("DONE", batches, flush=True)
"""


def clean_environment() -> tuple[str, dict[str, str]]:
    """A directory for the agent's socket and a TMPDIR of its own, and the environment that uses
    them, without dlmon on the path: a target started in it starts without dlmon. The caller
    removes the directory."""
    d = tempfile.mkdtemp(prefix="dlmon-midflight-", dir="/tmp")
    os.chmod(d, 0o755)
    tmp = os.path.join(d, "tmp")
    os.mkdir(tmp, 0o755)
    env = {**os.environ, "XDG_RUNTIME_DIR": d, "TMPDIR": tmp}
    env.pop("PYTHONPATH", None)
    env.pop("DLMON_AGENT_DISABLE", None)
    return d, env


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``clean_environment()`` for this test's own process and the targets it starts."""
    tmp_path_factory.getbasetemp()
    d, env = clean_environment()
    monkeypatch.setenv("XDG_RUNTIME_DIR", env["XDG_RUNTIME_DIR"])
    monkeypatch.setenv("TMPDIR", env["TMPDIR"])
    monkeypatch.setattr(tempfile, "tempdir", env["TMPDIR"])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv("DLMON_AGENT_DISABLE", raising=False)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def start_trainer(spawn: Spawn, log: Path, stop: Path) -> tuple[int, list[int]]:
    wrapper = (
        f"import sys; sys.argv = ['-c', {str(log)!r}, {str(stop)!r}]; "
        f"exec(compile({TRAINER!r}, '<trainer>', 'exec'))"
    )
    proc = spawn(wrapper)
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    assert words[0] == "WORKERS", words
    return proc.pid, [int(w) for w in words[1:]]


def own_rate(log: Path, start: float, end: float) -> float:
    """The trainer's own batches/s between two Unix times, from its log."""
    rows = [line.split() for line in log.read_text().splitlines() if len(line.split()) == 2]
    points = [(float(t), int(b)) for t, b in rows]
    before = [p for p in points if p[0] <= start]
    after = [p for p in points if p[0] >= end]
    assert before and after, (start, end, points[:1], points[-1:])
    (t0, b0), (t1, b1) = before[-1], after[0]
    return (b1 - b0) / (t1 - t0)


def test_an_iterator_running_before_the_load_is_measured_from_its_next_batch(
    spawn: Spawn, clean_env: str, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    log, stop = tmp_path / "log", tmp_path / "stop"
    pid, workers = start_trainer(spawn, log, stop)
    time.sleep(1.0)  # well into its one epoch
    cmd = [sys.executable, "-m", "dlmon", "attach", str(pid), "--inject", "--once", "--json"]
    before = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    snap = json.loads(result.stdout)
    time.sleep(0.5)  # the trainer's log past the snapshot's time
    stop.touch()

    (loader,) = snap["loaders"]
    assert loader["persistent_workers"] is True and loader["num_workers"] == 2
    assert loader["multiprocessing_context"] == "fork"  # from its workers: the loader is out of reach
    assert loader["worker_pids"] == workers
    assert loader["epochs_started"] == 0  # its epoch began before the agent: not counted as begun
    ours = loader["batches_per_s"]
    theirs = own_rate(log, snap["time"] - snap["interval_s"], snap["time"])
    assert ours is not None and abs(ours - theirs) <= 0.1 * theirs, (ours, theirs)
    assert len(loader["batches_per_worker"]) == 2 and min(loader["batches_per_worker"]) > 0
    ids = {p["pid"]: p["worker_id"] for p in snap["processes"] if p["role"] == "worker"}
    assert ids == {workers[0]: 0, workers[1]: 1}
    assert snap["agent_note"] is None
    assert before < snap["agent_loaded_unix_time"] < snap["time"] - snap["interval_s"]  # counts from then


def test_a_worker_killed_after_the_load_is_journaled_before_torch_raises(
    spawn: Spawn, clean_env: str, tmp_path: Path
) -> None:
    """The load runs in a thread of its own, where no signal handler can be set: the SIGCHLD
    observer goes in front of torch's handler at the training thread's next batch."""
    pytest.importorskip("torch")
    from dlmon.agent._journal import DEATHS_SUFFIX
    from dlmon.collect.agent_client import AgentClient
    from dlmon.launch.inject import inject

    log, stop = tmp_path / "log", tmp_path / "stop"
    pid, workers = start_trainer(spawn, log, stop)
    path = inject(pid)
    client = AgentClient()
    deadline = time.monotonic() + 20
    raw: dict[str, object] = {}
    while time.monotonic() < deadline:
        raw = client.read_raw([pid]).get(pid, {})
        loaders = raw.get("loaders") or []
        if isinstance(loaders, list) and any(lo.get("batches_total") for lo in loaders):
            break
        time.sleep(0.1)
    assert "sigchld" not in (raw.get("degraded") or {}), raw.get("degraded")
    os.kill(workers[1], 9)  # nobody asks the agent again: only the observer can see it
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}/stat"):
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    journal = Path(os.path.dirname(path)) / f"{pid}{DEATHS_SUFFIX}"
    deaths = [json.loads(line) for line in journal.read_text().splitlines()]
    died = [d for d in deaths if d.get("pid") == workers[1]]
    assert died and died[0]["worker_id"] == 1 and died[0]["signal_name"] == "SIGKILL", deaths


# -- how it starts: the dashboard offers the agent (press i), --no-inject never does ----------------


@pytest.fixture
def terminal(clean_env: str) -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    t = Tmux(f"offer{os.getpid()}-{time.monotonic_ns()}")
    env = {**os.environ, "PS1": "$ ", "TERM": "xterm-256color", "PYTHONPATH": str(ROOT)}
    env.pop("NO_COLOR", None)
    subprocess.run(
        [
            "tmux",
            "-L",
            t.socket,
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            "220",
            "-y",
            "50",
            "bash --norc --noprofile",
        ],
        check=True,
        env=env,
        cwd=ROOT,
    )
    yield t
    subprocess.run(["tmux", "-L", t.socket, "kill-server"], capture_output=True)


def flat(screen: str) -> str:
    """The screen's words in order, box drawing and line breaks gone (a panel wraps its lines)."""
    return " ".join("".join(c if c.isascii() else " " for c in screen).split())


def test_attach_offers_the_agent_and_loads_it_when_i_is_pressed(
    spawn: Spawn, terminal: Tmux, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from dlmon.collect.agent_client import AgentClient

    pid, workers = start_trainer(spawn, tmp_path / "log", tmp_path / "stop")
    terminal("send-keys", "-t", "t", f"{sys.executable} -m dlmon attach {pid}", "Enter")
    offer = f"press i to load the agent into pid {pid} (gdb; ~60 ms pause)"
    deadline = time.monotonic() + 30
    while offer not in flat(terminal.screen()) and time.monotonic() < deadline:
        time.sleep(0.2)
    screen = terminal.screen()
    assert offer in flat(screen), screen
    assert str(workers[0]) in screen  # the outside figures are there before any agent
    assert AgentClient.find_socket(pid) is None  # offered, not loaded

    terminal("send-keys", "-t", "t", "i")
    deadline = time.monotonic() + 40
    while "counts from then" not in flat(terminal.screen()) and time.monotonic() < deadline:
        time.sleep(0.2)
    screen = terminal.screen()
    assert "agent loaded at" in flat(screen) and "counts from then" in flat(screen), screen
    assert "batch/s" in screen and offer not in flat(screen)
    assert AgentClient.find_socket(pid) is not None
    terminal("send-keys", "-t", "t", "q")


def test_attach_with_no_inject_never_offers_the_agent(spawn: Spawn, terminal: Tmux, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from dlmon.collect.agent_client import AgentClient

    pid, workers = start_trainer(spawn, tmp_path / "log", tmp_path / "stop")
    terminal("send-keys", "-t", "t", f"{sys.executable} -m dlmon attach {pid} --no-inject", "Enter")
    screen = terminal.wait_for("No DataLoader figures")
    assert str(workers[0]) in terminal.wait_for(str(workers[0]))
    terminal("send-keys", "-t", "t", "i")  # reverses the sort, nothing else
    time.sleep(3.0)
    screen = terminal.screen()
    assert "press i" not in flat(screen) and "No DataLoader figures" in screen, screen
    assert AgentClient.find_socket(pid) is None
    terminal("send-keys", "-t", "t", "q")


# -- record, advise and export take --inject too ------------------------------------------------------


def dlmon(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlmon", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def snapshots(path: Path) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [x for x in lines if x.get("type") == "snapshot"]


def test_record_inject_records_the_loader_and_the_report_counts_from_the_load(
    spawn: Spawn, clean_env: str, tmp_path: Path
) -> None:
    """A recording begun 10 s and more after the load: its report's epochs count from the load,
    not from the job's start (which it said before the agent told when it was loaded)."""
    pytest.importorskip("torch")
    pid, workers = start_trainer(spawn, tmp_path / "log", tmp_path / "stop")
    first = tmp_path / "first.jsonl"
    got = dlmon("record", str(pid), "--inject", "-o", str(first), "--duration", "3", "--interval", "0.5")
    assert got.returncode == 0, got.stderr
    last = snapshots(first)[-1]
    (loader,) = last["loaders"]  # type: ignore[misc]
    assert loader["batches_total"] > 0 and loader["worker_pids"] == workers
    loaded = last["agent_loaded_unix_time"]
    assert isinstance(loaded, float) and loaded <= float(last["time"])  # type: ignore[arg-type]

    time.sleep(max(0.0, loaded + 11 - time.time()))  # past the report's 10 s
    later = tmp_path / "later.jsonl"
    got = dlmon("record", str(pid), "-o", str(later), "--duration", "2", "--interval", "0.5")
    assert got.returncode == 0, got.stderr
    report = dlmon("report", str(later))
    assert report.returncode == 0, report.stderr
    epochs = next(x for x in report.stdout.splitlines() if "epochs finished" in x)
    clock = time.strftime("%H:%M:%S", time.localtime(loaded))
    assert "counted from the agent's load into the running job at" in epochs and clock in epochs, epochs
    assert "job's start" not in report.stdout


def test_advise_inject_advises_from_the_loader(spawn: Spawn, clean_env: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pid, _ = start_trainer(spawn, tmp_path / "log", tmp_path / "stop")
    got = dlmon("advise", str(pid), "--inject", "--seconds", "2", "--json")
    assert got.returncode == 0, got.stderr
    advice = json.loads(got.stdout)
    assert advice["has_agent"] is True and advice["num_workers"] == 2 and advice["persistent_workers"] is True
    assert advice["data_wait_fraction"] is not None


def test_export_inject_serves_the_loaders_metrics(spawn: Spawn, clean_env: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import re
    import signal
    import urllib.request

    pid, _ = start_trainer(spawn, tmp_path / "log", tmp_path / "stop")
    cmd = [sys.executable, "-m", "dlmon", "export", str(pid), "--inject", "--prometheus", "127.0.0.1:0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        found = re.search(r"http://(127\.0\.0\.1:\d+)/metrics", line)
        assert found, line
        deadline = time.monotonic() + 20
        batches = 0.0
        while time.monotonic() < deadline and batches <= 0:
            with urllib.request.urlopen(f"http://{found.group(1)}/metrics", timeout=5) as answer:
                text = answer.read().decode()
            got = re.search(rf'^dlmon_loader_batches_total\{{loader="{pid}:1"[^}}]*\}} (\S+)$', text, re.M)
            batches = float(got.group(1)) if got else 0.0
            time.sleep(0.3)
        assert batches > 0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)


def test_export_inject_with_all_jobs_is_refused_in_one_line() -> None:
    got = dlmon("export", "--all-jobs", "--inject", "--prometheus", "127.0.0.1:0", timeout=30)
    assert got.returncode == 2 and got.stderr.count("\n") == 1 and "--all-jobs" in got.stderr, got.stderr


def test_a_load_that_cannot_be_done_says_why_and_the_watch_goes_on(spawn: Spawn, terminal: Tmux) -> None:
    """Every thread of the job sleeps with the GIL released: no safe point within the load's 10 s.
    The reason takes the offer's place, the job runs on untouched, and i offers to try again."""
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(600)')
    terminal("send-keys", "-t", "t", f"{sys.executable} -m dlmon attach {proc.pid}", "Enter")
    deadline = time.monotonic() + 30
    while "press i to load the agent" not in flat(terminal.screen()) and time.monotonic() < deadline:
        time.sleep(0.2)
    terminal("send-keys", "-t", "t", "i")
    deadline = time.monotonic() + 40
    while "press i to try again" not in flat(terminal.screen()) and time.monotonic() < deadline:
        time.sleep(0.2)
    screen = flat(terminal.screen())
    assert f"process {proc.pid} ran no Python within 10 s" in screen and "press i to try again" in screen, (
        screen
    )
    assert proc.poll() is None and str(proc.pid) in screen  # running, and still watched
    with open(f"/proc/{proc.pid}/status") as fh:
        assert "TracerPid:\t0" in fh.read()  # gdb is gone
    terminal("send-keys", "-t", "t", "q")


# -- a load that cannot be done: one line, and the watch goes on with the outside figures ----------


def refused_line(stderr: str, pid: int, why: str) -> str:
    lines = [x for x in stderr.splitlines() if "the agent was not loaded" in x]
    assert len(lines) == 1, stderr
    (line,) = lines
    assert line.startswith("dlmon: the agent was not loaded: ") and str(pid) in line and why in line, line
    assert line.endswith("; watching with the outside figures"), line
    return line


def test_record_inject_into_a_job_that_is_not_python_records_it_without_the_agent(
    clean_env: str, tmp_path: Path
) -> None:
    job = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        out = tmp_path / "r.jsonl"
        got = dlmon(
            "record", str(job.pid), "--inject", "-o", str(out), "--duration", "2", "--interval", "0.5"
        )
        assert got.returncode == 0, got.stderr
        refused_line(got.stderr, job.pid, "does not look like CPython")
        assert f"recorded to {out}" in got.stderr
        snaps = snapshots(out)
        assert snaps and all(s["target"]["pid"] == job.pid for s in snaps)  # type: ignore[index]
        assert job.poll() is None
    finally:
        job.kill()
        job.wait()


def test_advise_inject_into_a_stopped_job_says_why_and_advises_from_outside(
    spawn: Spawn, clean_env: str
) -> None:
    import signal

    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(600)')
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        got = dlmon("advise", str(proc.pid), "--inject", "--seconds", "1", "--json")
        assert got.returncode == 0, got.stderr
        refused_line(got.stderr, proc.pid, f"kill -CONT {proc.pid}")
        assert json.loads(got.stdout)["has_agent"] is False
        with open(f"/proc/{proc.pid}/status") as fh:
            assert "State:\tT" in fh.read()  # left as the user stopped it
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def test_attach_inject_into_a_job_that_is_not_python_still_prints_its_sample(clean_env: str) -> None:
    job = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        got = dlmon("attach", str(job.pid), "--inject", "--once", "--json")
        assert got.returncode == 0, got.stderr
        refused_line(got.stderr, job.pid, "does not look like CPython")
        assert json.loads(got.stdout)["target"]["pid"] == job.pid
    finally:
        job.kill()
        job.wait()


@dataclass(frozen=True)
class SleepRun:
    """What the sleeping-trainer scenario left for its test to check."""

    pid: int
    workers: list[int]
    returncode: int
    stderr: str
    recorded_pids: set[int]
    traced_after: str  # the TracerPid line after the recording
    done: list[str]  # the trainer's line once it woke
    exit_code: int | None


RECORD = (sys.executable, "-m", "dlmon", "record")


def run_sleeping_trainer(base: Path) -> SleepRun:
    """A trainer whose only Python thread sleeps in time.sleep(30), recorded with --inject, in an
    environment of its own (as ``clean_env``); mostly asleep, so the package's conftest starts it
    early, beside other tests."""
    d, env = clean_environment()
    code = (
        "import time\nimport torch\nfrom torch.utils.data import DataLoader\n"
        "it = iter(DataLoader(list(range(64)), batch_size=4, num_workers=2))\n"
        "next(it)\nprint('WORKERS', *[w.pid for w in it._workers], flush=True)\n"
        "print('READY', flush=True)\ntime.sleep(30)\n"
        "print('DONE', 1 + sum(1 for _ in it), flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        workers = [int(w) for w in proc.stdout.readline().split()[1:]]
        assert proc.stdout.readline().strip() == "READY"
        out = base / "r.jsonl"
        got = subprocess.run(
            [*RECORD, str(proc.pid), "--inject", "-o", str(out), "--duration", "2", "--interval", "0.5"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=env,
        )
        pids = {p["pid"] for s in snapshots(out) for p in s["processes"]}  # type: ignore[attr-defined]
        with open(f"/proc/{proc.pid}/status") as fh:
            traced = next((x for x in fh.read().splitlines() if x.startswith("TracerPid:")), "")
        done = proc.stdout.readline().split()
        try:
            code_ = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code_ = None
        return SleepRun(proc.pid, workers, got.returncode, got.stderr, pids, traced, done, code_)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def test_record_inject_while_the_trainer_sleeps_30_s_records_on_and_the_training_wakes_unharmed(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Its only Python thread sleeps in time.sleep(30) with the GIL released: gdb's breakpoint is
    never reached within the load's 10 s. It is left running untouched, the recording goes on with
    the outside figures (its workers included), and the training wakes and finishes."""
    pytest.importorskip("torch")
    from integration.inject.conftest import sleeping_trainer

    run = sleeping_trainer(tmp_path_factory).result(timeout=300)
    assert isinstance(run, SleepRun)
    assert run.returncode == 0, run.stderr
    refused_line(run.stderr, run.pid, "ran no Python within 10 s")
    assert set(run.workers) <= run.recorded_pids
    assert run.traced_after == "TracerPid:\t0"
    assert run.done == ["DONE", "16"]
    assert run.exit_code == 0


def test_attach_inject_that_cannot_load_opens_the_dashboard_with_the_reason(
    spawn: Spawn, terminal: Tmux
) -> None:
    """The line said on stderr is hidden by the dashboard: the reason takes the offer's place."""
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(600)')
    terminal("send-keys", "-t", "t", f"{sys.executable} -m dlmon attach {proc.pid} --inject", "Enter")
    deadline = time.monotonic() + 60
    while "press i to try again" not in flat(terminal.screen()) and time.monotonic() < deadline:
        time.sleep(0.2)
    screen = flat(terminal.screen())
    assert f"process {proc.pid} ran no Python within 10 s" in screen and "press i to try again" in screen, (
        screen
    )
    assert proc.poll() is None
    terminal("send-keys", "-t", "t", "q")
