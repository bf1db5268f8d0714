"""``dlmon attach PID --inject``: load the agent into a running CPython.

Python 3.14+ targets: ``sys.remote_exec`` (PEP 768), which needs dlmon itself on the same 3.14+.
Python 3.9 to 3.13 targets: gdb (dlmon.launch.gdb_inject), or lldb where gdb is missing
(dlmon.launch.lldb_inject, the same protocol and watchdog). Either way the target imports the agent
from a private staged copy (dlmon.launch.agent_stage), and the caller must be allowed to ptrace it.
"""

from __future__ import annotations

import os
import stat
import sys
import time

from dlmon.collect.agent_client import AgentClient
from dlmon.collect.target_python import (
    ProcAccessError,
    TargetPython,
    process_state,
    read_target,
    replaced_library,
)
from dlmon.launch import gdb_inject, lldb_inject
from dlmon.launch.agent_stage import Stage, stage
from dlmon.model.format import DEAD_STATES

INJECT_TIMEOUT_S = 10.0
SOCKET_WAIT_S = 5.0  # after the load said it serves
GDB_VERSIONS = ((3, 9), (3, 13))
YAMA = "/proc/sys/kernel/yama/ptrace_scope"
HOW_ELSE = "Start the training with `dlmon run`, or add `import dlmon.agent; dlmon.agent.start()` to it"


class InjectError(Exception):
    """Why the agent could not be injected, in one sentence."""


def unsupported_reason(
    target: TargetPython,
    pid: int,
    ours: tuple[int, int] = sys.version_info[:2],
    gdb: str | None = None,
) -> str | None:
    """Why ``--inject`` cannot work on this target with these tools, or None."""
    if target.other:
        return f"process {pid} runs {target.other}, not CPython: --inject loads into CPython only. {HOW_ELSE}"
    if target.version is None:
        return (
            f"process {pid} does not look like CPython (no libpython3.X, no python3.X executable). {HOW_ELSE}"
        )
    running = f"{target.version[0]}.{target.version[1]}"
    if target.free_threaded:
        return f"process {pid} runs free-threaded Python {running}t, which --inject cannot load. {HOW_ELSE}"
    if target.version >= (3, 14):
        if ours != target.version or not hasattr(sys, "remote_exec"):
            return (
                f"process {pid} runs Python {running}: --inject uses sys.remote_exec there, which needs "
                f"dlmon on Python {running} too (it runs on {ours[0]}.{ours[1]}). {HOW_ELSE}"
            )
        return None
    if target.version < GDB_VERSIONS[0]:
        return f"process {pid} runs Python {running}; --inject needs 3.9 or newer. {HOW_ELSE}"
    if gdb is None:
        return (
            f"--inject into Python {running} (process {pid}) needs a debugger: "
            "install gdb (apt-get install gdb (or lldb))"
        )
    return None


def find_debugger() -> str | None:
    """gdb, else lldb: the debugger that loads into Python 3.9 to 3.13."""
    return gdb_inject.find_gdb() or lldb_inject.find_lldb()


def ptrace_refused(pid: int, uid: int) -> str:
    """The one-line cause and fix when the kernel will not let us ptrace ``pid``."""
    me = os.geteuid()
    if me != 0 and uid != me:
        return (
            f"cannot inject into process {pid}: it belongs to another user (uid {uid}); "
            "run dlmon as that user or as root"
        )
    try:
        with open(YAMA) as fh:
            scope = int(fh.read().strip())
    except (OSError, ValueError):
        scope = 0
    if scope == 3:
        return f"cannot inject into process {pid}: ptrace is disabled ({YAMA} is 3; only a reboot lifts it)"
    if scope >= 1 and me != 0:
        return (
            f"cannot inject into process {pid}: Yama allows ptrace of children only ({YAMA} is {scope}); "
            "run dlmon as root, or `sudo sysctl kernel.yama.ptrace_scope=0`"
        )
    return (
        f"cannot inject into process {pid}: the kernel refused ptrace (a container without "
        "CAP_SYS_PTRACE? docker run --cap-add=SYS_PTRACE, or kubectl debug --profile=general)"
    )


def inject(pid: int, timeout: float = INJECT_TIMEOUT_S) -> str:
    """Run ``dlmon.agent.start()`` inside ``pid``; returns the agent's socket path once it serves.

    A no-op (the same socket) when the agent already serves there. Never kills or stops the target.
    """
    try:
        target = read_target(pid)
    except ProcessLookupError:
        raise InjectError(f"cannot inject into process {pid}: no such process") from None
    except ProcAccessError:
        raise InjectError(ptrace_refused(pid, _owner(pid))) from None
    gdb = find_debugger()
    reason = unsupported_reason(target, pid, gdb=gdb)
    if reason:
        raise InjectError(reason)
    state, tracer = process_state(pid)
    if state in DEAD_STATES or not state:
        raise InjectError(f"cannot inject into process {pid}: it has exited")
    if state == "T":
        raise InjectError(
            f"cannot inject into process {pid}: it is stopped (SIGSTOP or Ctrl-Z), so it runs no Python; "
            f"`kill -CONT {pid}` resumes it"
        )
    if tracer:
        raise InjectError(f"cannot inject into process {pid}: process {tracer} (a debugger?) is tracing it")
    if target.version is not None and target.version < (3, 14):
        # the file holding the breakpoint: libpython, or the executable of a static python (whose
        # original byte the watchdog cannot read back once the file is deleted, as another user)
        holder = target.libpython or _exe(pid)
        replaced = replaced_library(pid, holder) if holder else None
        if replaced:  # gdb would put its breakpoint at the new file's address, in other code
            raise InjectError(f"cannot inject into process {pid}: {replaced}; restart it to load the agent")
    staged = _visible_stage(pid, target)
    try:
        if target.version is not None and target.version >= (3, 14):
            try:
                return _by_remote_exec(pid, staged, timeout)
            finally:
                staged.remove()
        assert gdb is not None
        return _by_gdb(pid, target, staged, gdb, timeout)
    except (KeyboardInterrupt, OSError):
        staged.remove()
        raise


def _visible_stage(pid: int, target: TargetPython) -> Stage:
    """A stage the target sees at the path it is given (the same inode through /proc/PID/root).

    A target in another mount namespace (a container, systemd's PrivateTmp) does not see our TMPDIR:
    as root, stage in its /tmp through /proc/PID/root; else refuse, before touching the target.
    """
    try:
        staged = stage(target.uid, target.gid)
    except OSError as exc:
        raise InjectError(f"cannot stage the agent for process {pid}: {exc}") from None
    if _seen_alike(str(staged.root), pid):
        return staged
    staged.remove()
    if os.geteuid() != 0:
        raise InjectError(
            f"cannot inject into process {pid}: it does not see {os.path.dirname(staged.root)} (another "
            "mount namespace: a container, or PrivateTmp); run dlmon as root, or inside its namespace"
        )
    # /proc/PID/root/tmp must be a real directory: an absolute symlink there (/tmp -> /x) resolves
    # against our root, not the target's, and the stage would land on the host at a path the target
    # does not see (or one it controls)
    theirs = f"/proc/{pid}/root/tmp"
    before = _real_directory(theirs)
    if before is None:
        raise InjectError(
            f"cannot inject into process {pid}: its /tmp is not a directory dlmon can stage the agent in "
            "(a symlink, or missing)"
        )
    try:
        staged = stage(target.uid, target.gid, parent=theirs, seen_parent="/tmp")
    except OSError as exc:
        raise InjectError(f"cannot stage the agent in process {pid}'s /tmp: {exc}") from None
    after = _real_directory(theirs)
    if after is not None and _same_inode(after, before) and _is_in(staged.root, after):
        return staged
    staged.remove()
    raise InjectError(f"cannot inject into process {pid}: it sees no directory dlmon can stage the agent in")


def _seen_alike(path: str, pid: int) -> bool:
    """Whether ``pid`` reaches ``path`` as the same file as we do.

    A stat through /proc/PID/root alone is not enough in another mount namespace or root: a
    symlink on the target's side resolves there against *our* root (its /tmp -> /tmp reaches our
    /tmp, while the target itself reaches its own). There, no component may be a link.
    """
    if not _same_inode(path, f"/proc/{pid}/root{path}"):
        return False
    if _same_inode("/proc/self/ns/mnt", f"/proc/{pid}/ns/mnt") and _same_inode("/", f"/proc/{pid}/root"):
        return True  # the same view of the file system
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        try:
            theirs = os.lstat(f"/proc/{pid}/root{os.sep.join(parts[:i])}")
        except OSError:
            return False
        if stat.S_ISLNK(theirs.st_mode):
            return False
    return True


def _real_directory(path: str) -> os.stat_result | None:
    """lstat of ``path`` when it is a directory, not a symlink to one."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISDIR(st.st_mode) else None


def _is_in(root: os.PathLike[str] | str, parent: os.stat_result) -> bool:
    """Whether ``root``'s parent directory, entered without following a link, is ``parent``."""
    try:
        st = os.lstat(os.path.join(root, os.pardir))
    except OSError:
        return False
    return _same_inode(st, parent)


def _same_inode(ours: os.PathLike[str] | str | os.stat_result, theirs: str | os.stat_result) -> bool:
    try:
        a = ours if isinstance(ours, os.stat_result) else os.stat(ours)
        b = theirs if isinstance(theirs, os.stat_result) else os.stat(theirs)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def _owner(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def _by_gdb(pid: int, target: TargetPython, staged: Stage, gdb: str, timeout: float) -> str:
    code = staged.exec_line()
    lldb = os.path.basename(gdb).startswith("lldb")
    name = "lldb" if lldb else "gdb"
    try:
        if lldb:
            run = lldb_inject.run_code(pid, code, timeout, gdb)
        else:
            run = gdb_inject.run_code(pid, code, timeout, target.libpython, gdb)
            if gdb_inject.too_old_for_readnever(run.text()):
                run = gdb_inject.run_code(pid, code, timeout, target.libpython, gdb, readnever=False)
    except gdb_inject.GdbError as exc:  # the debugger left running: the files stay for the load it finishes
        raise InjectError(f"cannot inject into process {pid}: {exc}") from None
    try:
        kind, detail = (lldb_inject.outcome if lldb else gdb_inject.outcome)(run.text())
        status = _await_status(pid, staged, timeout) if kind in ("ok", "raised") else staged.read_status()
    finally:
        staged.remove()
    if kind == "ok":
        return _serving(pid, status, timeout)
    if kind == "raised":
        return _serving(pid, status or "error the loader could not be read in the target", timeout)
    if kind == "killed":
        raise InjectError(f"cannot inject into process {pid}: {detail}")
    if kind == "exited":
        why = f" ({detail.rstrip('.')})" if detail else ""
        raise InjectError(f"process {pid} exited while dlmon was loading the agent into it{why}")
    if kind == "crashed":
        raise InjectError(
            f"process {pid} got {detail} of its own while dlmon was loading the agent; "
            f"{name} passed it on as if it had not been there"
        )
    if kind == "refused":
        tracer = process_state(pid)[1]  # another dlmon or debugger got there first
        if tracer:
            raise InjectError(
                f"cannot inject into process {pid}: process {tracer} (a debugger?) is tracing it"
            )
        raise InjectError(ptrace_refused(pid, target.uid))
    if kind == "execd":
        raise InjectError(
            f"process {pid} replaced its program (exec) while dlmon was loading the agent; nothing "
            "was loaded and it runs on untouched. Try again"
        )
    if kind == "missed":
        raise InjectError(
            f"process {pid} ran no Python within {timeout:.0f} s (every thread waited with the GIL "
            "released: a long sleep, signal.pause(), a blocking read); it was left running untouched. "
            "Try again while it is busy"
        )
    raise InjectError(f"cannot inject into process {pid}: {name} said: {detail}")


def _await_status(pid: int, staged: Stage, timeout: float) -> str | None:
    """The loader's status: it runs in a thread of its own, after gdb has detached."""
    deadline = time.monotonic() + timeout
    while True:
        status = staged.read_status()
        if status is not None or time.monotonic() >= deadline or not os.path.exists(f"/proc/{pid}"):
            return status
        time.sleep(0.02)


def _serving(pid: int, status: str | None, timeout: float) -> str:
    """The socket once the agent serves, after the loader wrote ``status``."""
    if status is None:
        raise InjectError(f"the agent's loader did not run in process {pid} (no status written)")
    if not status.startswith("ok "):
        raise InjectError(f"the agent did not start in process {pid}: {status.removeprefix('error ')}")
    deadline = time.monotonic() + min(timeout, SOCKET_WAIT_S)
    while True:
        path = AgentClient.find_socket(pid)  # in the target's directories, not ours
        if path is not None:
            return path
        if not os.path.exists(f"/proc/{pid}"):
            raise InjectError(f"process {pid} exited right after the agent started in it")
        if time.monotonic() >= deadline:
            raise InjectError(f"the agent in process {pid} serves on {status[3:]}, which dlmon cannot find")
        time.sleep(0.05)


def _by_remote_exec(pid: int, staged: Stage, timeout: float) -> str:
    if _remote_debug_disabled(pid):
        raise InjectError(
            f"process {pid} was started with PYTHON_DISABLE_REMOTE_DEBUG (or -X disable_remote_debug), "
            f"which refuses sys.remote_exec. {HOW_ELSE}"
        )
    remote_exec = getattr(sys, "remote_exec", None)
    if remote_exec is None:
        raise InjectError("this Python was built without sys.remote_exec")
    try:
        remote_exec(pid, str(staged.loader))
    except (OSError, RuntimeError, ValueError) as exc:
        raise InjectError(f"cannot inject into process {pid}: {exc}") from exc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # the target runs the loader at its next safe point
        status = staged.read_status()
        if status is not None:
            return _serving(pid, status, timeout)
        time.sleep(0.05)
    raise InjectError(
        f"process {pid} did not run the agent's loader within {timeout:.0f} s "
        "(is it blocked in C code, or sleeping?)"
    )


def _remote_debug_disabled(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read().split(b"\0")
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    name = b"PYTHON_DISABLE_REMOTE_DEBUG="
    if any(e.startswith(name) and e != name for e in env):
        return True
    return any(a.startswith(b"disable_remote_debug") for a in argv)
