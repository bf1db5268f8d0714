"""The agent's files, staged where a running Python can import them without dlmon's environment.

dlmon may run from pipx or another venv whose site-packages (click, psutil, textual...) must not
shadow the target's. So the target imports from a private directory holding only ``dlmon/__init__.py``
and ``dlmon/agent/`` (standard library only), put first on ``sys.path`` for the import and taken off
again. The loader never raises into the target: it writes ``ok SOCKET`` or ``error REASON`` to
``status``, which dlmon reads once gdb (or sys.remote_exec) has run it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import dlmon

STATUS = "status"
LOADER = "load.py"
# dlmon.agent modules not to import eagerly: they run code when imported (site hooks)
NOT_PRELOADED = frozenset({"__init__", "sitecustomize_hook"})

# Runs in the target, in a dict of its own (never the target's __main__). Everything is imported
# while the staged directory exists: dlmon removes it once the load is done.
LOADER_SOURCE = """\
def _dlmon_load(root, modules, status):
    import sys
    try:
        agent = sys.modules.get("dlmon.agent")
        if agent is None:
            import importlib
            sys.path.insert(0, root)
            try:
                importlib.invalidate_caches()
                agent = importlib.import_module("dlmon.agent")
                for name in modules:
                    importlib.import_module("dlmon.agent." + name)
            finally:
                while root in sys.path:
                    sys.path.remove(root)
                sys.path_importer_cache.pop(root, None)
        agent.start()
        path = agent.serving_path()
        if path:
            line = "ok " + path
        else:
            degraded = getattr(getattr(agent, "_hooks", None), "R", None)
            degraded = getattr(degraded, "degraded", {})
            line = "error the agent loaded but does not serve: " + (
                "; ".join(f"{k}: {v}" for k, v in sorted(degraded.items()))
                or "DLMON_AGENT_DISABLE is set in the target, or it failed silently"
            )
    except BaseException as exc:  # never into the target's thread, whatever it is
        line = "error " + type(exc).__name__ + ": " + str(exc)
    try:
        with open(status, "w") as fh:
            fh.write(line[:2000])
    except BaseException:
        pass


_dlmon_load(ROOT, MODULES, STATUS)
del _dlmon_load
"""


@dataclass(frozen=True)
class Stage:
    root: Path  # the directory to put on the target's sys.path

    @property
    def loader(self) -> Path:
        return self.root / LOADER

    @property
    def status(self) -> Path:
        return self.root / STATUS

    def exec_line(self) -> str:
        """One line of Python that runs the loader, touching no name in the target's ``__main__``."""
        path = str(self.loader)
        # an expression that closes the file it read (a file left to the GC warns in __main__)
        read = f"(lambda fd: (os.read(fd, 1 << 20), os.close(fd))[0])(os.open({path!r}, os.O_RDONLY))"
        return (
            f"(lambda b, os: b.exec(b.compile({read}, {path!r}, 'exec'), {{'__name__': '__dlmon_load__'}}))"
            "(__import__('builtins'), __import__('os'))"
        )

    def read_status(self) -> str | None:
        try:
            return self.status.read_text().strip() or None  # empty: still being written
        except OSError:
            return None

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def agent_source_dir() -> Path:
    return Path(dlmon.__file__).resolve().parent


def stage(uid: int, gid: int) -> Stage:
    """A fresh 0700 directory with dlmon's agent, owned by ``uid`` (the target's) when we are root."""
    root = Path(tempfile.mkdtemp(prefix="dlmon-inject-"))
    try:
        src = agent_source_dir()
        pkg = root / "dlmon"
        pkg.mkdir()
        shutil.copyfile(src / "__init__.py", pkg / "__init__.py")
        shutil.copytree(src / "agent", pkg / "agent", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        modules = sorted(p.stem for p in (pkg / "agent").glob("*.py") if p.stem not in NOT_PRELOADED)
        arguments = f"{str(root)!r}, {modules!r}, {str(root / STATUS)!r}"
        (root / LOADER).write_text(LOADER_SOURCE.replace("ROOT, MODULES, STATUS", arguments))
        if os.geteuid() == 0 and uid != 0:
            for path in (root, *root.rglob("*")):
                os.chown(path, uid, gid, follow_symlinks=False)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return Stage(root)
