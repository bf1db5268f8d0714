"""dlmon agent bootstrap. Put this directory first on PYTHONPATH to start the agent in a process.

It starts the agent (``dlmon.agent.start()``) and then runs the next ``sitecustomize`` found
further down ``sys.path``, so that one still runs. Nothing here may break the interpreter's
start-up: every failure is swallowed (the chained sitecustomize's own errors are reported the
way ``site`` reports them).
"""

from __future__ import annotations

import contextlib


def _dlmon_bootstrap() -> None:
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        try:
            from dlmon.agent import sitecustomize_hook
        except ImportError:
            # dlmon is not installed in this interpreter: import it from where this file lives.
            root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
            sys.path.append(root)
            try:
                from dlmon.agent import sitecustomize_hook
            finally:
                with contextlib.suppress(ValueError):
                    sys.path.remove(root)
        sitecustomize_hook.maybe_start()
    except Exception:
        pass
    _chain(here)


def _chain(here: str) -> None:
    """Run the next sitecustomize on sys.path after ``here``, as ``site`` would have."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def norm(p: str) -> str:
        return os.path.normcase(os.path.realpath(p or os.getcwd()))

    me = norm(here)
    paths = list(sys.path)
    idx = next((i for i, p in enumerate(paths) if norm(p) == me), -1)
    rest = [p for p in paths[idx + 1 :] if norm(p) != me]
    try:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    except Exception:
        return
    if spec is None or spec.loader is None:
        return
    if spec.origin and norm(os.path.dirname(spec.origin)) == me:
        return
    ours = sys.modules.get("sitecustomize")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        if ours is not None:
            sys.modules["sitecustomize"] = ours
        if sys.flags.verbose:
            sys.excepthook(type(err), err, err.__traceback__)
        else:
            sys.stderr.write(
                f"Error in sitecustomize (run after dlmon's); set PYTHONVERBOSE for traceback:\n"
                f"{type(err).__name__}: {err}\n"
            )


_dlmon_bootstrap()
