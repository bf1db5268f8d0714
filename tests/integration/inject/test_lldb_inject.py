"""``attach --inject`` through lldb, on a machine where gdb is missing (PATH holds lldb only): the
agent loaded into real processes started without dlmon, which keep running (never stopped, never
killed, exit code 0), with no breakpoint left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import integration.inject.test_gdb_inject as gdb_tests
from conftest import Spawn
from dlmon.collect.agent_client import AgentClient
from dlmon.collect.target_python import process_state
from dlmon.launch import lldb_inject
from dlmon.launch.agent_offer import offer_for
from dlmon.launch.inject import InjectError, find_debugger, inject
from integration.inject.test_gdb_inject import (
    TRAINER,
    _code_of,
    _save_thread_in,
    finish,
    no_stage_left,
    other_python,
    spawn_py,
)
from support.paths import ROOT

runtime_dir = gdb_tests.runtime_dir  # the fixture: the agent's socket directory, and a TMPDIR

pytestmark = [
    pytest.mark.skipif(shutil.which("lldb") is None, reason="lldb is not installed"),
    pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14+ injects with sys.remote_exec"),
]


@pytest.fixture
def lldb_only(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PATH on which gdb is not found and lldb is."""
    bin_dir = tmp_path_factory.mktemp("lldb-only")
    lldb = shutil.which("lldb")
    assert lldb is not None
    os.symlink(lldb, bin_dir / "lldb")
    monkeypatch.setenv("PATH", str(bin_dir))
    assert shutil.which("gdb") is None and find_debugger() == str(bin_dir / "lldb")
    return str(bin_dir / "lldb")


def served_batches(client: AgentClient, pid: int) -> int:
    raw = client.read_raw([pid]).get(pid, {})
    return sum(int(lo.get("batches_total") or 0) for lo in raw.get("loaders", []))


def test_loads_into_a_plain_loop_and_a_second_load_is_a_no_op(
    spawn: Spawn, runtime_dir: str, lldb_only: str
) -> None:
    proc = spawn(
        'print("READY", flush=True)\nimport os, time\n'
        "while not os.path.exists(os.environ['STOP']):\n    time.sleep(0.01)\n"
        'import sys\nprint("agent" if "dlmon.agent" in sys.modules else "none", flush=True)',
        env={"STOP": os.path.join(runtime_dir, "stop")},
    )
    assert offer_for(proc.pid) is not None and "(lldb; " in offer_for(proc.pid).offer  # type: ignore[union-attr]
    before = time.time()
    path = inject(proc.pid)
    assert path.startswith(runtime_dir) and os.path.exists(path)
    reply = AgentClient().read_raw([proc.pid]).get(proc.pid, {})  # the agent answers
    loaded = reply.get("injected_unix_time")
    assert reply.get("pid") == proc.pid and isinstance(loaded, float) and before <= loaded <= time.time()
    assert process_state(proc.pid) in (("S", 0), ("R", 0))  # running, untraced
    assert inject(proc.pid) == path  # the agent already serves: a no-op
    assert AgentClient().read_raw([proc.pid]).get(proc.pid, {}).get("injected_unix_time") == loaded
    Path(runtime_dir, "stop").touch()
    assert finish(proc).split() == ["agent"]
    assert no_stage_left() == []


def test_loads_into_a_running_dataloader_training(
    spawn: Spawn, runtime_dir: str, lldb_only: str, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    stop = tmp_path / "stop"
    proc = spawn_py(spawn, TRAINER, str(stop))
    path = inject(proc.pid)
    client = AgentClient()
    deadline = time.monotonic() + 20
    batches = 0
    while time.monotonic() < deadline and batches < 8:  # counted by iterators made after the load
        batches = served_batches(client, proc.pid)
        time.sleep(0.2)
    assert batches >= 8
    assert inject(proc.pid) == path  # a second load is a no-op on the agent already serving
    assert served_batches(client, proc.pid) >= batches
    stop.touch()
    report = json.loads(finish(proc).strip().splitlines()[-1])
    assert report["agent"] and report["batches"] > batches
    assert report["sys_path"] == [] and report["main_added"] == []
    assert no_stage_left() == []


SLEEPS = """
import signal, time
class Wake(Exception):
    pass
def wake(*args):
    raise Wake
signal.signal(signal.SIGUSR1, wake)
print("READY", flush=True)
try:
    time.sleep(600)
except Wake:
    pass
time.sleep(0.01)  # through PyEval_SaveThread: an int3 left there would kill it with SIGTRAP
print("woke", flush=True)
"""


def test_a_target_running_no_python_is_given_up_on_and_left_clean(
    spawn: Spawn, runtime_dir: str, lldb_only: str
) -> None:
    """time.sleep with no other thread never reaches the breakpoint: at the timeout the watchdog's
    SIGURG stops lldb's wait, lldb deletes the breakpoint (the call's guard yields -2) and detaches."""
    proc = spawn(SLEEPS)
    ours, func = _save_thread_in(proc.pid)
    clean = _code_of(os.getpid(), ours, 16)
    with pytest.raises(InjectError, match=f"process {proc.pid} ran no Python within 1 s") as err:
        inject(proc.pid, timeout=1)
    assert "\n" not in str(err.value)
    assert process_state(proc.pid) == ("S", 0)  # asleep, and no tracer left attached
    assert _code_of(proc.pid, func, 16) == clean  # no int3 left in PyEval_SaveThread
    os.kill(proc.pid, signal.SIGUSR1)
    assert "woke" in finish(proc)
    assert no_stage_left() == []


def test_lldb_killed_while_waiting_leaves_no_breakpoint(
    spawn: Spawn, runtime_dir: str, lldb_only: str
) -> None:
    """lldb SIGKILLed while it waits: its lldb-server lets the target go with the int3 in its code;
    the watchdog writes the original byte back, and the target then runs Python and exits 0."""
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
    clean = _code_of(os.getpid(), ours, 32)
    loader = threading.Thread(target=load)
    loader.start()
    deadline = time.monotonic() + 20
    code = clean
    while time.monotonic() < deadline and b"\xcc" not in bytes(
        c for c, d in zip(code, clean, strict=True) if c != d
    ):
        time.sleep(0.005)
        code = _code_of(proc.pid, func, 32)
    assert code != clean, "lldb never put its breakpoint in"
    server = process_state(proc.pid)[1]  # lldb-server, lldb's child, traces the target
    with open(f"/proc/{server}/stat") as fh:
        lldb_pid = int(fh.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{lldb_pid}/comm") as fh:
        assert fh.read().startswith("lldb")
    os.kill(lldb_pid, signal.SIGKILL)
    loader.join(60)
    assert len(errors) == 1 and isinstance(errors[0], InjectError), errors
    assert _code_of(proc.pid, func, 32) == clean, errors[0]
    assert "lldb died of signal 9" in str(errors[0])
    assert "its breakpoint was taken out of the target's code" in str(errors[0])
    deadline = time.monotonic() + 10
    while process_state(proc.pid)[0] not in ("S", "R") and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGUSR1)
    assert "alive" in finish(proc)
    assert no_stage_left() == []


def test_a_target_exiting_during_the_load_is_reported(spawn: Spawn, runtime_dir: str, lldb_only: str) -> None:
    """After its sleep it calls os._exit at once: no PyEval_SaveThread on the way out."""
    proc = spawn('print("READY", flush=True)\nimport os, time\ntime.sleep(1)\nos._exit(0)')
    with pytest.raises(InjectError, match=f"process {proc.pid} exited while dlmon was loading"):
        inject(proc.pid, timeout=10)
    proc.wait(10)
    assert proc.returncode == 0
    assert no_stage_left() == []


def test_a_target_crashing_on_its_own_during_the_load_is_reported_and_gets_its_signal(
    spawn: Spawn, runtime_dir: str, lldb_only: str
) -> None:
    """os.abort() right after its sleep, with no PyEval_SaveThread between: lldb stops on the
    SIGABRT, the call's guard does not run, and the detach passes the signal on as it was."""
    proc = spawn('print("READY", flush=True)\nimport os, time\ntime.sleep(1)\nos.abort()')
    with pytest.raises(InjectError, match=f"process {proc.pid} got SIGABRT of its own"):
        inject(proc.pid, timeout=10)
    assert proc.wait(10) == -signal.SIGABRT
    assert no_stage_left() == []


def test_a_deadline_before_lldb_attached_still_ends_the_wait(
    spawn: Spawn, runtime_dir: str, lldb_only: str
) -> None:
    """The deadline passes while lldb is still starting: SIGURG goes out once lldb-server (lldb's
    child) traces the target, again every 0.5 s, and lldb's wait ends on one of them."""
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


@pytest.mark.parametrize("minor", [9, 10, 12, 13])
def test_loads_into_every_other_python(minor: int, runtime_dir: str, lldb_only: str) -> None:
    python = other_python(minor)
    if python is None:
        pytest.skip(f"no Python 3.{minor} here")
    code = "import time\nprint('READY', flush=True)\nwhile True:\n    time.sleep(0.01)\n"
    proc = subprocess.Popen([python, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        path = inject(proc.pid)
        assert AgentClient().read_raw([proc.pid]).get(proc.pid, {}).get("pid") == proc.pid
        assert inject(proc.pid) == path
        assert process_state(proc.pid) in (("S", 0), ("R", 0))
    finally:
        proc.kill()
        proc.wait()
    assert no_stage_left() == []


@pytest.mark.parametrize(
    ("output", "kind"),
    [
        ("* thread #1, name = 'python', stop reason = breakpoint 1.1\n(int) $0 = 0", "ok"),
        ("* thread #1, name = 'python', stop reason = breakpoint 1.1\n(int) $0 = -1", "raised"),
        ("* thread #1, name = 'python', stop reason = signal SIGURG\n(int) $0 = -2", "missed"),
        ("Process 7 exited with status = 0 (0x00000000)", "exited"),
        ("error: attach failed: Operation not permitted", "refused"),
        (
            "* thread #2, name = 'pt_main', stop reason = signal SIGSEGV: invalid address\n(int) $0 = -2",
            "crashed",
        ),
        ("error: unknown command", "failed"),
        ("* thread #1, name = 'python', stop reason = exec\nerror: expression failed to parse:", "execd"),
    ],
)
def test_lldb_outcomes(output: str, kind: str) -> None:
    assert lldb_inject.outcome(output)[0] == kind


def test_the_call_is_guarded_and_every_signal_passes_during_it() -> None:
    text = lldb_inject.script("x = 1")
    before, after = text.split("\ncontinue\n")
    assert "-p false SIGURG" in before and "-s true -n true -p true SIGSEGV" in before
    assert "breakpoint delete" in after.split("expression")[0]
    assert "-s false -n false -p false SIGURG" in after.split("expression")[0]
    assert '(void *)$pc == (void *)&PyEval_SaveThread ? (int)PyRun_SimpleString("x = 1")' in after
    with pytest.raises(ValueError):
        lldb_inject.script('print("x")')


def test_lldb_server_killed_while_waiting_leaves_no_breakpoint(
    spawn: Spawn, runtime_dir: str, lldb_only: str
) -> None:
    """lldb-server (the tracer) SIGKILLed while lldb waits: the kernel lets the target go with the
    int3 in its code and lldb itself exits normally (its process is "lost"), not by a signal; the
    watchdog must still write the original byte back, or the target dies of SIGTRAP at its next
    PyEval_SaveThread."""
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
    clean = _code_of(os.getpid(), ours, 32)
    loader = threading.Thread(target=load)
    loader.start()
    deadline = time.monotonic() + 20
    code = clean
    while time.monotonic() < deadline and b"\xcc" not in bytes(
        c for c, d in zip(code, clean, strict=True) if c != d
    ):
        time.sleep(0.005)
        code = _code_of(proc.pid, func, 32)
    assert code != clean, "lldb never put its breakpoint in"
    server = process_state(proc.pid)[1]
    with open(f"/proc/{server}/comm") as fh:
        assert fh.read().startswith("lldb-server")
    os.kill(server, signal.SIGKILL)
    loader.join(60)
    assert len(errors) == 1 and isinstance(errors[0], InjectError), errors
    assert _code_of(proc.pid, func, 32) == clean, errors[0]
    assert "lldb lost the target before the breakpoint was hit" in str(errors[0])
    assert "its breakpoint was taken out of the target's code" in str(errors[0])
    deadline = time.monotonic() + 10
    while process_state(proc.pid)[0] not in ("S", "R") and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGUSR1)
    assert "alive" in finish(proc)
    assert no_stage_left() == []


def test_children_forked_during_the_load_keep_no_breakpoint(
    spawn: Spawn, runtime_dir: str, lldb_only: str
) -> None:
    """A target forking while lldb's int3 is in its code: each child runs Python (time.sleep, so
    PyEval_SaveThread) untraced; one inheriting the int3 would die of SIGTRAP."""
    proc = spawn(
        "import os, sys, time\n"
        'print("READY", flush=True)\n'
        "bad = []\n"
        "end = time.monotonic() + 60\n"
        "while not os.path.exists(os.environ['STOP']) and time.monotonic() < end:\n"
        "    child = os.fork()\n"
        "    if child == 0:\n"
        "        time.sleep(0.001)\n"
        "        os._exit(7)\n"
        "    _, status = os.waitpid(child, 0)\n"
        "    if status != 7 << 8:\n"
        "        bad.append(status)\n"
        'print("bad", bad, flush=True)\n',
        env={"STOP": os.path.join(runtime_dir, "stop")},
    )
    assert os.path.exists(inject(proc.pid, timeout=20))
    Path(runtime_dir, "stop").touch()
    assert "bad []" in finish(proc)


def test_the_offer_states_the_measured_pause() -> None:
    """The offer is the user's only warning before lldb stops the training: it must state the
    median docs/performance.md measured for the script dlmon runs (3.4 s), not an older 3.0 s."""
    from dlmon.launch.agent_offer import AgentOffer

    docs = (ROOT / "docs" / "performance.md").read_text()
    row = next(ln for ln in docs.splitlines() if ln.startswith("| lldb `--batch`"))
    median_s = int(row.split("**")[1].split(" / ")[0].replace(",", "")) / 1000
    shown = f"~{round(median_s * 2) / 2:g} s pause"
    assert AgentOffer(4242, "lldb").offer.endswith(f"(lldb; {shown})")
    assert f'"(lldb; {shown})"' in docs


def test_a_target_exec_ing_during_the_load_is_told_plainly_and_keeps_running(
    spawn: Spawn, runtime_dir: str, lldb_only: str
) -> None:
    """A pure-Python loop (no PyEval_SaveThread) then execv: lldb stops at the exec, the new
    program has no Python symbols yet, and the call's parse fails. The user must read why, not
    lldb's caret line under the failed expression."""
    proc = spawn(
        'print("READY", flush=True)\nimport os, sys\nx = 0\nfor i in range(20_000_000):\n    x += i\n'
        "os.execv(sys.executable, [sys.executable, '-c', "
        "'import time\\nfor i in range(100): time.sleep(0.01)\\nprint(\"after exec\", flush=True)'])\n"
    )
    with pytest.raises(InjectError, match=f"process {proc.pid} replaced its program .exec. while dlmon"):
        inject(proc.pid, timeout=20)
    assert "after exec" in finish(proc)
    assert no_stage_left() == []
