"""Deaths and hangs of real trainings under ``dlmon run --headless --record``: the alert, the exit
verdict, the record and the replay name the right process, the right cause and the evidence.

Each test starts a real torch training (tests/agent_scripts/deaths.py) with real DataLoader
workers under dlmon, makes one thing go wrong for real (kill -9, a v1 memory cgroup's limit, a
tiny /dev/shm in a private mount namespace, a segfault, a hang) and reads what dlmon printed and
recorded.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import Background
from dlmon.flow.sources import read_record
from dlmon.model import Snapshot
from support.agent import ROOT, private_agent_env

SCRIPT = str(ROOT / "tests" / "agent_scripts" / "deaths.py")
DEADLINE_S = 90.0

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is None, reason="needs torch")


@dataclass
class Run:
    """One ``dlmon run --headless --record`` of deaths.py, read as it goes."""

    proc: subprocess.Popen[str]
    record: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    err_times: list[float] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start_readers(self) -> None:
        def out() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith("@@ "):
                    self.events.append(json.loads(line[3:]))

        def err() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.err.append(line.rstrip("\n"))
                self.err_times.append(time.time())

        for fn in (out, err):
            t = threading.Thread(target=fn, daemon=True)
            t.start()
            self._threads.append(t)

    def event(self, name: str, timeout: float = DEADLINE_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in list(self.events):
                if e["ev"] == name:
                    return e
            if self.proc.poll() is not None and not any(e["ev"] == name for e in self.events):
                time.sleep(0.5)
                found = [e for e in self.events if e["ev"] == name]
                if found:
                    return found[0]
                raise AssertionError(f"exited before {name!r}: {self.stderr()}")
            time.sleep(0.05)
        raise AssertionError(f"no {name!r} event within {timeout} s: {self.stderr()}")

    def wait(self, timeout: float = DEADLINE_S) -> int:
        code = self.proc.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=10)
        return code

    def stderr(self) -> str:
        return "\n".join(self.err)

    def verdict(self) -> str:
        lines = [line for line in self.err if line.startswith("dlmon: training")]
        assert lines, f"no verdict line in:\n{self.stderr()}"
        return lines[-1]

    def verdict_time(self) -> float:
        for line, t in zip(self.err, self.err_times, strict=True):
            if line.startswith("dlmon: training"):
                return t
        raise AssertionError("no verdict")

    def snapshots(self) -> list[Snapshot]:
        return read_record(str(self.record)).snapshots


_RUNS: list[Run] = []


@pytest.fixture
def agent_env() -> Iterator[dict[str, str]]:
    with private_agent_env("dlmon-deaths-") as env:
        try:
            yield env
        finally:
            _clean_up_runs()


def _clean_up_runs() -> None:
    """A failed test leaves nothing running: dlmon, and the training's whole session (own pgid)."""
    while _RUNS:
        run = _RUNS.pop()
        for e in list(run.events):
            if e["ev"] == "ready":
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(e["pid"], signal.SIGKILL)
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait(timeout=30)


def start_run(
    env: dict[str, str],
    tmp_path: Path,
    cfg: dict[str, Any],
    *,
    prefix: list[str] | None = None,
    runs: list[Run] = _RUNS,
) -> Run:
    record = tmp_path / "run.jsonl"
    inner = [sys.executable, SCRIPT, json.dumps(cfg)]
    cmd = [sys.executable, "-m", "dlmon", "run", "--headless", "--interval", "0.5", "--record", str(record)]
    cmd += ["--", *inner] if prefix is None else ["--", *prefix, *inner]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path)
    )
    run = Run(proc, record)
    run.start_readers()
    runs.append(run)
    return run


def final_alerts(run: Run, kind: str) -> list[Any]:
    snaps = run.snapshots()
    assert snaps, "empty record"
    return [a for a in snaps[-1].alerts if a.kind == kind]


def replay_alerts(record: Path, kind: str) -> list[Any]:
    """What ``dlmon replay`` shows: the record re-analysed by this dlmon's Analyzer."""
    from dlmon.analysis import Analyzer
    from dlmon.flow.sources import ReplaySource, wait_for_end

    shown: list[Snapshot] = []
    source = ReplaySource(str(record), speed=None, analyzer=Analyzer())
    wait_for_end(source, shown.append, timeout=60)
    return [a for a in shown[-1].alerts if a.kind == kind]


def kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# -- a worker SIGKILLed: torch raises at once, the trainer exits 1 -------------------------------


def test_worker_sigkill_reaches_the_record_and_the_verdict(agent_env: dict[str, str], tmp_path: Path) -> None:
    run = start_run(agent_env, tmp_path, {"mode": "wait"})
    pids = run.event("pids")["workers"]
    victim = pids[1]
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    assert run.wait() == 1
    verdict = run.verdict()
    assert f"worker 1 (pid {victim})" in verdict
    assert "SIGKILL" in verdict and "not by the OOM killer" in verdict
    assert verdict.startswith("dlmon: training exited 1:")
    snaps = run.snapshots()
    deaths = [d for d in snaps[-1].worker_deaths if d.pid == victim]
    assert deaths and deaths[0].signal == 9 and deaths[0].worker_id == 1
    (alert,) = [a for a in final_alerts(run, "worker_died") if a.evidence.get("pid") == victim]
    assert alert.evidence["cause"] == "sigkill"
    assert any(a.evidence.get("pid") == victim for a in replay_alerts(run.record, "worker_died"))
    print(f"death to verdict: {run.verdict_time() - killed_at:.2f} s")
    # the dashboard's last frame (live or replayed) leads its alerts panel with the same verdict
    from dlmon.ui.state import DashboardState
    from dlmon.ui.views import alert_lines, text_of

    state = DashboardState()
    for snap in snaps:
        state.ingest(snap)
    panel = " ".join(text_of(line) for line in alert_lines(state, 200, False))
    assert panel.startswith(f"training exited 1: DataLoader worker 1 (pid {victim})"), panel


# -- the kernel OOM killer in a v1 memory cgroup -------------------------------------------------


def _own_v1_memory_dir() -> Path | None:
    path = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _hid, controllers, p = line.split(":", 2)
        if "memory" in controllers.split(","):
            path = p
    if path is None:
        return None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = right.split()[:3]
        if fstype == "cgroup" and "memory" in options.split(","):
            mount_root, mount_point = left.split()[3:5]
            rel = path[len(mount_root) :] if mount_root != "/" else path
            d = Path(mount_point + rel)
            return d if d.is_dir() else Path(mount_point)
    return None


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    parent = _own_v1_memory_dir()
    if parent is None:
        pytest.skip("no cgroup v1 memory hierarchy")
    d = parent / f"dlmon-deaths-{os.getpid()}-{time.monotonic_ns()}"
    try:
        d.mkdir()
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            pytest.skip(f"{parent} is not writable: {e}")
        raise
    (d / "memory.limit_in_bytes").write_text(str(900 << 20))
    with contextlib.suppress(OSError):
        (d / "memory.memsw.limit_in_bytes").write_text(str(900 << 20))  # no swap escape
    yield d
    for pid in (d / "cgroup.procs").read_text().split():
        kill_quietly(int(pid))
    for _ in range(200):
        try:
            d.rmdir()
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.05)


def _in_cgroup(d: Path) -> list[str]:
    """A prefix that moves the training into cgroup ``d`` before it execs (dlmon itself stays out)."""
    return ["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$@"', "sh"]


def _kmsg_readable() -> bool:
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
        return True
    except OSError:
        return False


def test_worker_oom_killed_in_a_memory_cgroup(
    agent_env: dict[str, str], tmp_path: Path, memory_cgroup: Path
) -> None:
    run = start_run(agent_env, tmp_path, {"mode": "oom_worker"}, prefix=_in_cgroup(memory_cgroup))
    pids = run.event("pids")["workers"]
    assert run.wait(timeout=120) != 0
    verdict = run.verdict()
    assert f"worker 1 (pid {pids[1]})" in verdict, verdict
    assert "killed by the kernel OOM killer" in verdict
    assert "cgroup limit 900.0 MiB" in verdict or "cgroup limit 900 MiB" in verdict, verdict
    (alert,) = [a for a in final_alerts(run, "worker_died") if a.evidence.get("pid") == pids[1]]
    assert alert.evidence["cause"] == "oom_killer"
    assert alert.evidence["limit"] == "cgroup"
    if _kmsg_readable():
        assert "kernel log names it" in alert.message
        assert isinstance(alert.evidence["kernel_anon_rss_bytes"], int)
        assert alert.evidence["kernel_anon_rss_bytes"] > 100 << 20
    assert alert.evidence.get("trail_uss_mib") or alert.evidence.get("trail_rss_anon_mib")
    assert any(a.evidence.get("cause") == "oom_killer" for a in replay_alerts(run.record, "worker_died"))


def test_trainer_oom_killed_orphans_named(
    agent_env: dict[str, str], tmp_path: Path, memory_cgroup: Path
) -> None:
    run = start_run(agent_env, tmp_path, {"mode": "oom_trainer"}, prefix=_in_cgroup(memory_cgroup))
    ready = run.event("ready")
    run.event("pids")
    assert run.wait(timeout=120) == 137
    verdict = run.verdict()
    assert verdict.startswith("dlmon: training exited 137: the trainer")
    assert f"(pid {ready['pid']}) was killed by the kernel OOM killer" in verdict, verdict
    (alert,) = final_alerts(run, "trainer_died")
    assert alert.evidence["cause"] == "oom_killer"
    assert replay_alerts(run.record, "trainer_died")


# -- SIGBUS: /dev/shm full (a private mount namespace with a tiny tmpfs) -------------------------


def test_worker_sigbus_from_a_full_dev_shm(agent_env: dict[str, str], tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m not allowed: {probe.stderr.decode().strip()}")
    prefix = [
        "unshare",
        "-m",
        "sh",
        "-c",
        'mount --make-rprivate / && mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$@"',
        "sh",
    ]
    run = start_run(agent_env, tmp_path, {"mode": "shm"}, prefix=prefix)
    pids = run.event("pids")["workers"]
    assert run.wait() != 0
    verdict = run.verdict()
    assert f"worker 0 (pid {pids[0]})" in verdict, verdict
    assert "SIGBUS" in verdict and "/dev/shm ran out" in verdict
    assert "16.0 MiB" in verdict, verdict  # the tmpfs's size, as the target sees it
    (alert,) = [a for a in final_alerts(run, "worker_died") if a.evidence.get("pid") == pids[0]]
    assert alert.evidence["cause"] == "shm_exhausted"
    assert "--shm-size" in alert.advice and "file_system" in alert.advice


# -- SIGSEGV: a native crash --------------------------------------------------------------------


def test_worker_segfault(agent_env: dict[str, str], tmp_path: Path) -> None:
    run = start_run(agent_env, tmp_path, {"mode": "segv"})
    pids = run.event("pids")["workers"]
    assert run.wait() != 0
    verdict = run.verdict()
    assert f"worker 1 (pid {pids[1]})" in verdict, verdict
    assert "crashed (SIGSEGV)" in verdict
    (alert,) = [a for a in final_alerts(run, "worker_died") if a.evidence.get("pid") == pids[1]]
    assert alert.evidence["cause"] == "crash"
    # the worker's own faulthandler dump, written as it crashed: its last Python frames
    assert "string_at" in verdict and "from __getitem__ (deaths.py:" in verdict, verdict
    assert "in __getitem__" in str(alert.evidence["stack"])
    assert any(
        "__getitem__" in str(a.evidence.get("stack")) for a in replay_alerts(run.record, "worker_died")
    )


# -- a trainer killed -9 by someone: exit 137, not the OOM killer --------------------------------


def test_trainer_sigkilled_not_oom(agent_env: dict[str, str], tmp_path: Path) -> None:
    run = start_run(agent_env, tmp_path, {"mode": "wait"})
    ready = run.event("ready")
    run.event("pids")
    os.kill(ready["pid"], signal.SIGKILL)
    assert run.wait() == 137
    verdict = run.verdict()
    assert re.search(rf"the trainer \(pid {ready['pid']}\) was killed by SIGKILL", verdict), verdict
    assert "not by the OOM killer" in verdict
    after = [s for s in run.snapshots() if not s.target.alive]
    if any(p.role == "worker" and p.state not in ("Z", "X") for p in after[0].processes):
        assert "orphaned" in verdict, verdict  # its workers outlived it (they poll for it every 5 s)
    assert "vanished" not in verdict, verdict


# -- the long runs, started together -------------------------------------------------------------


@dataclass
class Early:
    """One of the module's long runs (a hang to wait out, a leak to run out): started with the
    others, and the live part of its test (waiting for an event or an alert, stopping the run) done
    in a thread from the start, so the runs' waits overlap instead of adding up. The test reads
    what that part saw and makes its assertions on it."""

    run: Run
    live: Any  # Callable[[Run, dict[str, Any]], None]: fills the dict, raises as the test would
    seen: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self) -> None:
        def body() -> None:
            try:
                self.live(self.run, self.seen)
            except BaseException as exc:  # re-raised in the test that reads it
                self.error = exc

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def result(self, timeout: float = 600.0) -> dict[str, Any]:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"not over within {timeout} s:\n{self.run.stderr()}"
        if self.error is not None:
            raise self.error
        return self.seen


def _live_worker_hang(run: Run, seen: dict[str, Any]) -> None:
    seen["pids"] = run.event("pids")["workers"]
    seen["alert"], seen["snap"] = wait_for_alert(run, "stall")
    seen["history"] = run.snapshots()
    stop_run(run)


def _live_trainer_hang(run: Run, seen: dict[str, Any]) -> None:
    seen["ready"] = run.event("ready")
    run.event("hanging")
    seen["alert"], seen["snap"] = wait_for_alert(run, "stall", timeout=150)
    stop_run(run)


def _live_fd_leak(run: Run, seen: dict[str, Any]) -> None:
    seen["ready"] = run.event("ready")
    seen["alert"], seen["snap"] = wait_for_alert(run, "fd_exhaustion")
    seen["code"] = run.wait(timeout=180)


def _live_to_the_end(run: Run, seen: dict[str, Any]) -> None:
    seen["code"] = run.wait(timeout=180)


def _live_lone_hang(run: Run, seen: dict[str, Any]) -> None:
    seen["pids"] = run.event("pids")["workers"]
    seen["alert"], seen["snap"] = wait_for_alert(run, "stall", timeout=150)
    stop_run(run)


@pytest.fixture
def early(deaths_early: Background) -> dict[str, Early]:
    """The module's long runs: begun by the session (conftest) during the suite's first long
    window (integration/analysis/test_analysis_scenarios.py's jobs) when it runs, so they are over
    by now."""
    found: dict[str, Early] = deaths_early.get()
    return found


@contextlib.contextmanager
def early_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Early]]:
    """The module's long runs (each a minute or less, asleep most of it), all started at once."""
    runs: list[Run] = []
    fd_prefix = ["sh", "-c", 'ulimit -n 3000 && exec "$@"', "sh"]
    plans: dict[str, tuple[dict[str, Any], list[str] | None, Any]] = {
        "worker_hang": ({"mode": "hang", "trigger_at": 60}, None, _live_worker_hang),
        "trainer_hang": ({"mode": "trainer_hang"}, None, _live_trainer_hang),
        "fd_leak": ({"mode": "fds", "step_s": 0.005}, fd_prefix, _live_fd_leak),
        "healthy": (
            {"mode": "wait", "steps": 1500, "step_s": 0.005, "sample_s": 0.002}, None, _live_to_the_end
        ),
        "slow_start": (
            {"mode": "slow_epoch_start", "start_s": 15, "sample_s": 0.002}, None, _live_to_the_end
        ),
        "lone_hang": ({"mode": "lone_hang", "trigger_at": 60, "num_workers": 3}, None, _live_lone_hang),
    }  # fmt: skip
    with private_agent_env("dlmon-deaths-early-") as env:
        found: dict[str, Early] = {}
        try:
            for name, (cfg, prefix, live) in plans.items():
                run = start_run(env, tmp_path_factory.mktemp(name), cfg, prefix=prefix, runs=runs)
                found[name] = Early(run, live)
                found[name].start()
            yield found
        finally:
            _RUNS.extend(runs)
            _clean_up_runs()
            for e in found.values():
                if e.thread is not None:
                    e.thread.join(timeout=30)


# -- hangs ---------------------------------------------------------------------------------------


def wait_for_alert(run: Run, kind: str, timeout: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run.record.exists():
            for snap in reversed(run.snapshots()[-5:]):
                found = [a for a in snap.alerts if a.kind == kind]
                if found:
                    return found[0], snap
        assert run.proc.poll() is None, run.stderr()
        time.sleep(0.5)
    raise AssertionError(f"no {kind} alert within {timeout} s:\n{run.stderr()}")


def stop_run(run: Run) -> int:
    run.proc.send_signal(signal.SIGINT)  # dlmon forwards it to the training
    try:
        return run.wait(timeout=60)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        raise


def test_worker_hang_is_a_stall_with_its_stack_not_input_bound(early: dict[str, Early]) -> None:
    seen = early["worker_hang"].result()  # the stall alert, the history then; then stopped
    run, pids, alert, snap = early["worker_hang"].run, seen["pids"], seen["alert"], seen["snap"]
    history = seen["history"]
    assert alert.evidence["pid"] == pids[1] and alert.evidence["worker_id"] == 1, alert
    assert "hang_here (deaths.py:" in alert.message, alert.message
    assert alert.evidence["where"] == "loader"
    assert "in hang_here" in str(alert.evidence["stack"])
    assert alert.evidence["state"] in ("S", "D")
    assert (
        "in __next__" in str(alert.evidence.get("trainer_stack"))
        or alert.evidence.get("trainer_stack") is None
    )
    assert not any(a.kind == "input_bound" for s in history for a in s.alerts), "a hang is not input_bound"
    # the Workers table: the stuck worker's row has a "stuck in ..." line; Enter shows the stack
    from dlmon.ui.state import DashboardState
    from dlmon.ui.views import detail_lines, stuck_line, text_of

    state = DashboardState()
    for s in history:
        if s.time <= snap.time:
            state.ingest(s)
    assert state.latest is not None
    (row,) = [r for r in state.rows.values() if r.process.pid == pids[1]]
    line = stuck_line(row, state.latest.alerts, 120)
    assert line is not None and "stuck in hang_here (deaths.py:" in text_of(line), line
    detail = "\n".join(text_of(x) for x in detail_lines(row, state.latest, 200))
    assert "in hang_here" in detail and "in __getitem__" in detail, detail
    (other,) = [r for r in state.rows.values() if r.process.pid == pids[0]]
    assert stuck_line(other, state.latest.alerts, 120) is None
    assert other.batch_age_s is not None
    verdict = run.verdict()
    assert "stuck in hang_here" in verdict, verdict
    assert any(a.evidence.get("pid") == pids[1] for a in replay_alerts(run.record, "stall"))


def test_trainer_hang_outside_the_loader(early: dict[str, Early]) -> None:
    seen = early["trainer_hang"].result()  # the stall alert within 150 s of "hanging"; then stopped
    run, ready, alert = early["trainer_hang"].run, seen["ready"], seen["alert"]
    assert alert.evidence["where"] == "trainer"
    assert alert.evidence["pid"] == ready["pid"]
    assert "wait_for_peer (deaths.py:" in alert.message, alert.message
    assert "wait_for_peer" in run.verdict()


# -- file descriptors ----------------------------------------------------------------------------


def test_fd_leak_is_named_before_too_many_open_files(early: dict[str, Early]) -> None:
    seen = early["fd_leak"].result()  # the alert seen live (ulimit -n 3000), then the run's end
    run, ready, alert = early["fd_leak"].run, seen["ready"], seen["alert"]
    assert alert.evidence["pid"] == ready["pid"]
    assert alert.evidence["fd_limit"] == 3000
    assert isinstance(alert.evidence["fds_per_s"], float) and alert.evidence["fds_per_s"] > 1
    assert "Too many open files" in alert.message and "file_system" in alert.advice
    assert seen["code"] != 0  # it does run out
    assert "file descriptors" in run.verdict()
    assert replay_alerts(run.record, "fd_exhaustion") or any(
        a.kind == "fd_exhaustion" for s in run.snapshots() for a in s.alerts
    )


# -- a healthy job stays quiet -------------------------------------------------------------------

QUIET_KINDS = ("worker_died", "trainer_died", "stall", "fd_exhaustion")


def test_healthy_job_raises_none_of_these(early: dict[str, Early]) -> None:
    """1500 steps of 5 ms, to the end, under dlmon run (started with the module's other long runs)."""
    run = early["healthy"].run
    assert early["healthy"].result()["code"] == 0, run.stderr()
    snaps = run.snapshots()
    assert len(snaps) >= 4
    raised = {a.kind for s in snaps for a in s.alerts}
    assert not raised & set(QUIET_KINDS), raised
    assert not [line for line in run.err if line.startswith("dlmon: training")], run.stderr()
    assert not any(s.stacks for s in snaps), "no stack is taken of a healthy job"


# -- dlmon record (attached, not the parent) says the same when its target dies ------------------


def test_record_of_a_running_training_ends_with_the_verdict(
    agent_env: dict[str, str], tmp_path: Path
) -> None:
    train = subprocess.Popen(
        [sys.executable, SCRIPT, json.dumps({"mode": "wait"})],
        env=agent_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert train.stdout is not None
        pids: list[int] = []
        for line in train.stdout:
            if line.startswith("@@ ") and json.loads(line[3:])["ev"] == "pids":
                pids = json.loads(line[3:])["workers"]
                break
        out = tmp_path / "rec.jsonl"
        rec = subprocess.Popen(
            [sys.executable, "-m", "dlmon", "record", str(train.pid), "-o", str(out), "--interval", "0.5"],
            env=agent_env,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:  # the agent answered: its loader is in the record
            if out.exists() and any(s.loaders for s in read_record(str(out)).snapshots):
                break
            time.sleep(0.2)
        os.kill(pids[1], signal.SIGKILL)
        _, err = rec.communicate(timeout=DEADLINE_S)
    finally:
        kill_quietly(train.pid)
        train.wait(timeout=30)
    line = next((x for x in err.splitlines() if x.startswith("dlmon: training")), None)
    assert line is not None, err
    assert line.startswith(
        f"dlmon: training (pid {train.pid}) exited: DataLoader worker 1 (pid {pids[1]})"
    ), line
    assert "SIGKILL" in line


# -- without the agent: what dlmon can still know -----------------------------------------------


def test_without_the_agent_a_vanished_worker_is_still_reported(
    agent_env: dict[str, str], tmp_path: Path
) -> None:
    env = dict(agent_env, DLMON_AGENT_DISABLE="1")
    run = start_run(env, tmp_path, {"mode": "wait"})
    pids = run.event("pids")["workers"]
    time.sleep(1.5)  # a sample or two with the workers in the tree
    os.kill(pids[1], signal.SIGKILL)
    assert run.wait() == 1
    verdict = run.verdict()
    assert f"pid {pids[1]}" in verdict and "vanished" in verdict, verdict
    assert "no dlmon agent" in verdict
    assert not any(s.loaders for s in run.snapshots()), "the agent was not disabled"


def test_without_the_agent_an_oom_kill_is_named_from_the_kernel_log(
    agent_env: dict[str, str], tmp_path: Path, memory_cgroup: Path
) -> None:
    if not _kmsg_readable():
        pytest.skip("/dev/kmsg is not readable here")
    env = dict(agent_env, DLMON_AGENT_DISABLE="1")
    run = start_run(env, tmp_path, {"mode": "oom_worker"}, prefix=_in_cgroup(memory_cgroup))
    pids = run.event("pids")["workers"]
    assert run.wait(timeout=120) != 0
    verdict = run.verdict()
    assert f"worker (pid {pids[1]}) was killed by the kernel OOM killer" in verdict, verdict
    assert "cgroup limit 900.0 MiB" in verdict and "the kernel log names it" in verdict, verdict


# -- /dev/shm: the job's own segments ------------------------------------------------------------

SHARER = """
import sys, torch, torch.multiprocessing as mp
mp.set_sharing_strategy("file_system")
t = torch.zeros(2_000_000)
t.share_memory_()
print("ready", flush=True)
sys.stdin.readline()
"""


def test_dev_shm_segments_of_the_job_are_counted() -> None:
    from dlmon.collect.sampler import Sampler

    proc = subprocess.Popen(
        [sys.executable, "-c", SHARER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        sampler = Sampler(proc.pid)
        try:
            shm = sampler.sample().shm
        finally:
            sampler.close()
        assert shm is not None
        assert shm.job_segments == 1, shm
        assert shm.job_bytes is not None and shm.job_bytes >= 8_000_000, shm
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_slow_worker_start_up_is_not_a_stall(early: dict[str, Early]) -> None:
    """A new epoch's workers may take long to start (worker_init_fn, a big dataset): that is not a hang
    until 60 s, however fast the batches came before. (15 s start-up; the whole run, to its end.)"""
    run = early["slow_start"].run
    assert early["slow_start"].result()["code"] == 0, run.stderr()
    snaps = run.snapshots()
    assert any(ls.in_startup for s in snaps for ls in s.loaders), "the start-up was not seen"
    assert not any(a.kind == "stall" for s in snaps for a in s.alerts)
    assert not any(s.stacks for s in snaps)


def test_one_stuck_worker_while_the_others_deliver(early: dict[str, Early]) -> None:
    """in_order=False: the loader goes on without worker 1, which sleeps in hang_here forever."""
    seen = early["lone_hang"].result()  # the stall alert within 150 s; then stopped
    pids, alert, snap = seen["pids"], seen["alert"], seen["snap"]
    assert alert.evidence["where"] == "worker" and alert.evidence["pid"] == pids[1], alert
    assert "hang_here (deaths.py:" in alert.message, alert.message
    assert any((ls.batches_per_s or 0) > 0 for ls in snap.loaders), "the loader was still delivering"
