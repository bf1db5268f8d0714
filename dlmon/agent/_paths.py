"""Where agents put their sockets: one private directory per user, one socket per process.

Standard library only; nothing here imports more than ``os``/``stat`` at import time.
"""

from __future__ import annotations

import os
import stat

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


def socket_path(pid: int) -> str:
    """The socket an agent in process ``pid`` serves on, as seen from this process's environment."""
    return os.path.join(socket_dir(), f"{int(pid)}.sock")


def candidate_socket_paths(pid: int) -> tuple[str, ...]:
    """Every place an agent of ``pid`` may serve, the likeliest first.

    The target may have been started with a different ``XDG_RUNTIME_DIR`` (or none) than the
    monitor, so a client looks in both directories.
    """
    name = f"{int(pid)}.sock"
    dirs: list[str] = []
    xdg = _xdg_dir()
    if xdg is not None:
        dirs.append(xdg)
    tmp = _tmp_dir()
    if tmp not in dirs:
        dirs.append(tmp)
    return tuple(os.path.join(d, name) for d in dirs)


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
