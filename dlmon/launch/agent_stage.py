"""The agent's files, staged where a running Python can import them without dlmon's environment.

dlmon may run from pipx or another venv whose site-packages (click, psutil, textual...) must not
shadow the target's. So the target imports from a private directory holding only ``dlmon/__init__.py``
and ``dlmon/agent/`` (standard library only), in ``pkg/`` apart from the loader and its status.
The loader imports ``dlmon`` from there by spec and never touches ``sys.path``: the training may be
importing at the same time, and PathFinder iterates ``sys.path`` itself (an entry taken out of it
mid-iteration shifts the list, and the training's import skips an entry).

The exec line that gdb (or sys.remote_exec) runs cannot raise: it reads ``load.py``, which only
starts a thread and returns, inside ``contextlib.suppress(Exception)``. An exception reaching
PyErr_Print would run the training's ``sys.excepthook`` (mpi4py's aborts). The load itself runs in
that new thread, never in the thread gdb stopped (which may hold the training's locks), and catches
Exception only: SystemExit and KeyboardInterrupt raised by the training's signal handlers stay the
training's. It writes ``ok SOCKET`` or ``error REASON`` to ``status``, which dlmon polls.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import dlmon

STATUS = "status"
LOADER = "load.py"
PACKAGE_DIR = "pkg"  # what goes on the target's sys.path: dlmon/ only
STATUS_MAX = 4096
# dlmon.agent modules not to import eagerly: they run code when imported (site hooks)
NOT_PRELOADED = frozenset({"__init__", "sitecustomize_hook"})

# Runs in the target, in a dict of its own (never the target's __main__). Everything is imported
# while the staged directory exists: dlmon removes it once the status is written.
LOADER_SOURCE = """\
def _dlmon_load(root, modules, status):
    import sys
    try:
        agent = sys.modules.get("dlmon.agent")
        if agent is None:
            import importlib, importlib.machinery, importlib.util
            ours = ["dlmon.agent." + name for name in modules] + ["dlmon.agent"]
            try:
                # sys.path stays untouched: the training's PathFinder may be iterating it
                if "dlmon" not in sys.modules:
                    spec = importlib.machinery.PathFinder.find_spec("dlmon", [root])
                    if spec is None or spec.loader is None:
                        raise ImportError("no dlmon package in " + root)
                    package = importlib.util.module_from_spec(spec)
                    sys.modules["dlmon"] = package
                    ours.append("dlmon")
                    spec.loader.exec_module(package)
                # the submodules follow dlmon.__path__ (the stage)
                agent = importlib.import_module("dlmon.agent")
                for name in modules:
                    importlib.import_module("dlmon.agent." + name)
            except BaseException:
                # nothing half-imported stays (the stage gone under us): a later load would find
                # this stage's dlmon in sys.modules and import nothing from its gone directory
                for name in ours:
                    sys.modules.pop(name, None)
                raise
            finally:
                for path in (root, root + "/dlmon", root + "/dlmon/agent"):
                    sys.path_importer_cache.pop(path, None)
        # start_injected: the replies say from when the counts run (an older dlmon.agent the
        # training imported itself has start() only)
        getattr(agent, "start_injected", agent.start)()
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
    except Exception as exc:  # SystemExit, KeyboardInterrupt: not ours to swallow
        line = "error " + type(exc).__name__ + ": " + str(exc)
    try:
        with open(status, "w") as fh:
            fh.write(line[:2000])
    except Exception:
        pass


__import__("_thread").start_new_thread(_dlmon_load, (ROOT, MODULES, STATUS))
"""


@dataclass(frozen=True)
class Stage:
    root: Path  # the stage as dlmon sees it
    seen: Path | None = None  # the same directory as the target sees it, when the path differs

    @property
    def loader(self) -> Path:
        return self.root / LOADER

    @property
    def status(self) -> Path:
        return self.root / STATUS

    @property
    def target_root(self) -> Path:
        return self.seen or self.root

    def exec_line(self) -> str:
        """One line of Python that runs the loader and cannot raise, touching no name of ``__main__``.

        The path travels as hex: a quote or a backslash in TMPDIR cannot break the line.
        """
        path = f"bytes.fromhex('{os.fsencode(str(self.target_root / LOADER)).hex()}')"
        # an expression that closes the file it read (a file left to the GC warns in __main__)
        read = f"(lambda fd: (os.read(fd, 1 << 20), os.close(fd))[0])(os.open({path}, os.O_RDONLY))"
        run = (
            f"(lambda b, os: b.exec(b.compile({read}, {path}, 'exec'), {{'__name__': '__dlmon_load__'}}))"
            "(__import__('builtins'), __import__('os'))"
        )
        return f"with __import__('contextlib').suppress(Exception): {run}"

    def read_status(self) -> str | None:
        """The loader's line; None while there is none. Never follows a link the target's user made."""
        try:
            fd = os.open(self.status, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = os.read(fd, STATUS_MAX)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data.decode("utf-8", errors="replace").strip() or None  # empty: still being written

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)  # fd-based on Linux: follows no symlink


def agent_source_dir() -> Path:
    return Path(dlmon.__file__).resolve().parent


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """Hand ``root`` to ``uid`` bottom-up, the directory itself last.

    Until ``root`` (0700, ours) is handed over, the target's user cannot enter it, so nothing in it
    can be swapped for a symlink while we chown; and no chown follows a link.
    """
    for top, dirs, files in os.walk(root, topdown=False):
        for name in (*files, *dirs):
            os.chown(os.path.join(top, name), uid, gid, follow_symlinks=False)
    os.chown(root, uid, gid, follow_symlinks=False)


def stage(uid: int, gid: int, parent: str | None = None, seen_parent: str | None = None) -> Stage:
    """A fresh 0700 directory with dlmon's agent, owned by ``uid`` (the target's) when we are root.

    ``parent``: where to make it (default: TMPDIR); ``seen_parent``: that directory's path as the
    target sees it, when it differs (a target in another mount namespace, through /proc/PID/root).
    """
    root = Path(tempfile.mkdtemp(prefix="dlmon-inject-", dir=parent))
    seen = Path(seen_parent) / root.name if seen_parent else None
    try:
        src = agent_source_dir()
        pkg = root / PACKAGE_DIR / "dlmon"
        pkg.mkdir(parents=True)
        shutil.copyfile(src / "__init__.py", pkg / "__init__.py")
        shutil.copytree(src / "agent", pkg / "agent", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        modules = sorted(p.stem for p in (pkg / "agent").glob("*.py") if p.stem not in NOT_PRELOADED)
        target_root = seen or root
        arguments = f"{str(target_root / PACKAGE_DIR)!r}, {modules!r}, {str(target_root / STATUS)!r}"
        (root / LOADER).write_text(LOADER_SOURCE.replace("ROOT, MODULES, STATUS", arguments))
        if os.geteuid() == 0 and uid != 0:
            chown_tree(root, uid, gid)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return Stage(root, seen)
