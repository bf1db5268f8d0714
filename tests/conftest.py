"""Shared fixtures: real processes that tests watch."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

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


# -- long runs started with the suite's first long window -----------------------------------------
# tests/test_analysis_scenarios.py's ``jobs`` asks for these: its side-by-side watch of the
# rate-limited long jobs takes ~2.5 min, during which these (asleep most of the time too) run
# in their own threads, instead of adding their minute or two each later in the suite.


@pytest.fixture(scope="session")
def deaths_early(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from test_deaths import early_runs

    with early_runs(tmp_path_factory) as found:
        yield found


@pytest.fixture(scope="session")
def trainer_leak_run() -> Iterator[object]:
    from test_trainer_leak import LeakRun

    run = LeakRun()
    run.start()
    yield run
    run.stopping.set()  # its test deselected or the session interrupted: its jobs end now
    if run.thread is not None:
        run.thread.join(timeout=200)


@pytest.fixture(scope="session")
def report_recordings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from test_export_report import Recordings

    made = Recordings(tmp_path_factory.mktemp("recordings"))
    made.start()
    try:
        yield made
    finally:
        made.close()
