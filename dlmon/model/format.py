"""Human-readable figures, shared by the one-line output and the dashboard (no UI imports)."""

from __future__ import annotations

import signal
import time

from dlmon.model import Snapshot

DEAD_STATES = ("Z", "X")  # a zombie or dead process: StatFields.state, ProcessSample.state

# How a stack was taken, where the way matters to its reader (ProcessStack.source); the agent's
# and the worker's own faulthandler dump need no word.
STACK_TAKEN = {
    "py-spy": "stack read from outside by py-spy --nonblocking (may be torn)",
    "gdb": "stack read from outside by gdb py-bt (the worker was paused for the read)",
    "none": (
        "no stack: this worker was forked before the agent was loaded; "
        "pip install py-spy to read it from outside"
    ),
}

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(value: float | None, missing: str = "n/a") -> str:
    if value is None:
        return missing
    size = float(value)
    for unit in _UNITS:
        if abs(size) < 1024 or unit == _UNITS[-1]:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def human_rate(bytes_per_s: float | None, missing: str = "n/a") -> str:
    return missing if bytes_per_s is None else f"{bytes_per_s / 1e6:.1f} MB/s"


def percent(value: float | None, missing: str = "n/a") -> str:
    return missing if value is None else f"{value:.0f}%"


def fd_limit_note(count: int) -> str:
    """Past its share of RLIMIT_NOFILE the sampler reads processes by path: slower, still right."""
    return f"fd limit: {count} process{'es' if count != 1 else ''} read without held fds"


def rotation_note(s: Snapshot) -> str | None:
    """A tree too big for the sampler's budget: how stale a worker's row may be."""
    if s.rotation_ticks <= 1:
        return None
    every = f"every {s.rotation_ticks} ticks"
    if s.interval_s:
        every += f" (~{round(s.rotation_ticks * s.interval_s, 1):g} s)"  # ~0.3 s at --interval 0.1
    return f"large tree: workers read {every} to stay in dlmon's 1% CPU budget"


def target_stopped(s: Snapshot) -> bool:
    """The target is alive but stopped (SIGSTOP, ^Z, a debugger): state T or t, not dead."""
    return s.target.alive and any(p.pid == s.target.pid and p.state in ("T", "t") for p in s.processes)


def children_left(s: Snapshot) -> bool:
    """A process of the job other than the target is still alive (not a zombie): after the
    target's death, its orphaned workers linger, holding memory, and are worth watching."""
    return any(p.pid != s.target.pid and p.state not in DEAD_STATES for p in s.processes)


SIGKILL = int(signal.SIGKILL)  # what the OOM killer sends: the STATE cell says "killed"


def signal_name(number: int) -> str:
    """The name Python's signal module gives ``number`` (SIGSEGV for 11: Linux numbers, named as
    the agent names them), or "signal N" for one it has no name for (a real-time signal)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def one_line(s: Snapshot) -> str:
    """What ``dlmon attach`` prints per tick without the dashboard."""
    workers = s.workers()
    cpu = [p.cpu_percent for p in s.processes if p.cpu_percent is not None]
    reads = [p.read_bytes_per_s for p in s.processes if p.read_bytes_per_s is not None]
    m = s.memory
    pss = human_bytes(m.pss_sum_bytes)
    if m.pss_missing and m.pss_sum_bytes is not None:
        pss += f" (+{m.pss_missing} unread)"
    parts = [
        time.strftime("%H:%M:%S", time.localtime(s.time)),
        f"pid {s.target.pid}"
        + ("" if s.target.alive else " EXITED")
        + (" STOPPED" if target_stopped(s) else ""),
        f"procs {len(s.processes)} ({len(workers)} workers)",
        f"PSS {pss}",
        f"RSS sum {human_bytes(m.rss_sum_bytes)}",
        f"avail {human_bytes(m.available_bytes)}",
        f"cpu {percent(sum(cpu) if cpu else None)}",
        f"read {human_rate(sum(reads) if reads else None)}",
    ]
    if m.cgroup_limit_bytes is not None:
        if m.cgroup_working_set_bytes is not None:
            cg = f"cgroup ws {human_bytes(m.cgroup_working_set_bytes)}/{human_bytes(m.cgroup_limit_bytes)}"
            cg += f" cache {human_bytes(m.cgroup_cache_bytes)}"
        else:
            cg = f"cgroup {human_bytes(m.cgroup_current_bytes)}/{human_bytes(m.cgroup_limit_bytes)}"
        parts.insert(6, cg)
    zombies = sum(1 for p in s.processes if p.state == "Z")
    if zombies:
        parts.append(f"ZOMBIES {zombies}")
    if s.processes_without_held_fds:
        parts.append(fd_limit_note(s.processes_without_held_fds))
    rotation = rotation_note(s)
    if rotation:
        parts.append(rotation)
    return "  ".join(parts)
