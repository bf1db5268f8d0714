"""The inject tests' long, mostly idle scenarios, started once when the package's first test runs
so that they wait beside the other tests instead of alone (the suite must stay under 30 min)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
from collections.abc import Iterator

import pytest

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="inject-scenario")
_STARTED: dict[str, concurrent.futures.Future[object]] = {}


def hung_before_load(factory: pytest.TempPathFactory) -> concurrent.futures.Future[object]:
    """The hung-before-the-load scenario of test_inject_outside_stacks: started at most once."""
    from integration.inject.test_inject_outside_stacks import run_hung_before_load

    if "hung" not in _STARTED:
        _STARTED["hung"] = _POOL.submit(run_hung_before_load, factory.mktemp("hung-before-load"))
    return _STARTED["hung"]


def sleeping_trainer(factory: pytest.TempPathFactory) -> concurrent.futures.Future[object]:
    """The sleeping-trainer scenario of test_inject_midflight: started at most once."""
    from integration.inject.test_inject_midflight import run_sleeping_trainer

    if "sleep" not in _STARTED:
        _STARTED["sleep"] = _POOL.submit(run_sleeping_trainer, factory.mktemp("sleeping-trainer"))
    return _STARTED["sleep"]


@pytest.fixture(scope="package", autouse=True)
def _start_long_scenarios(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    from integration.inject.test_inject_outside_stacks import can_run_hung_before_load

    if can_run_hung_before_load():
        hung_before_load(tmp_path_factory)
    if importlib.util.find_spec("torch") is not None:
        sleeping_trainer(tmp_path_factory)
    yield
    for future in _STARTED.values():
        with contextlib.suppress(Exception):
            future.result(timeout=300)  # its processes are killed when it ends
