"""Every epoch style is counted (issue 20): StopIteration, a new iterator, ``_reset`` of a
persistent-worker iterator, a loop that stops by length; and loader roles from the pattern.
Real DataLoaders with 2 workers (tests/agent_scripts/epoch_styles.py), the agent's own report."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from support.agent import private_agent_env
from support.paths import ROOT, TESTS

pytest.importorskip("torch")

SCRIPT = TESTS / "agent_scripts" / "epoch_styles.py"


@pytest.fixture(scope="module")
def styles() -> Iterator[dict[str, Any]]:
    with private_agent_env("dlmon-epochs-") as env:
        env["PYTHONPATH"] = str(ROOT)  # no bootstrap: the script starts the agent itself
        out = subprocess.run(
            [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120
        )
    assert out.returncode == 0, out.stderr
    yield json.loads(out.stdout.strip().splitlines()[-1])


def test_epochs_ended_by_stop_iteration(styles: dict[str, Any]) -> None:
    got = styles["stop_iteration"]
    assert (got["epochs"], got["epochs_started"], got["batches_total"]) == (3, 3, 12)
    assert got["startup_wait_ns_total"] > 0


def test_a_new_iterator_ends_the_epoch_of_the_last_one(styles: dict[str, Any]) -> None:
    got = styles["new_iterator"]
    assert (got["epochs"], got["epochs_started"], got["batches_total"]) == (1, 2, 3)
    assert got["startup_wait_ns_total"] > 0


def test_reset_of_a_persistent_iterator_ends_its_epoch(styles: dict[str, Any]) -> None:
    """Lightning restarts persistent workers through ``_BaseDataLoaderIter._reset``: the same
    iterator, its workers kept; the epoch it was in ends there and a new one starts."""
    assert styles["persistent_same_iterator"] is True
    got = styles["persistent_reset"]
    assert (got["epochs"], got["epochs_started"], got["batches_total"]) == (2, 3, 5)
    assert got["startup_wait_ns_total"] > 0


def test_a_loop_that_stops_by_length_ends_the_epoch(styles: dict[str, Any]) -> None:
    got = styles["stop_by_length"]
    assert (got["epochs"], got["epochs_started"], got["batches_total"]) == (2, 2, 4)


def test_validation_bursts_between_training_batches_get_their_roles(styles: dict[str, Any]) -> None:
    assert (styles["pattern_train"]["role"], styles["pattern_train"]["role_source"]) == ("train", "pattern")
    assert (styles["pattern_val"]["role"], styles["pattern_val"]["role_source"]) == ("validation", "pattern")
    assert styles["pattern_val"]["epochs"] == 3


def test_loaders_zipped_or_run_one_after_another_get_no_guessed_role(styles: dict[str, Any]) -> None:
    for name in ("zip_a", "zip_b", "stop_iteration", "new_iterator", "persistent_reset", "stop_by_length"):
        assert styles[name]["role"] is None, (name, styles[name])


def test_a_merged_row_stays_alive_when_the_earlier_loader_dies() -> None:
    with private_agent_env("dlmon-twin-") as env:
        env["PYTHONPATH"] = str(ROOT)
        out = subprocess.run(
            [sys.executable, str(SCRIPT.parent / "twin_outlived.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rows_before"] == 1 and len(got["rows"]) == 1, got  # one row for both
    (row,) = got["rows"]
    assert row["alive"] is True and row["batches_total"] == 8, row


def test_two_user_loaders_over_one_dataset_are_two_listed_rows() -> None:
    """Only a loader a framework builds again from the user's is merged into it; two loaders the
    user wrote over the same dataset are both listed (the first was hidden as "replaced")."""
    with private_agent_env("dlmon-samedata-") as env:
        env["PYTHONPATH"] = str(ROOT)
        out = subprocess.run(
            [sys.executable, str(SCRIPT.parent / "same_dataset.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    listed = [r for r in rows if r["iterated"] and r["replaced_by"] is None]
    assert sorted(r["batches_total"] for r in listed) == [4, 16], rows
    assert len({r["name"] for r in listed}) == 2, rows


def test_user_subclasses_defined_after_the_hooks_work_as_without_dlmon() -> None:
    with private_agent_env("dlmon-subclass-") as env:
        env["PYTHONPATH"] = str(ROOT)
        out = subprocess.run(
            [sys.executable, str(SCRIPT.parent / "odd_subclasses.py")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr  # a partialmethod __init__ raised TypeError in the hook
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"fours": 2, "tag": "x", "tagged": 4}
