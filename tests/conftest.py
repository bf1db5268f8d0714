"""Shared fixtures: real processes that tests watch."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator

import pytest

Spawn = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start ``python -c CODE`` in its own process group; wait until it prints READY.

    Everything it started is killed at teardown, so no test leaves processes behind.
    """
    started: list[subprocess.Popen[str]] = []

    def _spawn(
        code: str, *, timeout: float = 60.0, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        started.append(proc)
        assert proc.stdout is not None
        import select

        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if line.strip() != "READY":
            proc.kill()
            raise RuntimeError(f"child did not get ready: {line!r}, exit {proc.poll()}")
        return proc

    yield _spawn
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
