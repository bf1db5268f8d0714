"""The exporter's run-long counters and dropped series, over snapshots of a real process (a sample
of this test) with alerts and loaders put on them: the verdicts themselves are tested elsewhere."""

from __future__ import annotations

import dataclasses
import os

import pytest

from dlmon.collect.sampler import Sampler
from dlmon.export.prometheus import Exporter, exposition
from dlmon.model import Alert, LoaderSample, Snapshot
from export_support import parse_exposition


@pytest.fixture(scope="module")
def snapshot() -> Snapshot:
    sampler = Sampler(os.getpid())
    try:
        return sampler.sample()
    finally:
        sampler.close()


def alert(kind: str, severity: str, subject: str = "job") -> Alert:
    return Alert(kind, severity, subject, "message", "advice", since=0.0)


def scrape(exporter: Exporter) -> dict[str, list[tuple[dict[str, str], float]]]:
    return parse_exposition(exposition(exporter).decode())


def test_alerts_raised_counts_raises_and_escalations_and_active_series_go(snapshot: Snapshot) -> None:
    exporter = Exporter()
    ticks = [
        (alert("memory_growth", "warning"),),
        (alert("memory_growth", "warning"),),  # still active: not raised again
        (
            alert("memory_growth", "critical"),
            alert("zombie_worker", "warning", "worker 1"),
        ),  # escalated, raised
        (),  # all cleared
    ]
    for alerts in ticks[:3]:
        exporter(dataclasses.replace(snapshot, alerts=alerts))
    metrics = scrape(exporter)
    raised = {(m["kind"], m["severity"]): v for m, v in metrics["dlmon_alerts_raised_total"]}
    assert raised == {
        ("memory_growth", "warning"): 1,
        ("memory_growth", "critical"): 1,
        ("zombie_worker", "warning"): 1,
    }
    active = {(m["kind"], m["severity"], m["subject"]) for m, _ in metrics["dlmon_alert_active"]}
    assert active == {("memory_growth", "critical", "job"), ("zombie_worker", "warning", "worker 1")}
    exporter(dataclasses.replace(snapshot, alerts=ticks[3]))
    metrics = scrape(exporter)
    assert "dlmon_alert_active" not in metrics  # cleared alerts leave no series behind
    assert sum(v for _, v in metrics["dlmon_alerts_raised_total"]) == 3  # the counter stays


def test_data_wait_seconds_integrate_ratio_times_interval(snapshot: Snapshot) -> None:
    exporter = Exporter()
    loader = LoaderSample(id="7:1", name="train.py:9", pid=7, data_wait_fraction=0.25)
    for interval in (2.0, 2.0, 4.0):
        exporter(dataclasses.replace(snapshot, loaders=(loader,), interval_s=interval))
    [(labels, seconds)] = scrape(exporter)["dlmon_loader_data_wait_seconds_total"]
    assert labels["loader"] == "7:1" and seconds == pytest.approx(2.0)
    exporter(dataclasses.replace(snapshot, loaders=(), interval_s=1.0))
    assert "dlmon_loader_data_wait_seconds_total" not in scrape(exporter)  # the loader is gone


def test_nothing_is_served_before_the_first_snapshot() -> None:
    assert set(scrape(Exporter())) == {"dlmon_build_info"}
