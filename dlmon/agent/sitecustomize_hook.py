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
    """True in a spawn/forkserver child or the resource tracker: no agent of their own at start-up."""
    argv = orig_argv if orig_argv is not None else list(getattr(sys, "orig_argv", sys.argv))
    if "--multiprocessing-fork" in argv:
        return True
    return any(a.lstrip().startswith("from multiprocessing.") for a in argv)


def is_spawned_child(orig_argv: list[str] | None = None) -> bool:
    """True in a child started by multiprocessing's spawn method (``--multiprocessing-fork``).

    That is a ``torch.multiprocessing.spawn`` rank as much as a spawn-context DataLoader worker.
    """
    argv = orig_argv if orig_argv is not None else list(getattr(sys, "orig_argv", sys.argv))
    return "--multiprocessing-fork" in argv


def maybe_start() -> bool:
    """Start the agent, or arm it in a spawned child; nothing in other multiprocessing helpers.

    A spawned child gets the hooks at once but serves only from its first DataLoader iteration
    (:func:`dlmon.agent.arm`): a rank does, a DataLoader worker never does. The resource tracker
    and the forkserver get nothing. True if the agent was started or armed.
    """
    if is_spawned_child():
        import dlmon.agent

        dlmon.agent.arm()
        return True
    if is_multiprocessing_helper():
        return False
    import dlmon.agent

    dlmon.agent.start()
    return True
