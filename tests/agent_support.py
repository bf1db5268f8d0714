"""What the agent test modules share: a private XDG_RUNTIME_DIR for agents and their clients."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dlmon.agent.sitecustomize_hook import pythonpath_with_bootstrap

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def private_agent_env(prefix: str) -> Iterator[dict[str, str]]:
    """Set XDG_RUNTIME_DIR to a fresh directory (here and in the returned child environment, which
    also starts the agent through the bootstrap sitecustomize); restore it afterwards."""
    d = tempfile.mkdtemp(prefix=prefix)
    os.chmod(d, 0o755)  # the agent's own dlmon/ inside it is 0700; tests open holes next to it
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = d
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath_with_bootstrap(
        os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("DLMON_AGENT_DISABLE", None)
    try:
        yield env
    finally:
        if old is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old
        shutil.rmtree(d, ignore_errors=True)


def alive(pid: int) -> bool:
    """Running and not a zombie (a dead child not reaped yet is no longer alive)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
