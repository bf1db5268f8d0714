"""Where agents put their sockets: one private directory per user, one socket per process.

Standard library only; nothing here imports more than ``os``/``stat`` at import time.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping

_DIR_NAME = "dlmon"


class SocketDirError(OSError):
    """The socket directory exists but is not safe to use (owner, mode or type is wrong)."""


def _xdg_dir() -> str | None:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and os.path.isdir(xdg):
        return os.path.join(xdg, _DIR_NAME)
    return None


def _tmp_dir() -> str:
    import tempfile  # lazily: tempfile pulls in random and shutil

    return os.path.join(tempfile.gettempdir(), f"{_DIR_NAME}-{os.getuid()}")


def socket_dir() -> str:
    """The directory this process's agent serves in.

    ``$XDG_RUNTIME_DIR/dlmon`` when ``XDG_RUNTIME_DIR`` is set to an existing absolute directory,
    else ``{tempfile.gettempdir()}/dlmon-{uid}``.
    """
    return _xdg_dir() or _tmp_dir()


# sun_path holds 108 bytes with the terminating NUL: a longer path cannot be bound at all
SUN_PATH_MAX = 107


def fits_sun_path(path: str) -> bool:
    return len(os.fsencode(path)) <= SUN_PATH_MAX


def short_socket_dirs() -> tuple[str, ...]:
    """Where an agent serves when :func:`socket_dir` gives a path too long for a socket (a long
    ``TMPDIR``): ``/run/user/<uid>/dlmon`` when that runtime directory exists, then
    ``/tmp/dlmon-<uid>``; both among the places a client looks, and held to the same privacy."""
    uid = os.getuid()
    dirs = []
    if os.path.isdir(f"/run/user/{uid}"):
        dirs.append(f"/run/user/{uid}/{_DIR_NAME}")
    dirs.append(f"/tmp/{_DIR_NAME}-{uid}")
    return tuple(dirs)


def socket_path(pid: int) -> str:
    """The socket an agent in process ``pid`` serves on, as seen from this process's environment."""
    return os.path.join(socket_dir(), f"{int(pid)}.sock")


def _read_proc(pid: int, name: str) -> bytes | None:
    try:
        with open(f"/proc/{int(pid)}/{name}", "rb") as f:
            return f.read(1 << 20)
    except (OSError, ValueError):
        return None


def target_uids(pid: int) -> tuple[int, int] | None:
    """(real uid, effective uid) of process ``pid`` from ``/proc/PID/status``; None if unknown."""
    data = _read_proc(pid, "status")
    if data is None:
        return None
    for line in data.splitlines():
        if line.startswith(b"Uid:"):
            parts = line.split()
            try:
                return int(parts[1]), int(parts[2])
            except (IndexError, ValueError):
                return None
    return None


def target_environ(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` was started with (``/proc/PID/environ``); None when unreadable.

    Only the initial environment: a variable the program sets in ``os.environ`` later is not here.
    """
    data = _read_proc(pid, "environ")
    if data is None:
        return None
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
    return env


def tmp_socket_dir(base: str, uid: int) -> str:
    """The directory an agent of real uid ``uid`` serves in under a temporary directory ``base``."""
    return os.path.join(base, f"{_DIR_NAME}-{int(uid)}")


def environment_socket_dirs(env: Mapping[str, str], uid: int) -> list[str]:
    """The directories an agent with environment ``env`` (its initial one) and real uid ``uid``
    may serve in by that environment, likeliest first, as paths of its own file system: its
    ``XDG_RUNTIME_DIR``, ``/run/user/<uid>``, its ``TMPDIR`` (or ``TEMP``, ``TMP``). ``/tmp`` and
    the like are the caller's to add."""
    dirs: list[str] = []
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        dirs.append(os.path.join(xdg, _DIR_NAME))
    dirs.append(f"/run/user/{int(uid)}/{_DIR_NAME}")
    for var in ("TMPDIR", "TEMP", "TMP"):
        v = env.get(var)
        if v and os.path.isabs(v):
            dirs.append(tmp_socket_dir(v, uid))
            break
    return dirs


def candidate_socket_dirs(pid: int, ruid: int) -> tuple[str, ...]:
    """Every directory an agent in process ``pid`` (real uid ``ruid``) may serve in, likeliest first.

    The target's own ``XDG_RUNTIME_DIR`` (from ``/proc/PID/environ``, when readable), then
    ``/run/user/<uid>/dlmon``, then ``<tempdir>/dlmon-<uid>`` for the target's ``TMPDIR`` and for
    ours, and last, when the target is our own user, the directories of our own environment (the
    target may have set ``XDG_RUNTIME_DIR`` in ``os.environ`` before starting the agent).
    """
    import tempfile  # lazily: tempfile pulls in random and shutil

    dirs: list[str] = []

    def add(d: str | None) -> None:
        if d and os.path.isabs(d):
            d = os.path.normpath(d)
            if d not in dirs:
                dirs.append(d)

    for d in environment_socket_dirs(target_environ(pid) or {}, ruid):
        add(d)
    add(tmp_socket_dir(tempfile.gettempdir(), ruid))
    add(tmp_socket_dir("/tmp", ruid))
    if ruid == os.getuid():
        own = _xdg_dir()
        if own is not None:
            add(own)
        add(_tmp_dir())
    return tuple(dirs)


def candidate_socket_paths(pid: int) -> tuple[str, ...]:
    """Every place an agent of ``pid`` may serve (see :func:`candidate_socket_dirs`)."""
    uids = target_uids(pid)
    if uids is None:
        return ()
    name = f"{int(pid)}.sock"
    return tuple(os.path.join(d, name) for d in candidate_socket_dirs(pid, uids[0]))


def dir_is_private(path: str, owners: Collection[int]) -> bool:
    """True if ``path`` is a real directory (not a symlink) of one of ``owners``, mode 0700 or stricter."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid in owners and not st.st_mode & 0o077


def check_private_dir(path: str) -> None:
    """Raise :class:`SocketDirError` unless ``path`` is a real directory, ours, and 0700-or-stricter."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise SocketDirError(f"{path} is not a directory (a symlink or a file is refused)")
    if st.st_uid != os.geteuid():
        raise SocketDirError(f"{path} belongs to uid {st.st_uid}, not to us (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        raise SocketDirError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}: group/other may access it")


def ensure_socket_dir(path: str | None = None) -> str:
    """Create the socket directory with mode 0700 if needed and check that it is safe to use."""
    d = path if path is not None else socket_dir()
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(d, 0o700)  # the umask may have taken bits away; never adds any beyond 0700
    check_private_dir(d)
    return d
