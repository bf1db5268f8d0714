"""Run one line of Python in a running CPython 3.9 to 3.13 through gdb (``attach --inject``).

gdb stops the target at the entry of ``PyEval_SaveThread``: that thread holds the GIL and is about
to release it, so the interpreter is in a state where any other Python thread could run, and
``PyRun_SimpleString`` there is as safe as another thread running. During ``call`` gdb resumes
every thread (scheduler-locking off), so a thread holding a malloc lock lets it go.

The pause stays short: gdb reads the ELF symbols of the executable and of libpython only, not the
debug info nor the hundreds of MB of .so files a torch process maps (docs/performance.md).

Bounding the wait: a target whose threads all sit with the GIL released (``signal.pause()``, a
long ``time.sleep``) never reaches the breakpoint. At the deadline dlmon sends the target SIGURG
(ignored by default, and gdb is told to stop on it without passing it on): gdb's ``continue``
returns, the script deletes the breakpoint and detaches. Once the breakpoint was hit dlmon never
signals again, and never kills gdb in the middle of the call: that could leave the target's
thread in a half-run function or with a breakpoint byte in its code.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field

HIT = "DLMON-HIT"
MISSED = "DLMON-MISSED"
CALL_TIMEOUT_S = 30.0  # after the hit: the agent's import and start(), normally ~50 ms
EXIT_GRACE_S = 5.0  # gdb's detach after SIGURG


class GdbError(Exception):
    """Why gdb could not run the code, in one sentence."""


@dataclass
class GdbRun:
    output: list[str] = field(default_factory=list)
    hit: threading.Event = field(default_factory=threading.Event)

    def text(self) -> str:
        return "\n".join(self.output)


def find_gdb() -> str | None:
    return shutil.which("gdb")


def script(code: str) -> str:
    """The gdb commands: wait for PyEval_SaveThread, run ``code`` there once, detach."""
    if '"' in code or "\\" in code or "\n" in code:
        raise ValueError("code for PyRun_SimpleString must be one line without quotes or backslashes")
    return f"""\
set pagination off
set confirm off
set unwindonsignal on
handle all nostop noprint pass
handle SIGINT nostop noprint pass
handle SIGSEGV SIGBUS SIGFPE SIGILL SIGABRT stop print pass
handle SIGURG stop print nopass
break PyEval_SaveThread
commands
silent
echo {HIT}\\n
delete breakpoints
handle SIGURG nostop noprint nopass
call (int)PyRun_SimpleString("{code}")
detach
quit
end
continue
echo {MISSED}\\n
delete breakpoints
detach
quit
"""


def command(gdb: str, pid: int, script_path: str, libpython: str | None, readnever: bool = True) -> list[str]:
    # auto-solib-add off: symbols of the executable only (a statically linked python has
    # PyEval_SaveThread there), plus libpython's when it is a shared library
    # --readnever: ELF symbols only, no DWARF (libpython's debug info alone stopped the target for
    # 0.2 s more); gdb 8.2+
    cmd = [gdb, "-q", "-batch", "-nx", *(["--readnever"] if readnever else [])]
    cmd += ["-iex", "set auto-load off", "-iex", "set auto-solib-add off"]
    cmd += [f"/proc/{pid}/exe", "-ex", f"attach {pid}"]
    if libpython:
        cmd += ["-ex", f"sharedlibrary {os.path.basename(libpython).split('.so')[0]}"]
    return [*cmd, "-x", script_path]


def _read(proc: subprocess.Popen[str], run: GdbRun) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        run.output.append(line)
        if line.strip() == HIT:
            run.hit.set()


def run_code(
    pid: int, code: str, timeout: float, libpython: str | None, gdb: str, readnever: bool = True
) -> GdbRun:
    """Run ``code`` in ``pid`` at its next PyEval_SaveThread; gdb's output once it has detached.

    Raises GdbError when gdb had to be left running.
    """
    fd, script_path = tempfile.mkstemp(prefix="dlmon-inject-", suffix=".gdb")
    with os.fdopen(fd, "w") as fh:
        fh.write(script(code))
    run = GdbRun()
    try:
        proc = subprocess.Popen(
            command(gdb, pid, script_path, libpython, readnever),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # the user's Ctrl-C to dlmon must not interrupt gdb mid-call
        )
        reader = threading.Thread(target=_read, args=(proc, run), daemon=True)
        reader.start()
        _wait(proc, pid, run, timeout)
        reader.join(2.0)
    finally:
        os.unlink(script_path)
    return run


def _wait(proc: subprocess.Popen[str], pid: int, run: GdbRun, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if run.hit.is_set():
                try:
                    proc.wait(CALL_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    raise GdbError(
                        f"the load is still running in process {pid} after {CALL_TIMEOUT_S:.0f} s; "
                        f"gdb (pid {proc.pid}) is left to finish it, so as not to stop the training"
                    ) from None
                return
            if time.monotonic() >= deadline:
                _bound(proc, pid, run)
                return
            run.hit.wait(0.02)
    except KeyboardInterrupt:
        if proc.poll() is None and not run.hit.is_set():
            _bound(proc, pid, run)
        raise


def _bound(proc: subprocess.Popen[str], pid: int, run: GdbRun) -> None:
    """At the deadline, before any hit: stop gdb's ``continue`` so that it detaches."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGURG)
    try:
        proc.wait(EXIT_GRACE_S)
        return
    except subprocess.TimeoutExpired:
        pass
    if run.hit.is_set():  # the breakpoint won the race: the call is running, let it finish
        try:
            proc.wait(CALL_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            pass
    else:
        proc.terminate()  # gdb detaches on SIGTERM (it attached, so it never kills)
        try:
            proc.wait(EXIT_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            pass
    raise GdbError(
        f"gdb (pid {proc.pid}) did not detach from process {pid}; it is left running, not killed, "
        "since killing it could leave a breakpoint in the training"
    )


PTRACE_REFUSED = ("ptrace: Operation not permitted", "Could not attach to process")


def too_old_for_readnever(text: str) -> bool:
    """gdb before 8.2 stops at once on the unknown option, before attaching."""
    return "readnever" in text and ("unrecognized option" in text or "unknown option" in text)


def outcome(text: str) -> tuple[str, str]:
    """(kind, detail) from gdb's output: ok, raised, missed, exited, crashed, refused or failed."""
    for line in text.splitlines():
        if line.startswith("$1 = "):
            value = line.removeprefix("$1 = ").strip()
            return ("ok", value) if value == "0" else ("raised", value)
    if any(s in text for s in PTRACE_REFUSED):
        return "refused", ""
    crash = [
        ln for ln in text.splitlines() if ln.startswith("Program received signal") and "SIGURG" not in ln
    ]
    if ("exited" in text and "[Inferior 1" in text) or "ptrace: No such process" in text:
        return "exited", crash[0] if crash else ""
    if crash:  # the target's own fault, passed on to it at the detach as if gdb had not been there
        return "crashed", crash[0].removeprefix("Program received signal ").rstrip(".")
    if MISSED in text:
        return "missed", ""
    lines = [ln for ln in text.splitlines() if ln.strip() and "auto-load" not in ln]
    return "failed", (lines[-1] if lines else "gdb printed nothing")
