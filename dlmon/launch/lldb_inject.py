"""``attach --inject`` through lldb where gdb is missing: the same protocol as dlmon.launch.gdb_inject.

lldb stops the target at the entry of ``PyEval_SaveThread`` (the thread holds the GIL and is about
to release it), deletes the breakpoint, then calls ``PyRun_SimpleString`` on that thread and
detaches. lldb's command files have no conditionals, so the call guards itself: it runs only when
the selected thread's pc is ``PyEval_SaveThread``'s entry (the breakpoint's stop); at the
watchdog's SIGURG stop (a target that ran no Python by the deadline) it yields -2 instead and
lldb only detaches. The watchdog (gdb_inject.WATCHDOG) is the same: it reads the breakpoint's
address from lldb's ``Breakpoint 1: where = ..., address = 0x...`` line, the hit from ``stop reason
= breakpoint 1.``; the tracer is lldb's child lldb-server, which lets go of the target when lldb
dies, and the watchdog then writes the original byte back as it does for gdb.
"""

from __future__ import annotations

import re
import shutil

from dlmon.launch.gdb_inject import GDB_KILLED, Debugger, GdbRun, run_script

MISSED_VALUE = "-2"  # PyRun_SimpleString returns 0 or -1
LLDB = Debugger(
    "lldb",
    r'Symbol: id = \{0x[0-9a-f]+\}, range = \[0x([0-9a-f]+)-0x[0-9a-f]+\), name="PyEval_SaveThread"',
    r"stop reason = breakpoint 1\.",
)
PASSED = (
    "SIGHUP SIGINT SIGQUIT SIGUSR1 SIGUSR2 SIGPIPE SIGALRM SIGTERM SIGCHLD SIGCONT SIGTSTP SIGTTIN "
    "SIGTTOU SIGXCPU SIGXFSZ SIGVTALRM SIGPROF SIGWINCH SIGIO SIGPWR SIGSYS"
)
FAULTS = "SIGSEGV SIGBUS SIGFPE SIGILL SIGABRT"


def find_lldb() -> str | None:
    return shutil.which("lldb")


def script(code: str) -> str:
    """lldb's commands: wait for PyEval_SaveThread, run ``code`` there (only there), detach.

    lldb writes the int3 while it makes the breakpoint, before it prints the breakpoint's line
    (even for a ``--disable``d one): the watchdog takes the address from ``image lookup``, printed
    by the command before. ``--skip-prologue false``: the entry itself, where the call's guard
    looks for the pc (lldb puts it after the prologue where libpython has debug info, +28 bytes
    in 3.13, where the guard then never ran the call).
    Before the hit lldb stops on a fault signal so that a target crashing on its own is reported;
    from the call on every signal passes without a stop (a stop would abandon the call).
    """
    if '"' in code or "\\" in code or "\n" in code:
        raise ValueError("code for PyRun_SimpleString must be one line without quotes or backslashes")
    call = f'(int)PyRun_SimpleString("{code}")'
    return f"""\
settings set interpreter.stop-command-source-on-error false
process handle -s false -n false -p true {PASSED}
process handle -s true -n true -p true {FAULTS}
process handle -s true -n true -p false SIGURG
image lookup -v -s PyEval_SaveThread
breakpoint set --skip-prologue false -n PyEval_SaveThread
continue
breakpoint delete -f
process handle -s false -n false -p true {PASSED} {FAULTS}
process handle -s false -n false -p false SIGURG
expression --unwind-on-error true --ignore-breakpoints true -- \
(void *)$pc == (void *)&PyEval_SaveThread ? {call} : {MISSED_VALUE}
process detach
quit
"""


def command(lldb: str, pid: int, script_path: str) -> list[str]:
    return [lldb, "--batch", "--no-lldbinit", "--no-use-colors", "-p", str(pid), "-s", script_path]


def run_code(pid: int, code: str, timeout: float, lldb: str) -> GdbRun:
    """Run ``code`` in ``pid`` at its next PyEval_SaveThread; lldb's output once it has detached."""
    return run_script(pid, script(code), ".lldb", timeout, LLDB, lambda path: command(lldb, pid, path))


RESULT = re.compile(r"^\(int\) \$\d+ = (-?\d+)")
EXITED = re.compile(r"^Process \d+ exited with status")
STOPPED_BY = re.compile(r"stop reason = signal (SIG\w+)")
EXECED = re.compile(r"stop reason = exec$")


def outcome(text: str) -> tuple[str, str]:
    """(kind, detail) from lldb's output, the kinds of gdb_inject.outcome."""
    lines = text.splitlines()
    stops = [m.group(1) for ln in lines if (m := STOPPED_BY.search(ln))]
    crash = [sig for sig in stops if sig not in ("SIGURG", "SIGSTOP")]
    for line in lines:
        m = RESULT.match(line)
        if m and m.group(1) != MISSED_VALUE:
            return ("ok", "0") if m.group(1) == "0" else ("raised", m.group(1))
    for line in lines:
        if line.startswith(GDB_KILLED + " "):
            return "killed", line.removeprefix(GDB_KILLED + " ")
    if any("attach failed" in ln for ln in lines):
        if any("No such process" in ln or "no such process" in ln for ln in lines):
            return "exited", ""
        return "refused", ""
    if any(EXITED.match(ln) for ln in lines):
        return "exited", crash[0] if crash else ""
    if crash:
        return "crashed", crash[0]
    if any(EXECED.search(ln) for ln in lines):  # the breakpoint's stop never came: nothing ran
        return "execd", ""
    if any((m := RESULT.match(ln)) and m.group(1) == MISSED_VALUE for ln in lines):
        return "missed", ""
    noise = ("(lldb)", "Traceback", "  File", "ModuleNotFoundError")  # lldb's own Python, broken
    rest = [ln for ln in lines if ln.strip() and not ln.startswith(noise)]
    errors = [ln for ln in rest if ln.startswith("error: ")]  # not the echoed source and caret after
    return "failed", (errors[0] if errors else rest[-1] if rest else "lldb printed nothing")
