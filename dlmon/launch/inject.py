"""``dlmon attach PID --inject``: load the agent into a running Python with ``sys.remote_exec``.

PEP 768 (Python 3.14) lets a debugger-like tool ask another CPython process to run a script at
its next safe point. Both dlmon's Python and the target's must be 3.14+, of the same version,
and the caller must be allowed to ptrace the target.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import dlmon
from dlmon.collect.agent_client import AgentClient

INJECT_TIMEOUT_S = 10.0


class InjectError(Exception):
    """Why the agent could not be injected, in one sentence."""


def unsupported_reason(version: tuple[int, int] = sys.version_info[:2]) -> str | None:
    if version >= (3, 14):
        return None
    running = f"{version[0]}.{version[1]}"
    return (
        f"--inject needs Python 3.14 or newer (sys.remote_exec); dlmon runs on Python {running}. "
        "Start the training with `dlmon run`, or add `import dlmon.agent; dlmon.agent.start()` to it"
    )


def inject(pid: int, timeout: float = INJECT_TIMEOUT_S) -> str:
    """Run ``dlmon.agent.start()`` inside ``pid``; returns the agent's socket path once it serves."""
    reason = unsupported_reason()
    if reason:
        raise InjectError(reason)
    remote_exec = getattr(sys, "remote_exec", None)
    if remote_exec is None:
        raise InjectError("this Python was built without sys.remote_exec")
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(dlmon.__file__)))
    fd, script = tempfile.mkstemp(prefix="dlmon-inject-", suffix=".py")
    with os.fdopen(fd, "w") as fh:
        fh.write(
            f"import sys\nsys.path.append({package_parent!r})\nimport dlmon.agent\ndlmon.agent.start()\n"
        )
    os.chmod(script, 0o644)
    try:
        remote_exec(pid, script)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            path = AgentClient.find_socket(pid)  # in the target's directories, not ours
            if path is not None:
                return path
            time.sleep(0.1)
        raise InjectError(
            f"process {pid} did not start the agent within {timeout:.0f} s "
            "(is it a Python 3.14 process that reaches a safe point, e.g. not blocked in C code?)"
        )
    except (OSError, RuntimeError, ValueError) as exc:
        raise InjectError(f"cannot inject into process {pid}: {exc}") from exc
    finally:
        # the target reads the file at its next safe point; wait for the socket (above) first
        os.unlink(script)
