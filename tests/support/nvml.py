"""The stand-in ``libnvidia-ml.so.1`` (tests/fake_nvml/fake_nvml.c): building it, and running
Python against it.

The real nvidia-ml-py loads the library with ``CDLL("libnvidia-ml.so.1")``, which the dynamic
loader resolves through ``LD_LIBRARY_PATH`` as read when the process started: code that should
see the stand-in runs in a child process whose environment points there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from support.paths import ROOT

SOURCE = ROOT / "tests" / "fake_nvml" / "fake_nvml.c"
LIBRARY = "libnvidia-ml.so.1"


def build(directory: Path) -> Path | None:
    """Compile the stand-in into ``directory``; None when there is no C compiler."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / LIBRARY
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(out), str(SOURCE)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return directory


def environment(library_dir: Path, config: Path) -> dict[str, str]:
    """This process's environment, with the stand-in first on the loader's path (and this
    checkout's dlmon first on Python's)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(library_dir), env.get("LD_LIBRARY_PATH")]))
    env["DLMON_FAKE_NVML"] = str(config)
    return env


def run_python(
    code: str, library_dir: Path, config: Path, *, timeout: float = 60.0, args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment(library_dir, config),
    )
