"""Loading the agent into a watched job: first (``--inject`` of attach, record, advise, export),
or on request from the dashboard of a job that has none (``dlmon attach PID``).

The offer is made here, where loading is allowed, and handed to the UI through the live source
(:class:`dlmon.flow.sources.AgentLoader`): the UI shows :attr:`AgentOffer.offer` and calls
:meth:`AgentOffer.load` on a thread of its own when the user presses ``i``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dlmon.collect.agent_client import AgentClient
from dlmon.collect.target_python import ProcAccessError, process_state, read_target
from dlmon.launch.console import Failed, echo
from dlmon.launch.inject import InjectError, find_debugger, inject, unsupported_reason
from dlmon.model.format import DEAD_STATES

# docs/performance.md: the target's longest pause while gdb loads the agent, on an idle machine
# (median 55 ms, max 68; 83 to 121 ms median on a busy one)
GDB_PAUSE = "~60 ms pause"
# lldb, where gdb is missing: it reads every library's symbols and compiles the call with clang
# (docs/performance.md: median 3.4 s at load 2.5, 5.9 s at load 5.7)
LLDB_PAUSE = "~3.5 s pause"


@dataclass(frozen=True)
class AgentOffer:
    pid: int
    how: str  # "gdb", "lldb" or "sys.remote_exec"
    failed: str | None = None  # why --inject's load failed, before the dashboard opened

    @property
    def offer(self) -> str:
        if self.failed:
            return f"{self.failed} (press i to try again)"
        how = {"gdb": f"gdb; {GDB_PAUSE}", "lldb": f"lldb; {LLDB_PAUSE}"}.get(self.how, self.how)
        return f"no agent in this job: press i to load the agent into pid {self.pid} ({how})"

    def load(self) -> str | None:
        try:
            inject(self.pid)
        except InjectError as exc:
            return str(exc)
        except Exception as exc:  # the dashboard goes on with the outside figures
            return f"cannot inject into process {self.pid}: {type(exc).__name__}: {exc}"
        return None


def offer_for(pid: int, failed: str | None = None) -> AgentOffer | None:
    """An offer for ``pid``, or None when it has an agent already or a load cannot work here (not
    CPython, an unsupported version, no gdb, another user's process): the hint stays then."""
    if AgentClient.find_socket(pid) is not None:
        return None
    try:
        target = read_target(pid)
    except (ProcessLookupError, ProcAccessError, OSError):
        return None
    debugger = find_debugger()
    if unsupported_reason(target, pid, gdb=debugger) is not None or target.version is None:
        return None
    if target.version >= (3, 14):
        return AgentOffer(pid, "sys.remote_exec", failed)
    return AgentOffer(pid, "lldb" if debugger and "lldb" in os.path.basename(debugger) else "gdb", failed)


def load_first(pid: int) -> str | None:
    """``--inject``: load the agent before the watch opens (a no-op where it serves already).

    When it cannot, one line with the reason and the fix, and the watch goes on with the outside
    figures: that line is returned (None once the agent serves). :class:`Failed` only when there is
    no process left to watch."""
    try:
        inject(pid)
    except InjectError as exc:
        state, _ = process_state(pid)
        if not state or state in DEAD_STATES:
            raise Failed(str(exc)) from None
        echo(f"the agent was not loaded: {exc}; watching with the outside figures")
        return str(exc)
    return None
