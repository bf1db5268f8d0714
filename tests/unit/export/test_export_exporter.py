"""The exporter's run-long counters and dropped series, over snapshots of a real process (a sample
of this test) with alerts and loaders put on them: the verdicts themselves are tested elsewhere."""

from __future__ import annotations

import dataclasses
import os

import pytest

from dlmon.collect.sampler import Sampler
from dlmon.export.prometheus import Exporter, exposition
from dlmon.model import Alert, LoaderSample, Snapshot
from support.export import parse_exposition


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


def test_the_host_is_one_info_series_not_a_label_on_every_series(snapshot: Snapshot) -> None:
    exporter = Exporter()
    exporter(snapshot)
    metrics = scrape(exporter)
    assert metrics["dlmon_host_info"] == [({"host": snapshot.host}, 1.0)]
    assert all("host" not in labels for name, series in metrics.items() if name != "dlmon_host_info"
               for labels, _ in series)  # fmt: skip


def test_process_series_carry_no_pid_unless_asked(snapshot: Snapshot) -> None:
    """The trainer is keyed by role (and rank): a restarted job continues its series."""
    loader = LoaderSample(id=f"{os.getpid()}:1", name="train.py:9", pid=os.getpid(), wall_wait_fraction=0.2)
    ranked = dataclasses.replace(snapshot, loaders=(loader,))
    default, with_pids = Exporter(), Exporter(pid_labels=True)
    default(ranked)
    with_pids(ranked)
    main = [m for m, _ in scrape(default)["dlmon_process_rss_bytes"] if m["role"] == "main"]
    assert [m["pid"] for m in main] == [""]
    assert [m["pid"] for m, _ in scrape(default)["dlmon_job_data_wait_wall_ratio"]] == [""]
    main = [m for m, _ in scrape(with_pids)["dlmon_process_rss_bytes"] if m["role"] == "main"]
    assert [m["pid"] for m in main] == [str(os.getpid())]
    assert [m["pid"] for m, _ in scrape(with_pids)["dlmon_job_data_wait_wall_ratio"]] == [str(os.getpid())]


def test_two_processes_that_would_share_labels_keep_their_pids(snapshot: Snapshot) -> None:
    [me] = [p for p in snapshot.processes if p.pid == os.getpid()]
    twins = (dataclasses.replace(me, role="child"), dataclasses.replace(me, pid=me.pid + 1, role="child"))
    exporter = Exporter()
    exporter(dataclasses.replace(snapshot, processes=(me, *twins)))
    children = sorted(
        m["pid"] for m, _ in scrape(exporter)["dlmon_process_rss_bytes"] if m["role"] == "child"
    )
    assert children == sorted([str(me.pid), str(me.pid + 1)])  # neither takes the other's series
    loaders = tuple(
        LoaderSample(id=f"{pid}:1", name="t.py:1", pid=pid, wall_wait_fraction=0.1) for pid in (7, 8)
    )
    exporter(dataclasses.replace(snapshot, loaders=loaders))
    waits = sorted(m["pid"] for m, _ in scrape(exporter)["dlmon_job_data_wait_wall_ratio"])
    assert waits == ["7", "8"]


def test_active_alerts_as_series_with_rank_loader_and_cause_and_a_count_by_kind(snapshot: Snapshot) -> None:
    loader = LoaderSample(
        id="7:1", name="train.py:9", pid=7, rank=1, local_rank=1, node_rank=0, world_size=2, batches_total=5
    )
    bound = Alert(
        "input_bound", "warning", f"loader {loader.label}", "m", "a", since=0.0, evidence={"cause": "cpu"}
    )
    straggler = Alert("straggler", "info", "rank 1", "m", "a", 0.0, {"rank": 1, "cause": "latency"})
    growth = Alert(
        "memory_growth", "warning", "job", "m", "a", 0.0, {"eta_s": 840.0, "cause": "copy_on_read"}
    )
    exporter = Exporter()
    exporter(dataclasses.replace(snapshot, loaders=(loader,), alerts=(bound, straggler, growth)))
    metrics = scrape(exporter)
    placed = {
        (m["kind"], m["severity"], m["rank"], m["loader"], m["cause"])
        for m, v in metrics["dlmon_alert"]
        if v == 1
    }
    assert placed == {
        ("input_bound", "warning", "1", "7:1", "cpu"),
        ("straggler", "info", "1", "", "latency"),
        ("memory_growth", "warning", "", "", "copy_on_read"),
    }
    counts = {m["kind"]: v for m, v in metrics["dlmon_alerts_active"]}
    assert counts == {"input_bound": 1, "straggler": 1, "memory_growth": 1}
    assert metrics["dlmon_memory_growth_eta_seconds"] == [({}, 840.0)]
    [(labels, _)] = metrics["dlmon_loader_batches_total"]
    assert labels["site"] == "train.py:9" and labels["rank"] == "1"


def test_a_job_without_alerts_exports_no_alert_series(snapshot: Snapshot) -> None:
    exporter = Exporter()
    exporter(dataclasses.replace(snapshot, alerts=()))
    metrics = scrape(exporter)
    for name in ("dlmon_alert", "dlmon_alerts_active", "dlmon_memory_growth_eta_seconds"):
        assert name not in metrics


@pytest.mark.parametrize("pid_labels", [False, True])
def test_every_job_s_exporter_follows_the_pid_choice(pid_labels: bool) -> None:
    """``export --all-jobs --prometheus-pids``: each job's exporter is made with the choice."""
    from dlmon.export.jobs import JobsExporter
    from dlmon.export.prometheus import render_jobs

    me = os.getpid()
    jobs = JobsExporter(1.0, discover=lambda: {me}, pid_labels=pid_labels)
    jobs.tick()
    [(job, published)] = jobs.latest
    assert job == str(me) and published.pid_labels is pid_labels
    families = {f.name: f for f in render_jobs(jobs.latest)}
    mains = [s.labels for s in families["dlmon_process_rss_bytes"].samples if s.labels["role"] == "main"]
    assert [m["pid"] for m in mains] == [str(me) if pid_labels else ""]
