"""Run one line of Python in a running CPython 3.9 to 3.13 through gdb (``attach --inject``).

gdb stops the target at the entry of ``PyEval_SaveThread``: that thread holds the GIL and is about
to release it, so the interpreter is in a state where any other Python thread could run, and
``PyRun_SimpleString`` there is as safe as another thread running. During ``call`` gdb resumes
every thread (scheduler-locking off), so a thread holding a malloc lock lets it go.

The pause stays short: gdb reads the ELF symbols of the executable and of libpython only, not the
debug info nor the hundreds of MB of .so files a torch process maps (docs/performance.md).

Bounding the wait: a target whose threads all sit with the GIL released (``signal.pause()``, a
long ``time.sleep``) never reaches the breakpoint. At the deadline a watchdog (gdb's parent, in a
session of its own, so it outlives dlmon) sends the target SIGURG (ignored by default; gdb stops on
it without passing it on), again every 0.5 s while gdb still traces the target: gdb's ``continue``
returns, the script deletes the breakpoint and detaches. Once the breakpoint was hit nothing is
signalled again (a SIGURG then is swallowed), and gdb is never signalled at all: gdb killed in the
middle of the call leaves the target's thread in a dummy frame (it dies of SIGSEGV).

What is left (docs/reliability.md): gdb killed (kill -9, the OOM killer despite oom_score_adj
-1000) *after* the hit, during the call (the exec line: read load.py, start a thread; about a
millisecond), or in the instant a thread executes the int3 before gdb took the trap. Before the
hit the watchdog writes the original byte back; if the watchdog itself is SIGKILLed along with
gdb, the int3 stays and the target dies of SIGTRAP when it next releases the GIL.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

HIT = "DLMON-HIT"
MISSED = "DLMON-MISSED"
GDB_PID = "DLMON-GDB-PID"  # the watchdog's first line: gdb's pid
GDB_KILLED = "DLMON-GDB-KILLED"  # the watchdog's line when gdb died of a signal before detaching
CALL_TIMEOUT_S = 30.0  # after the hit: the exec line only reads load.py and starts a thread
EXIT_GRACE_S = 5.0  # gdb's detach after SIGURG
RESEND_S = 0.5  # SIGURG again while gdb is still attached and the breakpoint not hit


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
    """The gdb commands: wait for PyEval_SaveThread, run ``code`` there once, detach.

    Before the hit gdb stops on a fault signal so that a target crashing on its own is reported
    (and passed on at the detach). Right before ``call`` every signal is passed on without
    stopping: a stop in the middle of the call would abandon it with the dummy frame on the
    thread's stack (the target then dies of SIGSEGV).
    """
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
handle all nostop noprint pass
handle SIGINT nostop noprint pass
handle SIGSEGV SIGBUS SIGFPE SIGILL SIGABRT nostop noprint pass
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


# The watchdog: gdb's parent, in a session of its own, so that it outlives dlmon (Ctrl-C, a crash,
# kill -9). It forwards gdb's output, and before the breakpoint is hit it bounds the wait itself:
# at the deadline it sends the target SIGURG, again every RESEND_S while gdb is still attached
# (TracerPid) and the breakpoint not hit; never once it was hit. When gdb dies of a signal (the OOM
# killer, kill -9) before the hit, its int3 is still in the target's code: the watchdog, woken by
# gdb's exit itself (a pidfd), writes the original byte back through /proc/PID/mem at once, only
# into an untraced target and over a 0xcc, and resumes the target if gdb's death left it stopped
# (never one the user had stopped). The original byte comes from the mapped file (map_files, as
# root), else from its path: a regular file with the mapping's inode (inject refuses a target whose
# breakpoint's file is "(deleted)", where neither can be read).
WATCHDOG = r"""
import os, re, select, signal, stat, subprocess, sys, threading, time
pid, timeout, resend = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
HIT, PIDLINE, KILLED, BREAK, NAME = sys.argv[4:9]
hit_re, break_re = re.compile(HIT.encode()), re.compile(BREAK.encode())
cmd = sys.argv[9:]
if os.geteuid() == 0:
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("-1000")  # inherited by gdb
    except OSError:
        pass
def state():
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
stopped_before = state() in ("t", "T")  # the user's stop, not gdb's: never resumed by us
env = dict(os.environ, LC_ALL="C", LANG="C")
gdb = subprocess.Popen(
    cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
)
try:
    exited_fd = os.pidfd_open(gdb.pid)  # readable the moment gdb exits (our child: no pid reuse)
except (AttributeError, OSError):
    exited_fd = None
def gdb_exits(wait):
    if exited_fd is not None:
        select.select([exited_fd], [], [], wait)
    else:
        try:
            gdb.wait(wait)
        except subprocess.TimeoutExpired:
            pass
    return gdb.poll() is not None
hit = threading.Event()
brk = []  # (address, original byte)
out = sys.stdout.buffer
def say(data):
    try:
        out.write(data)
        out.flush()
    except OSError:  # dlmon is gone: go on bounding gdb's wait
        pass
def tracer():
    try:
        with open("/proc/%d/status" % pid) as fh:
            for line in fh:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return -1
    return -1
def ppid(p):
    try:
        with open("/proc/%d/stat" % p) as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1
ours = set()  # the tracers seen that were the debugger or its child (lldb's lldb-server)
def traced_by_us():
    t = tracer()
    if t > 0 and (t == gdb.pid or ppid(t) == gdb.pid):
        ours.add(t)
        return True
    return False
def byte_of(path, offset, inode):
    # the mapped file itself (map_files, root), else its path as the target sees it: a regular
    # file with the mapping's inode, opened without following a link or blocking on a FIFO
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (inode and st.st_ino != inode):
            return b""
        return os.pread(fd, 1, offset)
    except OSError:
        return b""
    finally:
        os.close(fd)
def original(addr):
    try:
        with open("/proc/%d/maps" % pid) as fh:
            for line in fh:
                f = line.split(None, 5)
                lo, hi = (int(x, 16) for x in f[0].split("-"))
                if lo <= addr < hi and len(f) == 6:
                    offset, inode = addr - lo + int(f[2], 16), int(f[4])
                    name = f[5].strip()
                    for path in ("/proc/%d/map_files/%s" % (pid, f[0]), "/proc/%d/root%s" % (pid, name)):
                        byte = byte_of(path, offset, inode)
                        if len(byte) == 1:
                            return byte
                    return b""
    except (OSError, ValueError):
        pass
    return b""
def read():
    for raw in gdb.stdout:
        if hit_re.search(raw):
            hit.set()
        m = break_re.search(raw)
        if m and not brk:
            addr = int(m.group(1), 16)
            brk.append((addr, original(addr)))
        say(raw)
def take_out():
    # right after gdb's death, while its int3 may still be live: only into an untraced target
    # (not one a second inject has attached to since) and only over gdb's 0xcc
    if not brk or len(brk[0][1]) != 1 or brk[0][1] == b"\xcc":
        return "; its breakpoint's original byte could not be read"
    addr, byte = brk[0]
    gone_by = time.monotonic() + 2.0  # lldb-server, the debugger's child, lets go once it sees lldb gone
    traced = tracer()
    while traced in ours and time.monotonic() < gone_by:
        time.sleep(0.01)
        traced = tracer()
    if traced < 0:
        return ""  # the target is gone
    if traced:
        return "; its breakpoint was left: process %d is traced again" % pid
    try:
        with open("/proc/%d/mem" % pid, "r+b", buffering=0) as mem:
            mem.seek(addr)
            if mem.read(1) != b"\xcc":
                return ""
            mem.seek(addr)
            mem.write(byte)
            return "; its breakpoint was taken out of the target's code"
    except OSError as exc:
        return "; its breakpoint could not be taken out: %s" % exc
def live_int3():
    try:
        with open("/proc/%d/mem" % pid, "rb", buffering=0) as mem:
            mem.seek(brk[0][0])
            return mem.read(1) == b"\xcc" and brk[0][1] not in (b"", b"\xcc")
    except OSError:
        return False
say(("%s %d\n" % (PIDLINE, gdb.pid)).encode())
reader = threading.Thread(target=read, daemon=True)
reader.start()
deadline = time.monotonic() + timeout
while True:
    attached = traced_by_us()
    if not hit.is_set() and time.monotonic() >= deadline and attached:
        try:
            os.kill(pid, signal.SIGURG)
        except ProcessLookupError:
            pass
        if gdb_exits(resend):
            break
    elif gdb_exits(None if hit.is_set() else 0.02):
        break
what = None
if gdb.returncode < 0 and not hit.is_set():
    what = "%s died of signal %d before the breakpoint was hit" % (NAME, -gdb.returncode)
    reader.join(1.0)  # gdb's last lines (its "Breakpoint 1 at") may still be in the pipe
    what += take_out()
    if not stopped_before and state() in ("t", "T"):
        try:
            os.kill(pid, signal.SIGCONT)  # gdb's SIGSTOP of the attach, left behind by its death
        except OSError:
            pass
elif not hit.is_set():
    # lldb exits 0 when its lldb-server, the real tracer, is killed: the kernel let the target go
    # with the int3 still in its code. (gdb, its own tracer, takes its breakpoint out as it exits.)
    reader.join(1.0)
    if brk and live_int3():
        what = "%s lost the target before the breakpoint was hit" % NAME + take_out()
        if not stopped_before and state() in ("t", "T"):
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
reader.join(2.0)
if what is not None and not hit.is_set():  # a hit read only now: gdb died in the call, not before
    say(("%s %s\n" % (KILLED, what)).encode())
"""


@dataclass(frozen=True)
class Debugger:
    """What the watchdog and run_script need of a debugger: its name, and how its output says
    where the breakpoint is (group 1: the hex address) and that it was hit."""

    name: str
    breakpoint_line: str
    hit_line: str


GDB = Debugger("gdb", r"^Breakpoint 1 at 0x([0-9a-f]+)", rf"^{HIT}\s*$")


def _read(proc: subprocess.Popen[bytes], run: GdbRun, gdb_pid: list[int], hit_line: re.Pattern[str]) -> None:
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        if line.startswith(GDB_PID + " ") and not gdb_pid:
            gdb_pid.append(int(line.split()[1]))
            continue
        run.output.append(line)
        if hit_line.search(line):
            run.hit.set()


def watchdog_command(pid: int, timeout: float, debugger: Debugger, argv: list[str]) -> list[str]:
    cmd = [sys.executable, "-I", "-S", "-c", WATCHDOG, str(pid), repr(timeout), repr(RESEND_S)]
    cmd += [debugger.hit_line, GDB_PID, GDB_KILLED, debugger.breakpoint_line, debugger.name]
    return [*cmd, *argv]


def run_code(
    pid: int, code: str, timeout: float, libpython: str | None, gdb: str, readnever: bool = True
) -> GdbRun:
    """Run ``code`` in ``pid`` at its next PyEval_SaveThread; gdb's output once it has detached.

    Raises GdbError when gdb had to be left running. gdb is never signalled: a gdb killed in the
    middle of the call leaves the target's thread in a dummy frame (it dies of SIGSEGV).
    """
    return run_script(
        pid, script(code), ".gdb", timeout, GDB, lambda path: command(gdb, pid, path, libpython, readnever)
    )


def run_script(
    pid: int,
    text: str,
    suffix: str,
    timeout: float,
    debugger: Debugger,
    argv: Callable[[str], list[str]],
) -> GdbRun:
    """Run the debugger ``argv(script path)`` under the watchdog, ``text`` its script; its output."""
    fd, script_path = tempfile.mkstemp(prefix="dlmon-inject-", suffix=suffix)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    run = GdbRun()
    gdb_pid: list[int] = []
    try:
        proc = subprocess.Popen(
            watchdog_command(pid, timeout, debugger, argv(script_path)),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the user's Ctrl-C to dlmon must not interrupt gdb mid-call
        )
        hit_line = re.compile(debugger.hit_line)
        reader = threading.Thread(target=_read, args=(proc, run, gdb_pid, hit_line), daemon=True)
        reader.start()
        _wait(proc, pid, run, timeout, debugger.name)
        reader.join(2.0)
    finally:
        os.unlink(script_path)  # the debugger read it at its start
    return run


def _wait(proc: subprocess.Popen[bytes], pid: int, run: GdbRun, timeout: float, name: str = "gdb") -> None:
    """Wait for the watchdog, which bounds the debugger's wait before the hit; never signal anything."""
    bound = timeout + EXIT_GRACE_S + 10.0  # the debugger's start and attach, then SIGURG's effect
    deadline = time.monotonic() + bound
    while proc.poll() is None:
        if run.hit.is_set():
            try:
                proc.wait(CALL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise GdbError(
                    f"the load is still running in process {pid} after {CALL_TIMEOUT_S:.0f} s; "
                    f"{name} (watchdog pid {proc.pid}) is left to finish it: do not kill {name}, "
                    "that would kill the training"
                ) from None
            return
        if time.monotonic() >= deadline:
            raise GdbError(
                f"{name} (watchdog pid {proc.pid}) did not detach from process {pid} within {bound:.0f} s; "
                f"it is left running and will detach at the next SIGURG or breakpoint: do not kill {name}, "
                "that could leave a breakpoint in the training"
            )
        run.hit.wait(0.05)


PTRACE_REFUSED = ("ptrace: Operation not permitted", "Could not attach to process")


def too_old_for_readnever(text: str) -> bool:
    """gdb before 8.2 stops at once on the unknown option, before attaching."""
    return "readnever" in text and ("unrecognized option" in text or "unknown option" in text)


EXITED = re.compile(r"^\[Inferior 1 \(process \d+\) exited")
RECEIVED = re.compile(r"^(?:Program|Thread \d+ .*) received signal (SIG\w+)")


def outcome(text: str) -> tuple[str, str]:
    """(kind, detail) from gdb's output: ok, raised, missed, exited, crashed, killed, refused or failed.

    gdb runs with LC_ALL=C; a multi-threaded target's signal reads ``Thread 2 "name" received
    signal SIGSEGV``, a thread's exit ``[Thread ... exited]`` (not the process's).
    """
    lines = text.splitlines()
    for line in lines:
        if line.startswith("$1 = "):
            value = line.removeprefix("$1 = ").strip()
            return ("ok", value) if value == "0" else ("raised", value)
    for line in lines:
        if line.startswith(GDB_KILLED + " "):
            return "killed", line.removeprefix(GDB_KILLED + " ")
    if any(s in text for s in PTRACE_REFUSED):
        return "refused", ""
    crash = []
    for line in lines:
        m = RECEIVED.match(line)
        if m and m.group(1) != "SIGURG":
            crash.append(line[m.start(1) :].rstrip("."))
    if any(EXITED.match(ln) for ln in lines) or any(ln.startswith("ptrace: No such process") for ln in lines):
        return "exited", crash[0] if crash else ""
    if crash:  # the target's own fault, passed on to it at the detach as if gdb had not been there
        return "crashed", crash[0]
    if any(ln.strip() == MISSED for ln in lines):
        return "missed", ""
    rest = [ln for ln in lines if ln.strip() and "auto-load" not in ln]
    return "failed", (rest[-1] if rest else "gdb printed nothing")
