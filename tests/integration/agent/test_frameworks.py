"""The jobs users actually run (issue 20): real Lightning, Hugging Face Trainer and torchdata jobs
on CPU under ``dlmon run --headless --record``, their scripts unchanged in style (each times its
own steps: the truth). What the user is told is checked: the record's loader rows (names in the
script's own file, roles, epochs, rates) and the headless alert lines."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support.agent import private_agent_env
from support.paths import ROOT, TESTS

pytest.importorskip("torch")

SCRIPTS = TESTS / "framework_scripts"
INTERVAL_S = 0.5


@dataclass(frozen=True)
class Run:
    script: Path
    snapshots: list[dict[str, Any]]  # record lines with loaders
    truth: dict[str, Any]  # what the script measured itself
    stderr: str  # headless output: the alert lines

    def loader(self, role: str) -> dict[str, Any]:
        (got,) = [x for x in self.snapshots[-1]["loaders"] if x["role"] == role]
        return got

    def alerts(self, kind: str) -> list[dict[str, Any]]:
        return [a for s in self.snapshots for a in s["alerts"] if a["kind"] == kind]


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, str]]:
    with private_agent_env("dlmon-frameworks-") as e:
        e["PYTHONPATH"] = str(ROOT)  # dlmon run injects the agent itself
        e["HF_HUB_OFFLINE"] = "1"  # no network: nothing is downloaded
        e["TRANSFORMERS_OFFLINE"] = "1"
        yield e


def run(tmp: Path, env: dict[str, str], script: str, *args: str) -> Run:
    record = tmp / "rec.jsonl"
    truth = tmp / "truth.json"
    path = SCRIPTS / script
    result = subprocess.run(
        [sys.executable, "-m", "dlmon", "run", "--headless", "--interval", str(INTERVAL_S),
         "--record", str(record), str(path), str(truth), *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp,
    )  # fmt: skip
    assert truth.exists(), result.stderr[-3000:]
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    snaps = [x for x in lines if "processes" in x and x.get("loaders")]
    assert snaps, result.stderr[-3000:]
    return Run(path, snaps, json.loads(truth.read_text()), result.stderr)


def site(script: Path, marker: str) -> str:
    """``file.py:line`` of the line in the script that starts with ``marker``."""
    for i, text in enumerate(script.read_text().splitlines(), 1):
        if text.strip().startswith(marker):
            return f"{script.name}:{i}"
    raise AssertionError(f"{marker!r} not in {script}")


def assert_rate_matches_the_scripts_steps(r: Run, loader_id: str) -> None:
    """dlmon's batches/s of the train loader, over the steady middle of the run, within 10% of
    the steps the script timed itself over the same span."""
    starts = r.truth["train_batch_starts"]
    lo, hi = starts[0] + 2.0, starts[-1] - 0.5
    ticks = [
        (s["time"], x["batches_per_s"])
        for s in r.snapshots
        for x in s["loaders"]
        if x["id"] == loader_id and x["batches_per_s"] is not None and lo <= s["time"] <= hi
    ]
    assert len(ticks) >= 6, f"too few readings in the steady span: {len(ticks)}"
    t_first, t_last = ticks[0][0], ticks[-1][0]
    counted = sum(rate * INTERVAL_S for _t, rate in ticks[1:])  # each rate covers the interval before it
    ours = counted / (t_last - t_first)
    truth = sum(1 for t in starts if t_first < t <= t_last) / (t_last - t_first)
    assert abs(ours - truth) <= 0.10 * truth, (ours, truth)


def assert_no_verdict_on(r: Run, loader: dict[str, Any]) -> None:
    for a in r.alerts("input_bound"):
        assert a["evidence"]["role"] != loader["role"], a
    assert f"RAISED critical input_bound loader {loader['name']}" not in r.stderr
    assert f"input_bound loader {loader['name']}:" not in r.stderr or loader["role"] == "train"


@pytest.fixture(scope="module")
def lightning_healthy(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Run:
    return run(tmp_path_factory.mktemp("pl"), env, "lightning_train.py", "--persistent")


@pytest.fixture(scope="module")
def lightning_slow(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> Run:
    return run(tmp_path_factory.mktemp("pl-slow"), env, "lightning_train.py", "--slow-train")


@pytest.mark.slow
def test_lightning_train_and_validation_loaders_persistent(lightning_healthy: Run) -> None:
    """Persistent workers: Lightning restarts them through ``_reset`` and ends each epoch by
    length. Both loaders are named at their own lines, with their roles; epochs are counted;
    the validation loader waits most of its own time (5 slow batches) yet is no verdict, and
    the job, which does not wait on its training loader, is not called input-bound."""
    r = lightning_healthy
    train, val = r.loader("train"), r.loader("validation")
    assert train["name"] == site(r.script, "train_loader = DataLoader(")
    assert val["name"] == site(r.script, "val_loader = DataLoader(")
    assert train["framework"] == val["framework"] == "Lightning"
    assert train["role_source"] == val["role_source"] == "framework"
    assert r.truth["epochs"] == 4
    assert train["epochs"] == train["epochs_started"] == 4
    assert val["epochs"] == val["epochs_started"] == 4
    assert train["persistent_workers"] is True and train["startup_s_total"] > 0
    assert_rate_matches_the_scripts_steps(r, train["id"])
    val_ticks = [x for s in r.snapshots for x in s["loaders"] if x["id"] == val["id"]]
    own = [x["data_wait_fraction"] for x in val_ticks if x["data_wait_fraction"] is not None]
    wall = [x["wall_wait_fraction"] for x in val_ticks if x["wall_wait_fraction"] is not None]
    assert own and max(own) >= 0.5, own  # it does wait most of its own bursts
    assert wall and max(wall) < max(own), (wall, own)
    assert_no_verdict_on(r, val)
    assert not r.alerts("input_bound"), r.alerts("input_bound")
    assert "input_bound" not in r.stderr


@pytest.mark.slow
def test_lightning_input_bound_names_the_train_loader_not_validation(lightning_slow: Run) -> None:
    """Without persistent workers (a new iterator every epoch) and a slow training dataset:
    the verdict is the training loader's, on the job's share of wall time; epochs counted."""
    r = lightning_slow
    train, val = r.loader("train"), r.loader("validation")
    assert train["name"] == site(r.script, "train_loader = DataLoader(")
    assert train["epochs"] == train["epochs_started"] == r.truth["epochs"] == 4
    assert val["epochs"] == val["epochs_started"] == 4
    assert_rate_matches_the_scripts_steps(r, train["id"])
    fired = r.alerts("input_bound")
    named = {(a["subject"], a["evidence"]["role"]) for a in fired}
    assert fired and named == {(f"loader {train['name']}", "train")}, named
    assert f"RAISED warning input_bound loader {train['name']}" in r.stderr or (
        f"RAISED critical input_bound loader {train['name']}" in r.stderr
    ), r.stderr[-2000:]
    assert f"Loader {train['name']} (train loader, Lightning) waits for data" in r.stderr
    assert_no_verdict_on(r, val)


@pytest.mark.slow
def test_hf_trainer_with_dataloader_workers(tmp_path: Path, env: dict[str, str]) -> None:
    """HF Trainer hands its loader to accelerate (a DataLoaderShard built from it, batch size in
    its batch sampler) and builds a new eval loader at each evaluation: one train row and one
    validation row, both named at the user's ``trainer.train()`` line, with the batch size."""
    r = run(tmp_path, env, "hf_train.py")
    rows = {x["id"] for s in r.snapshots for x in s["loaders"]}
    assert len(rows) == 2, rows
    train, val = r.loader("train"), r.loader("validation")
    where = site(r.script, "trainer.train()")
    assert train["name"] == val["name"] == where
    assert train["framework"] == val["framework"] == "HF Trainer"
    assert train["batch_size"] == val["batch_size"] == 4
    assert train["num_workers"] == 2
    assert train["epochs"] == train["epochs_started"] == r.truth["epochs"] == 2
    assert val["epochs"] == val["epochs_started"] == 3  # 120 steps, an evaluation every 40
    assert_rate_matches_the_scripts_steps(r, train["id"])
    assert_no_verdict_on(r, val)


@pytest.mark.slow
def test_torchdata_stateful_dataloader(tmp_path: Path, env: dict[str, str]) -> None:
    """StatefulDataLoader does not call DataLoader.__init__ and has its own iterator classes:
    named where the user built it, epochs counted, rate right."""
    r = run(tmp_path, env, "torchdata_train.py")
    (ld,) = r.snapshots[-1]["loaders"]
    assert ld["name"] == site(r.script, "loader = StatefulDataLoader(")
    assert ld["framework"] == "torchdata"
    assert ld["batch_size"] == 4 and ld["num_workers"] == 2
    assert ld["epochs"] == ld["epochs_started"] == r.truth["epochs"] == 4
    assert ld["samples_total"] == 4 * 160
    assert_rate_matches_the_scripts_steps(r, ld["id"])


@pytest.mark.slow
def test_screen_and_prometheus_show_roles_and_both_shares(lightning_healthy: Run) -> None:
    """The validation loader's own figure stays visible beside what it costs the job: on the
    Throughput panel ("… of its own time, …% of the job's") and in Prometheus (``role`` label,
    the wall ratio, the job's total)."""
    from prometheus_client import generate_latest

    from dlmon.export.prometheus import Exporter, registry_for
    from dlmon.model.serialize import snapshot_from_dict
    from dlmon.ui.state import DashboardState
    from dlmon.ui.views import text_of, throughput_lines

    r = lightning_healthy
    val_id = r.loader("validation")["id"]
    # a reading taken during a validation burst: the validation loader has both figures
    during = next(
        s
        for s in r.snapshots
        for x in s["loaders"]
        if x["id"] == val_id and x["data_wait_fraction"] is not None
    )
    snap = snapshot_from_dict(during)
    state = DashboardState()
    state.ingest(snap)
    screen = "\n".join(text_of(x) for x in throughput_lines(state, 240, False))
    assert "train · lightning_train.py:" in screen and "validation · lightning_train.py:" in screen, screen
    assert "of its own time, " in screen and "of the job's" in screen, screen
    assert "job data wait " in screen and "Lightning" in screen, screen
    exporter = Exporter()
    exporter(snap)
    text = generate_latest(registry_for(exporter)).decode()
    for name in ("dlmon_loader_data_wait_wall_ratio", "dlmon_loader_data_wait_ratio"):
        # prometheus_client sorts the labels: loader, local_rank, node_rank, rank, role, site
        series = re.compile(
            rf'^{name}\{{loader="{re.escape(val_id)}",[^}}]*role="validation"[^}}]*\}} (\S+)$', re.M
        )
        found = series.search(text)
        assert found is not None and 0.0 < float(found.group(1)) <= 1.0, text
    assert "dlmon_job_data_wait_wall_ratio{" in text
