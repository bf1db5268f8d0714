"""``attach --inject`` on Python 3.9 to 3.13: the agent loaded through gdb into real processes
started without dlmon, which must keep running (never stopped, never killed, exit code 0)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import Spawn
from dlmon.collect.agent_client import AgentClient
from dlmon.collect.target_python import (
    TargetPython,
    process_state,
    read_target,
    replaced_library,
    same_file,
)
from dlmon.launch import agent_stage, gdb_inject
from dlmon.launch.agent_stage import stage
from dlmon.launch.inject import InjectError, inject, unsupported_reason
from support.paths import ROOT

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
def runtime_dir(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The agent's socket directory, and a TMPDIR of this test's own for the stage (0755 under /tmp:
    a target of another user must reach its stage; pytest's tmp_path is 0700)."""
    tmp_path_factory.getbasetemp()  # pytest's own, fixed before TMPDIR changes
    d = tempfile.mkdtemp(prefix="dlmon-gdbinject-", dir="/tmp")
    os.chmod(d, 0o755)
    tmp = os.path.join(d, "tmp")
    os.mkdir(tmp, 0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", d)
    monkeypatch.setenv("TMPDIR", tmp)
    monkeypatch.setattr(tempfile, "tempdir", tmp)
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
    """Stages left in this test's own TMPDIR (runtime_dir), not the machine's /tmp."""
    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("dlmon-inject-")]


@needs_gdb
@gdb_python
def test_loads_into_a_running_dataloader_training(spawn: Spawn, runtime_dir: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    stop = tmp_path / "stop"
    proc = spawn_py(spawn, TRAINER, str(stop))
    path = inject(proc.pid)
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


@needs_gdb
@gdb_python
def test_a_sleeping_trainer_is_loaded_when_it_wakes(spawn: Spawn, runtime_dir: str) -> None:
    """Its only thread sleeps with the GIL released: nothing reaches PyEval_SaveThread until the
    sleep ends, then the next call that releases the GIL (here the print) runs the load."""
    proc = spawn(
        'print("READY", flush=True)\nimport time\ntime.sleep(3)\nprint("awake", flush=True)\ntime.sleep(1)\n'
    )
    inject(proc.pid, timeout=15)
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
    inject(proc.pid, timeout=10)
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
    with pytest.raises(InjectError, match=f"process {proc.pid} ran no Python within 1 s") as err:
        inject(proc.pid, timeout=1)
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
    assert result.returncode == 0, result.stderr  # the watch goes on with the outside figures
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("dlmon: the agent was not loaded: ") and "apt-get install gdb (or lldb)" in line
    assert line.endswith("watching with the outside figures") and str(proc.pid) in result.stdout


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
    assert reason is not None and "apt-get install gdb (or lldb)" in reason


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


# -- what a load must never do to a target: the reviewer's reproductions ---------------------------

# An audit hook in the target runs code of the test's choice at the moment the exec line opens
# load.py: inside gdb's ``call``, in the thread that hit the breakpoint.
ON_LOADER_OPEN = """
import os, sys
_fired = []
def _hook(event, args):
    if event == "open" and args and not _fired and os.fsdecode(args[0]).endswith("load.py"):
        _fired.append(1)
        ACTION
sys.addaudithook(_hook)
"""


def on_loader_open(action: str) -> str:
    return ON_LOADER_OPEN.replace("ACTION", action)


@needs_gdb
@gdb_python
def test_a_signal_arriving_during_the_call_does_not_abandon_it(spawn: Spawn, runtime_dir: str) -> None:
    """SIGABRT (the target's own handler) lands while gdb's call runs: gdb must pass it on, not
    stop and unwind the call (that left the dummy frame: the target died of SIGSEGV)."""
    proc = spawn(
        "import signal, sys, time\n"
        "seen = []\n"
        "signal.signal(signal.SIGABRT, lambda *a: seen.append(1))\n"
        + on_loader_open("[os.kill(os.getpid(), __import__('signal').SIGABRT) for _ in range(3)]")
        + 'print("READY", flush=True)\n'
        "deadline = time.monotonic() + 30\n"
        "while time.monotonic() < deadline and not (seen and 'dlmon.agent' in sys.modules):\n"
        "    time.sleep(0.01)\n"
        "time.sleep(0.5)\n"
        'print("aborts", len(seen), flush=True)\n'
    )
    inject(proc.pid)
    out = finish(proc)
    assert "aborts" in out and "aborts 0" not in out


@needs_gdb
@gdb_python
def test_an_exception_in_the_exec_line_never_reaches_the_excepthook(spawn: Spawn, runtime_dir: str) -> None:
    """A training whose sys.excepthook aborts (mpi4py's): whatever fails in the exec line stays there."""
    proc = spawn(
        "import os, sys, time\n"
        "sys.excepthook = lambda *a: os.abort()\n"
        + on_loader_open("raise RuntimeError('no loader for you')")
        + 'print("READY", flush=True)\n'
        "deadline = time.monotonic() + 8\n"
        "while time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        'print("done", flush=True)\n'
    )
    with pytest.raises(InjectError, match="no status written"):
        inject(proc.pid, timeout=3)
    assert "done" in finish(proc)
    assert no_stage_left() == []


@needs_gdb
@gdb_python
def test_the_trainings_systemexit_during_the_load_stays_the_trainings(spawn: Spawn, runtime_dir: str) -> None:
    """Its SIGUSR1 handler raises SystemExit(3) while the agent is being imported: the load must not
    swallow it (it ran in the main thread and caught BaseException); the training exits 3."""
    proc = spawn(
        "import os, signal, sys, time\n"
        "def stop(*a):\n    raise SystemExit(3)\n"
        "signal.signal(signal.SIGUSR1, stop)\n"
        "fired = []\n"
        "def _hook(event, args):\n"
        "    if event == 'import' and str(args[0]).startswith('dlmon.agent') and not fired:\n"
        "        fired.append(1)\n"
        "        os.kill(os.getpid(), signal.SIGUSR1)\n"
        "sys.addaudithook(_hook)\n"
        'print("READY", flush=True)\n'
        "deadline = time.monotonic() + 20\n"
        "while time.monotonic() < deadline:\n"
        "    sum(range(100))\n"
        "    time.sleep(0.001)\n"
    )
    with contextlib.suppress(InjectError):  # the training may exit before the agent serves
        inject(proc.pid, timeout=5)
    proc.communicate(timeout=60)
    assert proc.returncode == 3


@needs_gdb
@gdb_python
def test_the_load_never_edits_the_trainings_sys_path(spawn: Spawn, runtime_dir: str) -> None:
    """The load thread put the stage at sys.path[0] and took it off again while the training may
    import: PathFinder iterates sys.path itself, and the shifted list made it skip an entry (a
    ModuleNotFoundError in the training). The staged package is now loaded by spec."""
    proc = spawn(
        "import sys, time\n"
        "edits = []\n"
        "class Watched(list):\n"
        "    def insert(self, *a):\n        edits.append(('insert', a)); list.insert(self, *a)\n"
        "    def remove(self, *a):\n        edits.append(('remove', a)); list.remove(self, *a)\n"
        "    def append(self, *a):\n        edits.append(('append', a)); list.append(self, *a)\n"
        "sys.path = Watched(sys.path)\n"
        "before = list(sys.path)\n"
        'print("READY", flush=True)\n'
        "deadline = time.monotonic() + 20\n"
        "while time.monotonic() < deadline and 'dlmon.agent.wire' not in sys.modules:\n"
        "    time.sleep(0.001)\n"
        "time.sleep(0.3)\n"
        "same = list(sys.path) == before\n"
        "print('agent', 'dlmon.agent' in sys.modules, 'edits', edits, 'same', same, flush=True)\n"
    )
    with contextlib.suppress(InjectError):
        inject(proc.pid, timeout=10)
    out = finish(proc)
    assert "agent True edits [] same True" in out, out
    assert no_stage_left() == []


def _code_of(pid: int, addr: int, size: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(addr)
        return mem.read(size)


def _save_thread_in(pid: int) -> tuple[int, int]:
    """PyEval_SaveThread's address in this process and in ``pid``, which runs our libpython (or our
    executable)."""
    import ctypes

    ours = ctypes.cast(ctypes.pythonapi.PyEval_SaveThread, ctypes.c_void_p).value
    assert ours is not None

    def base(p: int) -> tuple[str, int]:
        with open(f"/proc/{p}/maps") as fh:
            for line in fh:
                f = line.split(None, 5)
                lo, hi = (int(x, 16) for x in f[0].split("-"))
                if lo <= ours < hi and len(f) == 6:
                    return f[5].strip(), lo - int(f[2], 16)
        raise AssertionError("no mapping of PyEval_SaveThread")

    name, mine = base(os.getpid())
    with open(f"/proc/{pid}/maps") as fh:
        for line in fh:
            f = line.split(None, 5)
            if len(f) == 6 and f[5].strip() == name and int(f[2], 16) == 0:
                return ours, ours - mine + int(f[0].split("-")[0], 16)
    raise AssertionError(f"process {pid} does not map {name}")


@needs_gdb
@gdb_python
def test_gdb_killed_while_waiting_leaves_no_breakpoint(spawn: Spawn, runtime_dir: str) -> None:
    """gdb SIGKILLed (the OOM killer, kill -9) while it waits for the breakpoint: its int3 stayed in
    PyEval_SaveThread and the target died of SIGTRAP when it next ran Python. The watchdog, gdb's
    parent, writes the original byte back. gdb is killed once its int3 is in the target's code, and
    the target runs Python again only after that (when it gets SIGUSR1)."""
    proc = spawn(
        "import signal, time\nsignal.signal(signal.SIGUSR1, lambda *a: None)\n"
        'print("READY", flush=True)\nsignal.pause()\n'
        "for i in range(100):\n    time.sleep(0.001)\n"
        'print("alive", flush=True)\n'
    )
    errors: list[BaseException] = []

    def load() -> None:
        try:
            inject(proc.pid, timeout=20)
        except BaseException as exc:
            errors.append(exc)

    ours, func = _save_thread_in(proc.pid)
    clean = _code_of(os.getpid(), ours, 32)  # our copy of the same code, never breakpointed
    assert _code_of(proc.pid, func, 32) == clean
    loader = threading.Thread(target=load)
    loader.start()
    deadline = time.monotonic() + 20
    code = clean
    while time.monotonic() < deadline:
        code = _code_of(proc.pid, func, 32)
        if code != clean:
            break
        time.sleep(0.005)
    changed = bytes(c for c, d in zip(code, clean, strict=True) if c != d)
    assert b"\xcc" in changed, code.hex()
    gdb_pid = process_state(proc.pid)[1]
    assert gdb_pid
    os.kill(gdb_pid, signal.SIGKILL)
    loader.join(60)
    assert _code_of(proc.pid, func, 32) == clean
    assert len(errors) == 1 and isinstance(errors[0], InjectError), errors
    assert "gdb died of signal 9" in str(errors[0])
    assert "its breakpoint was taken out of the target's code" in str(errors[0])
    deadline = time.monotonic() + 10
    while process_state(proc.pid)[0] not in ("S", "R") and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGUSR1)
    assert "alive" in finish(proc)
    assert no_stage_left() == []


def _poke(pid: int, addr: int, byte: bytes) -> None:
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(addr)
        mem.write(byte)


def _watchdog_of_a_gdb_killed(pid: int, addr: int, linger: float = 0.3, chatter: int = 0) -> str:
    """The watchdog's report when its "gdb" printed ``chatter`` lines, announced a breakpoint at
    ``addr`` and died of SIGKILL ``linger`` seconds later."""
    fake = f'yes "Reading symbols" | head -n {chatter}; echo "Breakpoint 1 at {addr:#x}"; '
    fake += f"sleep {linger}; kill -9 $$"
    cmd = gdb_inject.watchdog_command(pid, 30, gdb_inject.GDB, ["sh", "-c", fake])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout


SLEEPER = (
    "import signal, time\nsignal.signal(signal.SIGUSR1, lambda *a: None)\n"
    'print("READY", flush=True)\nsignal.pause()\ntime.sleep(0.01)\nprint("alive", flush=True)\n'
)


def _in_pause(pid: int) -> bool:
    """Asleep in a system call (``signal.pause()``: the only one SLEEPER blocks in after READY)."""
    try:
        with open(f"/proc/{pid}/syscall") as fh:
            call = fh.read().split()
        with open(f"/proc/{pid}/wchan") as fh:
            wchan = fh.read().strip()
    except OSError:
        return False
    asleep = process_state(pid)[0] == "S" and bool(call) and call[0].isdigit()
    return asleep and (wchan in ("", "0") or any(w in wchan for w in ("pause", "suspend", "poll")))


def spawn_sleeper(spawn: Spawn) -> subprocess.Popen[str]:
    """SLEEPER once it sleeps in ``signal.pause()``. Its READY comes before that call, whose
    PyEval_SaveThread ran into the int3 the test poked in when the target was slow to get there
    (a loaded machine): it died of SIGTRAP and /proc/PID/mem said "No such process" (CI)."""
    proc = spawn(SLEEPER)
    deadline = time.monotonic() + 30
    while not _in_pause(proc.pid):
        assert time.monotonic() < deadline, f"process {proc.pid} never slept in signal.pause()"
        time.sleep(0.01)
    return proc


@gdb_python
def test_the_watchdog_takes_the_breakpoint_out_of_an_untraced_target_only(spawn: Spawn) -> None:
    """gdb killed, and a second inject's debugger already attached: the watchdog wrote the original
    byte over whatever the other debugger had there. It now writes only into an untraced target."""
    proc = spawn_sleeper(spawn)
    ours, func = _save_thread_in(proc.pid)
    clean = _code_of(os.getpid(), ours, 1)
    _poke(proc.pid, func, b"\xcc")
    out = _watchdog_of_a_gdb_killed(proc.pid, func)
    assert "its breakpoint was taken out of the target's code" in out, out
    assert _code_of(proc.pid, func, 1) == clean
    if shutil.which("gdb") is None:
        return
    _poke(proc.pid, func, b"\xcc")
    other = subprocess.Popen(
        ["gdb", "-q", "-batch", "-nx", "-p", str(proc.pid), "-ex", "shell sleep 3"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while process_state(proc.pid)[1] != other.pid and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(proc.pid)[1] == other.pid
        out = _watchdog_of_a_gdb_killed(proc.pid, func)
        assert f"its breakpoint was left: process {proc.pid} is traced again" in out, out
        assert _code_of(proc.pid, func, 1) == b"\xcc"
    finally:
        other.wait(30)
    _poke(proc.pid, func, clean)
    os.kill(proc.pid, signal.SIGUSR1)
    assert "alive" in finish(proc)


@gdb_python
def test_a_gdb_killed_right_after_its_breakpoint_line_still_has_it_taken_out(spawn: Spawn) -> None:
    """The watchdog took the breakpoint out before its reader thread had read gdb's last lines: a
    gdb killed just after printing "Breakpoint 1 at" left its int3 in ~15% of tries, "original byte
    could not be read" (CI, stop 27). It now drains gdb's output first. The chatter before the line
    keeps the reader behind when gdb dies, as a loaded machine did."""
    proc = spawn_sleeper(spawn)
    ours, func = _save_thread_in(proc.pid)
    clean = _code_of(os.getpid(), ours, 1)
    outcomes = []
    for _ in range(3):
        _poke(proc.pid, func, b"\xcc")
        outcomes.append(_watchdog_of_a_gdb_killed(proc.pid, func, linger=0, chatter=20000))
        outcomes[-1] += f"code {_code_of(proc.pid, func, 1)!r}"
        _poke(proc.pid, func, clean)
    left = [out for out in outcomes if "taken out of the target's code" not in out]
    assert left == [], left
    assert all(out.endswith(f"code {clean!r}") for out in outcomes)
    os.kill(proc.pid, signal.SIGUSR1)
    assert "alive" in finish(proc)


@gdb_python
def test_the_watchdog_leaves_a_target_the_user_stopped_stopped(spawn: Spawn) -> None:
    """The watchdog sent SIGCONT to any target it found stopped after gdb's death, even one the user
    had stopped (Ctrl-Z, SIGSTOP) before the load."""
    proc = spawn_sleeper(spawn)
    func = _save_thread_in(proc.pid)[1]
    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while process_state(proc.pid)[0] != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    _watchdog_of_a_gdb_killed(proc.pid, func)
    time.sleep(0.2)
    assert process_state(proc.pid)[0] == "T"
    os.kill(proc.pid, signal.SIGCONT)
    os.kill(proc.pid, signal.SIGUSR1)
    assert "alive" in finish(proc)


@needs_gdb
@gdb_python
def test_a_libpython_replaced_on_disk_is_refused(spawn: Spawn, runtime_dir: str, tmp_path: Path) -> None:
    """The target's libpython is replaced on disk (a package upgrade mid-training): gdb would read
    the new file's symbols and put its int3 where the new file has PyEval_SaveThread."""
    ours = read_target(os.getpid()).libpython
    if ours is None:
        pytest.skip("this python links libpython statically")
    lib = tmp_path / os.path.basename(ours)
    shutil.copyfile(ours, lib)
    proc = spawn(
        'print("READY", flush=True)\nimport time\nwhile True:\n    time.sleep(0.01)\n',
        env={"LD_LIBRARY_PATH": str(tmp_path)},
    )
    assert read_target(proc.pid).libpython == str(lib)
    assert replaced_library(proc.pid, str(lib)) is None
    shutil.copyfile(ours, tmp_path / "new")
    os.replace(tmp_path / "new", lib)  # what pip or apt does
    with pytest.raises(InjectError, match="replaced on disk"):
        inject(proc.pid, timeout=5)
    assert process_state(proc.pid)[1] == 0  # never attached
    assert no_stage_left() == []


def _stat(dev: int, ino: int, size: int = 4096, mtime_ns: int = 10**18) -> os.stat_result:
    # st_mode, st_ino, st_dev, st_nlink, st_uid, st_gid, st_size, st_atime, st_mtime, st_ctime,
    # then the float times and the *_ns times (st_atime_ns, st_mtime_ns, st_ctime_ns)
    s = mtime_ns // 10**9
    times = (s, s, s, float(s), float(s), float(s), mtime_ns, mtime_ns, mtime_ns)
    return os.stat_result((0o100644, ino, dev, 1, 0, 0, size, *times))


def test_a_library_on_overlayfs_is_not_taken_for_replaced() -> None:
    """As root, map_files gives the lower layer's device and the path the overlay's for the same
    libpython (a Docker image): comparing (st_dev, st_ino) refused every such inject."""
    lower, overlay = _stat(dev=0x803, ino=1234), _stat(dev=0x2F, ino=1234)
    assert same_file(lower, overlay)
    assert not same_file(lower, _stat(dev=0x2F, ino=5678))  # renamed over: another inode
    assert not same_file(lower, _stat(dev=0x2F, ino=1234, size=8192))
    assert not same_file(lower, _stat(dev=0x2F, ino=1234, mtime_ns=2 * 10**18))


@needs_gdb
@gdb_python
def test_a_static_pythons_deleted_executable_is_refused(
    spawn: Spawn, runtime_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A statically linked python holds the breakpoint in its executable: deleted on disk (an
    upgrade), the watchdog could not read the original byte back (map_files needs root, the path
    is gone) and would leave the int3 if gdb died. Refused before attaching, like a libpython."""
    exe = tmp_path / os.path.basename(os.path.realpath(sys.executable))
    shutil.copy2(os.path.realpath(sys.executable), exe)
    proc = subprocess.Popen(
        [str(exe), "-c", 'print("READY", flush=True)\nimport time\nwhile True:\n    time.sleep(0.01)\n'],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        exe.unlink()
        real = read_target(proc.pid)
        monkeypatch.setattr("dlmon.launch.inject.read_target", lambda pid: replace(real, libpython=None))
        with pytest.raises(InjectError, match="deleted or replaced on disk"):
            inject(proc.pid, timeout=5)
        assert process_state(proc.pid)[1] == 0  # never attached
    finally:
        proc.kill()
        proc.wait()
    assert no_stage_left() == []


def test_a_quote_in_tmpdir_stages_and_quotes(tmp_path: Path) -> None:
    parent = tmp_path / 'it\'s "odd" \\ here'
    parent.mkdir()
    staged = stage(os.getuid(), os.getgid(), parent=str(parent))
    try:
        line = staged.exec_line()
        gdb_inject.script(line)  # no ValueError: the path travels as hex
        compile(line, "<exec line>", "exec")
        assert str(parent) not in line
    finally:
        staged.remove()


def test_the_stage_is_handed_over_bottom_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory last: until then the target's user cannot enter it to swap in a symlink."""
    order: list[str] = []
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os, "chown", lambda p, u, g, follow_symlinks=True: order.append(str(p)))
    staged = stage(65534, 65534, parent=str(tmp_path))
    try:
        assert order[-1] == str(staged.root)
        assert len(order) > 3 and str(staged.root) not in order[:-1]
        seen = set()
        for path in order:  # every directory after everything in it
            assert not any(p.startswith(path + "/") for p in order if p not in seen), path
            seen.add(path)
    finally:
        staged.remove()


def test_read_status_follows_no_link_and_reads_no_fifo(tmp_path: Path) -> None:
    staged = stage(os.getuid(), os.getgid(), parent=str(tmp_path))
    try:
        secret = tmp_path / "secret"
        secret.write_text("ok /root/secret")
        staged.status.symlink_to(secret)
        assert staged.read_status() is None
        staged.status.unlink()
        os.mkfifo(staged.status)  # would block an open without O_NONBLOCK
        assert staged.read_status() is None
        staged.status.unlink()
        staged.status.write_text("ok " + "x" * 100_000)
        assert len(staged.read_status() or "") <= agent_stage.STATUS_MAX
        assert not (staged.root / "pkg" / "load.py").exists() and staged.loader.parent == staged.root
    finally:
        staged.remove()


@pytest.mark.parametrize(
    ("output", "kind", "detail"),
    [
        # a multi-threaded target's threads come and go during the wait: not the process exiting
        (
            "[New Thread 0x7f01 (LWP 8)]\n[Thread 0x7f01 (LWP 8) exited]\n"
            f"{gdb_inject.MISSED}\n[Inferior 1 (process 7) detached]",
            "missed",
            "",
        ),
        (
            'Thread 2 "pt_main_thread" received signal SIGSEGV, Segmentation fault.\n'
            f"{gdb_inject.MISSED}\n[Inferior 1 (process 7) detached]",
            "crashed",
            "SIGSEGV, Segmentation fault",
        ),
        (
            'Thread 3 "python" received signal SIGURG, Urgent I/O condition.\n'
            f"{gdb_inject.MISSED}\n[Inferior 1 (process 7) detached]",
            "missed",
            "",
        ),
        (
            'Thread 2 "x" received signal SIGABRT, Aborted.\n[Inferior 1 (process 7) exited with code 01]',
            "exited",
            "SIGABRT, Aborted",
        ),
        (f"{gdb_inject.GDB_KILLED} gdb died of signal 9 before the breakpoint was hit", "killed", None),
        ("warning: the word exited and [Inferior 1 appear here\nNo symbol table is loaded.", "failed", None),
    ],
)
def test_gdb_outcomes_of_multi_threaded_targets(output: str, kind: str, detail: str | None) -> None:
    got = gdb_inject.outcome(output)
    assert got[0] == kind
    if detail is not None:
        assert got[1] == detail


def test_the_script_passes_every_signal_during_the_call() -> None:
    text = gdb_inject.script("x = 1")
    _, call = text.split("call ", 1)[0].rsplit("delete breakpoints", 1)
    assert "handle SIGSEGV SIGBUS SIGFPE SIGILL SIGABRT nostop noprint pass" in call
    assert "handle all nostop noprint pass" in call


def test_gdb_is_never_sent_sigterm() -> None:
    import inspect

    source = inspect.getsource(gdb_inject)
    assert ".terminate()" not in source and "SIGTERM" not in source and ".kill()" not in source


@needs_gdb
@gdb_python
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_target_with_a_private_tmp_gets_its_stage_in_its_own_tmp(runtime_dir: str) -> None:
    """A target in another mount namespace (systemd's PrivateTmp, a container) does not see our
    TMPDIR: the exec line's open failed in it and the error reached its (here aborting) excepthook.
    As root dlmon stages through /proc/PID/root/tmp instead."""
    code = (
        "import os, sys, time\nsys.excepthook = lambda *a: os.abort()\n"
        "print('READY', flush=True)\ndeadline = time.monotonic() + 20\n"
        "while time.monotonic() < deadline and 'dlmon.agent' not in sys.modules:\n    time.sleep(0.01)\n"
        "time.sleep(0.5)\nprint('agent', 'dlmon.agent' in sys.modules, flush=True)\n"
    )
    private = f'mount -t tmpfs tmpfs /tmp && exec {sys.executable} -c "$0"'
    proc = subprocess.Popen(["unshare", "-m", "sh", "-c", private, code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        with contextlib.suppress(InjectError):  # its socket lies in its own /tmp too
            inject(proc.pid)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "agent True" in out, out
    finally:
        proc.kill()
        proc.wait()
    assert no_stage_left() == []


# A root of its own (bind mounts of ours in a tmpfs) whose /tmp is an absolute symlink to /tmp
CHROOT_WITH_TMP_LINK = """
R=$(mktemp -d) && mount -t tmpfs tmpfs "$R" || exit 1
for d in /*; do
    n=$(basename "$d")
    if [ -L "$d" ]; then cp -P "$d" "$R/$n"
    elif [ "$n" = usr ] || [ "$n" = etc ] || [ "$n" = root ] || [ "$n" = dev ] || [ "$n" = proc ]; then
        mkdir "$R/$n" && mount --rbind "$d" "$R/$n" || exit 1
    fi
done
ln -s /tmp "$R/tmp"
exec chroot "$R" "$1" -c "$0"
"""


@needs_gdb
@gdb_python
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("chroot") is None,
    reason="needs root, unshare and chroot",
)
def test_a_target_whose_tmp_is_a_symlink_is_refused(
    runtime_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The target's /tmp is an absolute symlink: through /proc/PID/root it resolves against our
    root, so our stage looked visible to the target (the same inode), which sees another /tmp."""
    # its maps name its libpython by a path through its tmpfs root, which we cannot stat
    monkeypatch.setattr("dlmon.launch.inject.replaced_library", lambda pid, path: None)
    code = "import time\nprint('READY', flush=True)\ntime.sleep(30)\n"
    proc = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", CHROOT_WITH_TMP_LINK, code, sys.executable],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        assert os.path.islink(f"/proc/{proc.pid}/root/tmp")
        with pytest.raises(InjectError, match="its /tmp is not a directory"):
            inject(proc.pid, timeout=5)
        assert process_state(proc.pid) == ("S", 0)  # never attached
    finally:
        proc.kill()
        proc.wait()
    assert no_stage_left() == []


@needs_gdb
@gdb_python
def test_a_deadline_before_gdb_attached_still_ends_the_wait(spawn: Spawn, runtime_dir: str) -> None:
    """The deadline passes while gdb is still starting: a SIGURG sent then went to the bare target
    (lost), and dlmon SIGTERMed gdb after 5 s. Now SIGURG goes out only while gdb traces the target,
    again every 0.5 s, and gdb is never signalled."""
    proc = spawn(
        "import signal\nsignal.signal(signal.SIGUSR1, lambda *a: None)\n"
        'print("READY", flush=True)\nsignal.pause()\nprint("woke", flush=True)'
    )
    with pytest.raises(InjectError, match=f"process {proc.pid} ran no Python within 0 s"):
        inject(proc.pid, timeout=0.01)
    assert process_state(proc.pid) == ("S", 0)
    os.kill(proc.pid, signal.SIGUSR1)
    assert "woke" in finish(proc)
    assert no_stage_left() == []


# -- every Python --inject loads into with gdb: 3.9 to 3.13 ------------------------------------------


def other_python(minor: int) -> str | None:
    """An interpreter 3.``minor`` on this machine (pyenv's, else on PATH), or None."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(root.glob(f"3.{minor}.*/bin/python3.{minor}")) if root.is_dir() else []
    if found:
        return str(found[-1])
    return shutil.which(f"python3.{minor}")


@needs_gdb
@gdb_python
@pytest.mark.parametrize("minor", [9, 10, 11, 12, 13])
def test_loads_into_a_plain_loop_on_every_python_gdb_serves(minor: int, runtime_dir: str) -> None:
    """The staged agent is imported by the target's own interpreter: it must stay 3.9-compatible
    (standard library only, no 3.10+ syntax in what it imports). A second load is a no-op."""
    python = other_python(minor)
    if python is None:
        pytest.skip(f"no Python 3.{minor} here")
    code = "import time\nprint('READY', flush=True)\nwhile True:\n    time.sleep(0.01)\n"
    proc = subprocess.Popen([python, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        assert read_target(proc.pid).version == (3, minor)
        before = time.time()
        path = inject(proc.pid)
        reply = AgentClient().read_raw([proc.pid]).get(proc.pid, {})
        assert reply.get("pid") == proc.pid, reply
        loaded = reply.get("injected_unix_time")
        assert isinstance(loaded, float) and before <= loaded <= time.time(), reply
        assert inject(proc.pid) == path  # the agent already serves: nothing loaded again
        again = AgentClient().read_raw([proc.pid]).get(proc.pid, {})
        assert again.get("injected_unix_time") == loaded
        assert process_state(proc.pid) == ("S", 0) or process_state(proc.pid)[0] == "R"
    finally:
        proc.kill()
        proc.wait()
    assert no_stage_left() == []
