"""Starting the agent in processes that dlmon launches, through ``sitecustomize``.

``dlmon run`` puts :func:`bootstrap_dir` first on ``PYTHONPATH``. Python then imports
``bootstrap/sitecustomize.py`` at start-up, which calls :func:`maybe_start` and afterwards
runs any other ``sitecustomize`` found further down ``sys.path`` (a distribution's, a
virtualenv's, the user's own), so dlmon never hides one.

Standard library only.
"""

from __future__ import annotations

import os
import sys

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")


def bootstrap_dir() -> str:
    """The directory to put on PYTHONPATH; it holds only ``sitecustomize.py``."""
    return BOOTSTRAP_DIR


def pythonpath_with_bootstrap(existing: str | None) -> str:
    """``PYTHONPATH`` with the bootstrap directory first (once), the existing entries after it."""
    parts = [p for p in (existing or "").split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    return os.pathsep.join([BOOTSTRAP_DIR, *parts])


def env_with_agent(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: ``os.environ``) that starts the agent in every Python child."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = pythonpath_with_bootstrap(out.get("PYTHONPATH"))
    return out


def is_multiprocessing_helper(orig_argv: list[str] | None = None) -> bool:
    """True in a spawn/forkserver child or the resource tracker: no agent of their own there."""
    argv = orig_argv if orig_argv is not None else list(getattr(sys, "orig_argv", sys.argv))
    if "--multiprocessing-fork" in argv:
        return True
    return any(a.lstrip().startswith("from multiprocessing.") for a in argv)


def maybe_start() -> bool:
    """Start the agent unless disabled or in a multiprocessing helper; True if start() was called."""
    if is_multiprocessing_helper():
        return False
    import dlmon.agent

    dlmon.agent.start()
    return True
