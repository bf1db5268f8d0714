"""``dlmon export --all-jobs --prometheus``: two real jobs with the agent on one /metrics endpoint,
each series labelled with its job's pid, valid for promtool; a killed job's series go at the next
rediscovery."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Spawn
from dlmon.agent.sitecustomize_hook import env_with_agent
from dlmon.collect.gpu_sweep import GpuSource
from dlmon.export.jobs import REDISCOVER_S, Job, JobsExporter, discover_jobs
from dlmon.export.prometheus import Exporter
from dlmon.flow.watch import Watch, WatchOptions
from dlmon.model import Snapshot
from support.export import (
    LOADER_JOB,
    dlmon_cmd,
    dlmon_serving,
    http_get,
    kill_group,
    parse_exposition,
    wait_for,
)

pytestmark = pytest.mark.slow

JOB = [sys.executable, LOADER_JOB, "--store", "tensor", "--items", "2000", "--workers", "1"]
JOB += ["--rate", "20", "--seconds", "120"]
SLEEPER = 'print("READY", flush=True)\nimport time; time.sleep(300)'


@pytest.fixture
def two_jobs() -> Iterator[list[subprocess.Popen[bytes]]]:
    jobs = [
        subprocess.Popen(
            JOB,
            env=env_with_agent(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    try:
        yield jobs
    finally:
        for job in jobs:
            kill_group(job)


def labelled(port: int, metric: str) -> set[str]:
    """The jobs that have a ``metric`` series in a scrape."""
    try:
        text = http_get(f"http://127.0.0.1:{port}/metrics")
    except OSError:
        return set()
    return {labels["job"] for labels, _ in parse_exposition(text).get(metric, [])}


def pss_jobs(port: int) -> set[str]:
    return labelled(port, "dlmon_job_pss_bytes")


def test_discovery_finds_agent_jobs_and_not_their_workers(two_jobs: list[subprocess.Popen[bytes]]) -> None:
    # no workers: found by its agent's socket alone
    no_workers = [*JOB[:7], "0", *JOB[8:]]
    solo = subprocess.Popen(
        no_workers, env=env_with_agent(), stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        pids = {job.pid for job in two_jobs}
        assert wait_for(lambda: pids <= discover_jobs(), timeout=90), discover_jobs()
        assert wait_for(lambda: solo.pid in discover_jobs(), timeout=90), "the agent's socket was not found"
        assert solo.poll() is None, "the job without workers exited"
    finally:
        kill_group(solo)
    found = discover_jobs()
    workers = {
        int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _comm(p) == "pt_data_worker"
    }
    assert not found & workers


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return ""


def test_all_jobs_on_one_endpoint(two_jobs: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    first, second = (str(job.pid) for job in two_jobs)
    args = ["export", "--all-jobs", "--prometheus", "127.0.0.1:0", "--interval", "0.5"]
    with dlmon_serving(args, tmp_path / "stderr") as (_, port):
        # the jobs' agents start with them; a job found before its socket exists still counts by its workers
        assert wait_for(lambda: {first, second} <= pss_jobs(port), timeout=90), pss_jobs(port)
        assert wait_for(lambda: {first, second} <= labelled(port, "dlmon_worker_pid"), timeout=90)
        text = http_get(f"http://127.0.0.1:{port}/metrics")
        series = parse_exposition(text)
        for name, samples in series.items():
            if name != "dlmon_build_info":
                assert all("job" in labels for labels, _ in samples), name
        helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP")]
        assert len(helps) == len(set(helps)), "a metric family is announced twice"
        if shutil.which("promtool"):
            check = subprocess.run(
                ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
            )
            assert check.returncode == 0, check.stdout + check.stderr
        kill_group(two_jobs[0])
        assert wait_for(lambda: first not in pss_jobs(port), timeout=REDISCOVER_S + 60), pss_jobs(port)
        assert second in pss_jobs(port)
        gone = [
            n
            for n, samples in parse_exposition(http_get(f"http://127.0.0.1:{port}/metrics")).items()
            if any(labels.get("job") == first for labels, _ in samples)
        ]
        assert not gone, f"series of the killed job left: {gone}"


@pytest.mark.parametrize("args", [[], ["1", "--all-jobs"]])
def test_a_pid_or_all_jobs_one_line_and_exit_2(args: list[str]) -> None:
    result = subprocess.run(
        dlmon_cmd("export", *args, "--prometheus", "0"), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "dlmon: error: give a PID or --all-jobs (one of the two)"


def test_an_orphaned_worker_makes_no_job_of_init() -> None:
    """A DataLoader worker whose trainer died is reparented to pid 1 (or a subreaper): init is no
    training job, and sampling it would walk every process of the machine."""
    import os
    import time

    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the "trainer": forks the worker and dies at once
        os.close(read_end)
        if os.fork() == 0:
            with open("/proc/self/comm", "w") as fh:
                fh.write("pt_data_worker")
            os.write(write_end, str(os.getpid()).encode())
            os.close(write_end)
            time.sleep(60)
        os._exit(0)
    os.close(write_end)
    worker = int(os.read(read_end, 32))
    os.close(read_end)
    os.waitpid(child, 0)
    try:
        deadline = time.monotonic() + 30
        while True:
            with open(f"/proc/{worker}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            if ppid != child or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert ppid != child
        assert ppid not in discover_jobs(), f"the orphan's new parent {ppid} taken for a job"
    finally:
        os.kill(worker, 9)
        with __import__("contextlib").suppress(ChildProcessError):
            os.waitpid(worker, 0)


def test_one_jobs_failing_tick_does_not_stop_the_others(spawn: Spawn) -> None:
    """A job whose tick raises after sampling (the analysis, a sink) is dlmon's own failure, as in
    every other watch: counted for that job, and every other job is still sampled and exported.
    Found in review: the exception left ``tick`` and ended the export of every job."""
    failing, healthy = spawn(SLEEPER), spawn(SLEEPER)

    def broken(snapshot: Snapshot) -> None:
        raise RuntimeError("a sink that fails")

    def open_job_failing_for_one(pid: int, interval: float, gpu: GpuSource, pid_labels: bool) -> Job:
        exporter = Exporter(pid_labels=pid_labels)
        sinks = (broken, exporter) if pid == failing.pid else (exporter,)
        watch = Watch(WatchOptions(interval, sinks=sinks))
        watch.open_sampler(pid, gpu_source=gpu)
        return Job(watch, watch.pipeline(), exporter)

    said: list[str] = []
    jobs = JobsExporter(
        1.0,
        discover=lambda: {failing.pid, healthy.pid},
        open_job=open_job_failing_for_one,
        report=said.append,
    )
    try:
        jobs.tick()
        jobs.tick()
        assert [job for job, _ in jobs.latest] == [str(healthy.pid)]
        assert jobs.failed_ticks(failing.pid) == 2 and jobs.failed_ticks(healthy.pid) == 0
        failed = "a tick failed: RuntimeError: a sink that fails; its export goes on"
        assert said == [f"job {failing.pid}: {failed}"]
    finally:
        jobs.close()
