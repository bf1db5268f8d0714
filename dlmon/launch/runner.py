"""Launching the training for ``dlmon run``.

The training runs in its own session and process group with the agent on its PYTHONPATH. With
the dashboard, its output goes to a log file, so it never writes over the TUI and never dies of
SIGPIPE or SIGHUP when the dashboard or the SSH connection goes away; it also survives dlmon
being SIGKILLed. Headless, its output passes straight through (inherited fds, no pipe via dlmon).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from dlmon.agent.sitecustomize_hook import env_with_agent

# Ctrl-C once: SIGINT (the script's KeyboardInterrupt, a clean stop); again: SIGTERM; again: SIGKILL.
ESCALATION = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)


def log_dir() -> str:
    """A per-user directory (0700) for training logs."""
    path = os.path.join(tempfile.gettempdir(), f"dlmon-{os.getuid()}", "logs")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def command_for(script_or_cmd: list[str], is_command: bool) -> list[str]:
    """``dlmon run SCRIPT ARGS`` uses this interpreter; ``dlmon run -- CMD ARGS`` runs CMD as is."""
    return list(script_or_cmd) if is_command else [sys.executable, *script_or_cmd]


def exit_status(returncode: int) -> int:
    """The shell's convention: a training killed by signal N makes dlmon exit 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Training:
    popen: subprocess.Popen[bytes]
    command: list[str]
    log_path: str | None
    _interrupts: int = field(default=0)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        """The training's exit status once it ended (reaping it), else None."""
        code = self.popen.poll()
        return None if code is None else exit_status(code)

    def interrupt(self) -> signal.Signals:
        """Forward one Ctrl-C: SIGINT the first time, then SIGTERM, then SIGKILL."""
        sig = ESCALATION[min(self._interrupts, len(ESCALATION) - 1)]
        self._interrupts += 1
        self._signal(sig)
        return sig

    def stop(self, grace_s: float = 10.0) -> int:
        """Stop the training: SIGINT, then SIGTERM, then SIGKILL, each after ``grace_s``."""
        for sig in ESCALATION:
            if self.popen.poll() is not None:
                break
            self._signal(sig)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                continue
        return exit_status(self.popen.wait())

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)  # the whole group: workers and ranks too


def log_name(command: list[str]) -> str:
    """What the log file is named after: the script, the ``-m`` module, else the program."""
    args = command[1:] if os.path.basename(command[0]).startswith("python") else []
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            return args[i + 1]
        if not arg.startswith("-"):
            return os.path.basename(arg)
    return os.path.basename(command[0])


def launch(command: list[str], *, to_log: bool, cwd: str | None = None) -> Training:
    """Start ``command`` with the agent; raises FileNotFoundError/PermissionError for a bad command."""
    log_path: str | None = None
    if to_log:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = log_name(command)
        log_path = os.path.join(log_dir(), f"{stamp}-{name}-{os.getpid()}.log")
        log = open(log_path, "wb")  # noqa: SIM115 - handed to the child, closed below
        out: int | object = log
    else:
        out = None
    try:
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL if to_log else None,
            stdout=out,  # type: ignore[arg-type]
            stderr=subprocess.STDOUT if to_log else None,
            start_new_session=True,
            env=env_with_agent(),
            cwd=cwd,
        )
    finally:
        if to_log:
            log.close()
    return Training(popen, command, log_path)
