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
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from dlmon.agent.sitecustomize_hook import env_with_agent
from dlmon.launch.limits import limit_was_raised, restore_open_files_limit

# Ctrl-C once: SIGINT (the script's KeyboardInterrupt, a clean stop); again: SIGTERM; again: SIGKILL.
ESCALATION = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)


class LogDirError(OSError):
    """The training log directory cannot be used safely; the message names it and says why."""


def private_dir(path: str) -> None:
    """Create ``path`` 0700 if missing; refuse it unless it is a real directory (not a link),
    owned by this user, that nobody else can read or write: another user's pre-created
    directory must never receive (and expose) this user's training output."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise LogDirError(f"cannot create the training log directory {path}: {exc.strerror or exc}") from exc
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise LogDirError(f"cannot use the training log directory {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise LogDirError(f"cannot use the training log directory {path}: it is not a directory")
    if info.st_uid != os.getuid():
        raise LogDirError(
            f"refusing the training log directory {path}: owned by uid {info.st_uid}, not by you "
            f"(uid {os.getuid()}); remove it or set TMPDIR elsewhere"
        )
    if info.st_mode & 0o077:
        raise LogDirError(
            f"refusing the training log directory {path}: mode {stat.S_IMODE(info.st_mode):04o} lets "
            f"other users in; chmod 700 it or set TMPDIR elsewhere"
        )


def user_dir() -> str:
    """This user's dlmon directory (0700, ours, checked); raises :class:`LogDirError`."""
    base = os.path.join(tempfile.gettempdir(), f"dlmon-{os.getuid()}")
    private_dir(base)
    return base


def log_dir() -> str:
    """A per-user directory (0700, ours, checked) for training logs; raises :class:`LogDirError`."""
    path = os.path.join(user_dir(), "logs")
    private_dir(path)
    return path


def _open_log(path: str) -> int:
    """A new log file, 0600, never following a link or reusing a file someone placed there.
    Append mode, so a line dlmon adds later (:func:`note_in_log`) is not overwritten by the
    training's next write at its own offset."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except OSError as exc:
        raise LogDirError(f"cannot create the training log {path}: {exc.strerror or exc}") from exc


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
    job_token: str | None = None  # the value of JOB_ENV in the training's environment (its own)
    lifeline: int | None = None  # dlmon's end of the pipe whose closing stops the training (the demo)

    def release(self) -> None:
        """The user leaves the training running: cutting the lifeline must no longer stop it."""
        if self.lifeline is not None:
            from dlmon.launch.lifeline import release

            release(self.lifeline)
            self.lifeline = None

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
        """Stop the training and whatever of its process group outlives it: SIGINT, then SIGTERM,
        then SIGKILL, each after ``grace_s``."""
        for sig in ESCALATION:
            if not self._running():
                break
            self._signal(sig)
            deadline = time.monotonic() + grace_s
            while self._running() and time.monotonic() < deadline:
                time.sleep(0.05)
        return exit_status(self.popen.wait())

    def _running(self) -> bool:
        """The leader, or any process left in its group (a child that outlived it)."""
        if self.popen.poll() is None:
            return True
        try:
            os.killpg(self.popen.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

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


JOB_ENV = "DLMON_JOB"  # a random token per launch, in the training's environment


def note_in_log(log_path: str | None, line: str) -> None:
    """Append one ``dlmon:`` line to the training's log (best effort: the log may be gone)."""
    if not log_path:
        return
    with contextlib.suppress(OSError):
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, f"dlmon: {line}\n".encode())
        finally:
            os.close(fd)


def launch(
    command: list[str],
    *,
    to_log: bool,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    lifeline: bool = False,
) -> Training:
    """Start ``command`` with the agent (in ``env``, default this process's environment); raises
    FileNotFoundError/PermissionError for a bad command.

    ``lifeline`` (the demo): the training gets, in ``$DLMON_LIFELINE_FD``, the read end of a pipe
    whose write end dlmon holds, so it can stop when dlmon goes away (see lifeline.py)."""
    log_path: str | None = None
    if to_log:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = log_name(command)
        log_path = os.path.join(log_dir(), f"{stamp}-{name}-{os.getpid()}.log")
        out: int | None = _open_log(log_path)
    else:
        out = None
    token = os.urandom(8).hex()
    pipe: tuple[int, int] | None = None
    child_env = env_with_agent(env)
    child_env[JOB_ENV] = token  # inherited by all it starts: a daemon that leaves its session is still known
    if lifeline:
        from dlmon.launch.lifeline import ENV, open_lifeline

        pipe = open_lifeline()
        child_env[ENV] = str(pipe[0])
    try:
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL if to_log else None,
            stdout=out,
            stderr=subprocess.STDOUT if to_log else None,
            start_new_session=True,
            env=child_env,
            cwd=cwd,
            # dlmon's raised open-files limit is dlmon's: the training keeps the one it was given
            preexec_fn=restore_open_files_limit if limit_was_raised() else None,
            pass_fds=pipe[:1] if pipe else (),
        )
    except BaseException:
        if pipe:
            os.close(pipe[1])
        raise
    finally:
        if out is not None:
            os.close(out)
        if pipe:
            os.close(pipe[0])
    return Training(popen, command, log_path, job_token=token, lifeline=pipe[1] if pipe else None)
