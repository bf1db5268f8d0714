"""Shared fixtures: real processes that tests watch."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
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


# -- long runs started during the suite's first long window --------------------------------------
# tests/integration/analysis/test_analysis_scenarios.py's ``jobs`` starts these, each some seconds into its
# side-by-side watch of the rate-limited long jobs (~2.8 min): they run in their own threads (asleep most of
# the time too) instead of adding their minute or two each later in the suite. Each starts only once the
# watched jobs whose verdicts are sensitive to load are decided (slow start-up 40 s, the copy-on-read pair
# 62 s, the anonymous split 75 s; the light trainer-leak run alone starts at once): started at once, they
# put the load average at ~12 and on CI the slow start-up's data wait rose to 0.27 and copy-on-read was
# caught at 62 s instead of within 60 s.
# Run without that window (a module alone), a test's ``get`` starts its run at once.


class Background:
    """A long run begun on demand on its own thread: ``start(delay_s)`` (the long window),
    or ``get`` (the test that reads it, at once). What ``begin`` returns is ``get``'s value."""

    def __init__(self, begin: Callable[[], Any]) -> None:
        self._begin = begin
        self._thread: threading.Thread | None = None
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self.value: Any = None
        self.error: BaseException | None = None

    def start(self, delay_s: float = 0.0) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(delay_s,), daemon=True)
                self._thread.start()

    def _run(self, delay_s: float) -> None:
        if self._cancelled.wait(delay_s):
            return
        try:
            self.value = self._begin()
        except BaseException as exc:  # raised again in the test that reads it
            self.error = exc

    def get(self) -> Any:
        self.start()
        assert self._thread is not None
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.value

    def settle(self) -> None:
        """Wait until the run is over (its own test reports how it went): the tests after the
        long window do not share the machine with it (CI: oversubscription's test did)."""
        # pytest's own skip and fail are BaseExceptions: raised here they would error the window
        with contextlib.suppress(Exception, pytest.skip.Exception, pytest.fail.Exception):
            value = self.get()
            for part in value.values() if isinstance(value, dict) else [value]:
                part.result()

    def cancel(self) -> None:
        """At the session's end: a run not begun yet never begins."""
        self._cancelled.set()
        if self._thread is not None:
            self._thread.join()


@pytest.fixture(scope="session")
def deaths_early(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    from integration.deaths.test_real_trainings import early_runs

    with contextlib.ExitStack() as stack:
        runs = Background(lambda: stack.enter_context(early_runs(tmp_path_factory)))
        yield runs
        runs.cancel()


@pytest.fixture(scope="session")
def trainer_leak_run() -> Iterator[Background]:
    from integration.analysis.test_leak_under_respawning_workers import LeakRun

    def begin() -> LeakRun:
        run = LeakRun()
        run.start()
        return run

    background = Background(begin)
    yield background
    background.cancel()
    run = background.value
    if run is not None:
        run.stopping.set()  # its test deselected or the session interrupted: its jobs end now
        if run.thread is not None:
            run.thread.join(timeout=200)


@pytest.fixture(scope="session")
def report_recordings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Background]:
    from integration.export.test_export_report import Recordings

    def begin() -> Recordings:
        made = Recordings(tmp_path_factory.mktemp("recordings"))
        made.start()
        return made

    background = Background(begin)
    try:
        yield background
    finally:
        background.cancel()
        if background.value is not None:
            background.value.close()
