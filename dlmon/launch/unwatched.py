"""Trainings that ``dlmon run`` started and that outlived their dashboard.

``dlmon run`` notes each training it launches with a dashboard in the user's private dlmon
directory (``$TMPDIR/dlmon-UID/jobs/PID.json``: pid, its start time, the command, the log, and
the dlmon watching it). The note goes when dlmon sees the training end or stops it. If the
dashboard goes away and the training does not (the terminal closed, dlmon killed, or "leave it
running"), the note stays, and the next ``dlmon attach``, ``run`` or ``demo`` says where the
training is: pid, command and ``dlmon attach PID``. A note whose process is gone, or whose pid
now belongs to another process (a different start time), is dropped silently.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass

from dlmon.collect.procfs import start_ticks
from dlmon.launch.runner import LogDirError, private_dir, user_dir


@dataclass(frozen=True)
class JobNote:
    pid: int
    started: int  # /proc/PID/stat field 22 (start time in clock ticks): tells a reused pid apart
    command: str
    log_path: str | None
    watcher_pid: int | None  # the dlmon showing its dashboard; None once it went away
    watcher_started: int | None
    left_at: float | None = None  # when the dashboard went away, if dlmon could say
    why: str = ""  # how it went away ("the terminal closed (SIGHUP)", "you left it running")


def _alive(pid: int | None, started: int | None) -> bool:
    return pid is not None and started is not None and start_ticks(pid) == started


def jobs_dir() -> str:
    path = os.path.join(user_dir(), "jobs")
    private_dir(path)
    return path


def _path(pid: int) -> str:
    return os.path.join(jobs_dir(), f"{pid}.json")


def write(note: JobNote) -> None:
    """Best effort: a note that cannot be written costs a hint, never the watch."""
    with contextlib.suppress(OSError, LogDirError):
        path = _path(note.pid)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(note.__dict__, fh)
        os.replace(tmp, path)


def note_launch(pid: int, command: str, log_path: str | None) -> JobNote | None:
    started = start_ticks(pid)
    if started is None:
        return None
    note = JobNote(pid, started, command, log_path, os.getpid(), start_ticks(os.getpid()))
    write(note)
    return note


def note_left(note: JobNote, why: str) -> JobNote:
    """The dashboard goes away, the training stays: the note now says so."""
    left = JobNote(note.pid, note.started, note.command, note.log_path, None, None, time.time(), why)
    write(left)
    return left


def forget(pid: int) -> None:
    with contextlib.suppress(OSError, LogDirError):
        os.unlink(_path(pid))


def _read(path: str) -> JobNote | None:
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
        note = JobNote(**raw) if isinstance(raw, dict) else None
    except (OSError, ValueError, TypeError):
        return None
    return note if note is not None and _well_typed(note) else None


def _is_int(value: object, optional: bool = False) -> bool:
    return (value is None and optional) or (isinstance(value, int) and not isinstance(value, bool))


def _well_typed(note: JobNote) -> bool:
    """A note another version (or a hand) wrote wrong is dropped, not a traceback in every command."""
    return (
        _is_int(note.pid)
        and _is_int(note.started)
        and isinstance(note.command, str)
        and (note.log_path is None or isinstance(note.log_path, str))
        and _is_int(note.watcher_pid, optional=True)
        and _is_int(note.watcher_started, optional=True)
        and (
            note.left_at is None
            or (isinstance(note.left_at, (int, float)) and not isinstance(note.left_at, bool))
        )
        and isinstance(note.why, str)
    )


def unwatched() -> list[JobNote]:
    """The noted trainings still running with no dlmon dashboard on them; stale notes go."""
    try:
        directory = jobs_dir()
        names = sorted(os.listdir(directory))
    except (OSError, LogDirError):
        return []
    found = []
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        note = _read(path)
        if note is None or not _alive(note.pid, note.started):
            with contextlib.suppress(OSError):
                os.unlink(path)
            continue
        if not _alive(note.watcher_pid, note.watcher_started):
            found.append(note)
    return found


def describe(note: JobNote) -> str:
    """How to find the training again, in one line."""
    when = f" at {time.strftime('%H:%M:%S', time.localtime(note.left_at))}" if note.left_at else ""
    why = f" ({note.why})" if note.why else ""
    log = f"; log: {note.log_path}" if note.log_path else ""
    return (
        f"a training started by dlmon run is still running without its dashboard{why}{when}: "
        f"pid {note.pid} ({note.command[:80]}){log}; watch it again with: dlmon attach {note.pid}"
    )


def remind(except_pid: int | None = None) -> list[str]:
    """The lines to print at the start of a dlmon command; ``except_pid`` (being attached to now)
    is found again, so its note goes."""
    lines = []
    for note in unwatched():
        if note.pid == except_pid:
            forget(note.pid)
        else:
            lines.append(describe(note))
    return lines
