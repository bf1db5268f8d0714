"""``attach --inject`` on Python 3.9 to 3.13: the agent loaded through gdb into real processes
started without dlmon, which must keep running (never stopped, never killed, exit code 0)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Spawn
from dlmon.collect.agent_client import AgentClient
from dlmon.launch import gdb_inject
from dlmon.launch.inject import InjectError, inject, unsupported_reason
from dlmon.launch.target_python import TargetPython, process_state

ROOT = Path(__file__).resolve().parent.parent
needs_gdb = pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
gdb_python = pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14+ injects with sys.remote_exec")

# A training that never heard of dlmon: a new iterator (2 fork workers) per epoch, until STOP exists.
TRAINER = """
import json, os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        return torch.tensor([float(i * i)])

STOP = sys.argv[1]
loader = DataLoader(Squares(), batch_size=4, num_workers=2)
batches, ready, deadline = 0, False, time.monotonic() + 60
before = set(vars(sys.modules["__main__"]))
while not os.path.exists(STOP) and time.monotonic() < deadline:
    for batch in loader:
        batches += 1
        time.sleep(0.02)
        if not ready:
            print("READY", flush=True)
            ready = True
print(json.dumps({
    "batches": batches,
    "sys_path": [p for p in sys.path if "dlmon" in p],
    "main_added": sorted(set(vars(sys.modules["__main__"])) - before - {"batch", "before"}),
    "agent": "dlmon.agent" in sys.modules,
}), flush=True)
"""


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="dlmon-gdbinject-")
    os.chmod(d, 0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", d)
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the targets start without dlmon
    monkeypatch.delenv("DLMON_AGENT_DISABLE", raising=False)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def spawn_py(spawn: Spawn, code: str, *args: str) -> subprocess.Popen[str]:
    """spawn() with arguments: ``python -c CODE ARGS`` through a tiny exec wrapper."""
    wrapper = f"import sys; sys.argv = ['-c', *{list(args)!r}]; exec(compile({code!r}, '<target>', 'exec'))"
    return spawn(wrapper)


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def no_stage_left() -> list[str]:
    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("dlmon-inject-")]


@needs_gdb
@gdb_python
def test_loads_into_a_running_dataloader_training(spawn: Spawn, runtime_dir: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    stop = tmp_path / "stop"
    proc = spawn_py(spawn, TRAINER, str(stop))
    started = time.monotonic()
    path = inject(proc.pid)
    took = time.monotonic() - started
    assert path.startswith(runtime_dir) and os.path.exists(path)
    client = AgentClient()
    deadline = time.monotonic() + 20
    batches = 0
    while time.monotonic() < deadline and batches < 8:  # counted by iterators made after the load
        raw = client.read_raw([proc.pid]).get(proc.pid, {})
        batches = sum(int(lo.get("batches_total") or 0) for lo in raw.get("loaders", []))
        time.sleep(0.2)
    assert batches >= 8, raw
    assert process_state(proc.pid)[0] in ("S", "R")  # running, not left stopped

    assert inject(proc.pid) == path  # a second load is a no-op on the agent already serving
    again = client.read_raw([proc.pid]).get(proc.pid, {})
    assert sum(int(lo.get("batches_total") or 0) for lo in again.get("loaders", [])) >= batches

    stop.touch()
    report = json.loads(finish(proc).strip().splitlines()[-1])
    assert report["agent"] and report["batches"] > batches
    assert report["sys_path"] == []  # the staged directory was taken off sys.path
    assert report["main_added"] == []  # the loader touched no name of the target's __main__
    assert no_stage_left() == []
    assert took < 8, took


@needs_gdb
@gdb_python
def test_a_sleeping_trainer_is_loaded_when_it_wakes(spawn: Spawn, runtime_dir: str) -> None:
    """Its only thread sleeps with the GIL released: nothing reaches PyEval_SaveThread until the
    sleep ends, then the next call that releases the GIL (here the print) runs the load."""
    proc = spawn(
        'print("READY", flush=True)\nimport time\ntime.sleep(3)\nprint("awake", flush=True)\ntime.sleep(1)\n'
    )
    started = time.monotonic()
    inject(proc.pid, timeout=15)
    assert 1.5 < time.monotonic() - started < 10
    assert "awake" in finish(proc)


@needs_gdb
@gdb_python
def test_a_sleeping_main_thread_is_loaded_through_another_thread(spawn: Spawn, runtime_dir: str) -> None:
    """Any thread that releases the GIL reaches the breakpoint: a helper thread's short sleeps (or a
    DataLoader's pin-memory thread) load the agent while the main thread sleeps on."""
    proc = spawn(
        "import threading, time\n"
        "def tick():\n    while True:\n        time.sleep(0.05)\n"
        "threading.Thread(target=tick, daemon=True).start()\n"
        'print("READY", flush=True)\ntime.sleep(4)\nprint("awake", flush=True)\n'
    )
    started = time.monotonic()
    inject(proc.pid, timeout=10)
    assert time.monotonic() - started < 2.5
    assert "awake" in finish(proc)


@needs_gdb
@gdb_python
def test_a_target_running_no_python_is_left_untouched(spawn: Spawn, runtime_dir: str) -> None:
    """signal.pause() with no other thread never reaches the breakpoint: at the timeout gdb deletes
    it and detaches; the target then wakes, runs Python (which would trap on a breakpoint left
    behind) and exits 0."""
    proc = spawn(
        "import signal\nsignal.signal(signal.SIGUSR1, lambda *a: None)\n"
        'print("READY", flush=True)\nsignal.pause()\nprint("woke", flush=True)'
    )
    started = time.monotonic()
    with pytest.raises(InjectError, match=f"process {proc.pid} ran no Python within 1 s") as err:
        inject(proc.pid, timeout=1)
    assert time.monotonic() - started < 5
    assert "\n" not in str(err.value)
    assert process_state(proc.pid) == ("S", 0)  # asleep, and no tracer left attached
    os.kill(proc.pid, signal.SIGUSR1)
    assert "woke" in finish(proc)
    assert no_stage_left() == []


@needs_gdb
@gdb_python
def test_a_stopped_target_is_refused_and_stays_stopped(spawn: Spawn, runtime_dir: str) -> None:
    proc = spawn('print("READY", flush=True)\nimport time\ntime.sleep(0.5)\nprint("done", flush=True)')
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while process_state(proc.pid)[0] != "T" and time.monotonic() < deadline:  # SIGSTOP lands later
        time.sleep(0.01)
    try:
        with pytest.raises(InjectError, match=f"kill -CONT {proc.pid}"):
            inject(proc.pid, timeout=1)
        assert process_state(proc.pid)[0] == "T"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert "done" in finish(proc)


@needs_gdb
@gdb_python
def test_a_target_exiting_during_the_load_is_reported(spawn: Spawn, runtime_dir: str) -> None:
    """After its sleep it calls os._exit at once: no PyEval_SaveThread on the way out."""
    proc = spawn('print("READY", flush=True)\nimport os, time\ntime.sleep(1)\nos._exit(0)')
    with pytest.raises(InjectError, match=f"process {proc.pid} exited while dlmon was loading"):
        inject(proc.pid, timeout=10)
    proc.wait(10)
    assert proc.returncode == 0
    assert no_stage_left() == []


@needs_gdb
@gdb_python
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_an_unprivileged_user_gets_one_line_why(spawn: Spawn, runtime_dir: str) -> None:
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(30)')
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from dlmon.launch.inject import InjectError, inject\n"
        f"try:\n    inject({proc.pid})\nexcept InjectError as exc:\n    print(exc); sys.exit(2)\n"
    )
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", code]
    result = subprocess.run(nobody, capture_output=True, text=True, timeout=60, cwd="/")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == "" and len(result.stdout.strip().splitlines()) == 1
    assert "belongs to another user (uid 0)" in result.stdout
    assert process_state(proc.pid)[0] == "S"


@needs_gdb
@gdb_python
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="needs a python nobody can run")
def test_root_loads_into_another_users_process(runtime_dir: str) -> None:
    """The staged agent is handed to the target's user: a 0700 root directory would be unreadable."""
    code = "import time\nprint('READY', flush=True)\nwhile True:\n    time.sleep(0.01)\n"
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}  # nobody's own /tmp dir
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", code]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd="/", env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        path = inject(proc.pid)
        assert AgentClient().read_raw([proc.pid]).get(proc.pid, {}).get("pid") == proc.pid, path
        assert process_state(proc.pid)[0] in ("S", "R")
    finally:
        proc.kill()
        proc.wait()
    assert no_stage_left() == []


def test_attach_inject_without_gdb_says_to_install_it(spawn: Spawn, tmp_path: Path) -> None:
    if sys.version_info >= (3, 14):
        pytest.skip("3.14+ injects with sys.remote_exec")
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(30)')
    env = {**os.environ, "PATH": str(tmp_path)}  # no gdb on it
    cmd = [sys.executable, "-m", "dlmon", "attach", str(proc.pid), "--inject", "--once"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("dlmon: error: ") and "install gdb (apt-get install gdb)" in line


@pytest.mark.parametrize(
    ("target", "ours", "words"),
    [
        (TargetPython(None, False, None, other="PyPy"), (3, 11), "runs PyPy, not CPython"),
        (TargetPython(None, False, None), (3, 11), "does not look like CPython"),
        (TargetPython((3, 8), False, None), (3, 11), "needs 3.9 or newer"),
        (TargetPython((3, 13), True, None), (3, 11), "free-threaded Python 3.13t"),
        (TargetPython((3, 14), False, None), (3, 11), "needs dlmon on Python 3.14 too"),
    ],
)
def test_unsupported_targets_are_named(target: TargetPython, ours: tuple[int, int], words: str) -> None:
    reason = unsupported_reason(target, 42, ours=ours, gdb="/usr/bin/gdb")
    assert reason is not None and words in reason and "\n" not in reason


def test_supported_targets_need_only_gdb() -> None:
    for minor in range(9, 14):
        assert unsupported_reason(TargetPython((3, minor), False, None), 42, gdb="/usr/bin/gdb") is None
    reason = unsupported_reason(TargetPython((3, 12), False, None), 42, gdb=None)
    assert reason is not None and "install gdb (apt-get install gdb)" in reason


@pytest.mark.parametrize(
    ("output", "kind"),
    [
        (f"{gdb_inject.HIT}\n$1 = 0\n[Inferior 1 (process 7) detached]", "ok"),
        (f"{gdb_inject.HIT}\n$1 = -1\n[Inferior 1 (process 7) detached]", "raised"),
        ("[Inferior 1 (process 7) exited normally]", "exited"),
        ("ptrace: No such process.", "exited"),
        ("ptrace: Operation not permitted.", "refused"),
        (f"Program received signal SIGURG\n{gdb_inject.MISSED}\n[Inferior 1 (process 7) detached]", "missed"),
        ("No symbol table is loaded.", "failed"),
        (f"Program received signal SIGSEGV, Segmentation fault.\n{gdb_inject.MISSED}", "crashed"),
    ],
)
def test_gdb_outcomes(output: str, kind: str) -> None:
    assert gdb_inject.outcome(output)[0] == kind


def test_the_script_refuses_code_it_cannot_quote() -> None:
    with pytest.raises(ValueError):
        gdb_inject.script('print("x")')
