"""Verdicts a real job can trust (issue 8): healthy real jobs that must stay quiet, beside the
failures that must still be caught. Real processes sampled by the real Sampler, through a strict
Analyzer (tests/integration/analysis/test_analysis_scenarios.py has the fixtures)."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlmon.analysis import Analyzer
from dlmon.analysis.detectors import GrowthWindow, Thresholds
from dlmon.analysis.detectors.memory import MemoryNumbers
from dlmon.analysis.stats import median
from dlmon.model import Alert, GpuDevice, Snapshot
from dlmon.ui.fmt import DASH
from dlmon.ui.state import DashboardState
from dlmon.ui.views import memory_lines, table_cells, table_columns, text_of
from integration.analysis.test_analysis_scenarios import (
    Watch,
    Watched,
    fired,
    job,
    long_jobs,
    register_long_jobs,
    release_long_jobs,
)
from support.snapshots import GIB, MAIN_PID, MIB, T0, gpu, loader, proc, snap

pytest.importorskip("torch")

# The 10-min window squeezed into 90 s (same 5 MiB/min bar, 45 s of readings): a run of ~100 s
# then passes through every window the detector has, not only the 60 s one. It is stricter than
# the real 10-min window, which needs 240 s of readings and averages over more.
SCALED_MEMORY = MemoryNumbers(
    growth_windows=(
        *MemoryNumbers().growth_windows,
        GrowthWindow("10 min/90 s", 90.0, 45.0, 6, 5.0 * MIB / 60),
    ),
)
SCALED = Thresholds(SCALED_MEMORY)


def _watch(pid: int) -> Watch:
    w = Watch(pid)
    w.analyzer = Analyzer(cores=w.analyzer.cores, thresholds=SCALED, strict=True)
    return w


def _alerts(w: Watch) -> list[str]:
    return [f"{a.kind}: {a.message}" for s in w.snapshots for a in s.alerts]


def _staircase_watch(pid: int) -> Watch:
    """The watch's warm-up wait is scaled like the staircase's epochs (120 s -> 30 s): with real
    epochs of minutes, 120 s is less than one."""
    w = Watch(pid)
    w.analyzer = Analyzer(
        cores=w.analyzer.cores,
        thresholds=Thresholds(dataclasses.replace(SCALED_MEMORY, growth_warmup_s=30.0)),
        strict=True,
    )
    return w


def _long_jobs(tmp: pytest.TempPathFactory, stack: contextlib.ExitStack[None]) -> dict[str, Watched]:
    """The module's long real jobs, started together (with test_analysis_scenarios') and watched
    side by side, each from its own READY and for as long as its test asks: they are rate-limited
    and mostly asleep, so the suite waits about as long as the longest watch, not the sum."""
    from support.agent import private_agent_env

    memmap = tmp.mktemp("memmap") / "rows.u8"
    agent_env = stack.enter_context(private_agent_env("dlmon-verdicts-"))
    return {
        # quiet: the full 100 s, through every growth window SCALED has
        "memmap": Watched(
            job("--store", "memmap", "--memmap", str(memmap), "--workers", "4", "--batch", "8",
                "--rate", "20", "--shuffle", "--persistent"),
            100.0, make_watch=_watch,
        ),
        "anonymous_split": Watched(
            job("--store", "list", "--items", "3000000", "--workers", "2", "--batch", "50",
                "--rate", "20", "--shuffle", "--persistent"),
            75.0, fired("memory_growth"), _watch,
        ),
        # quiet: the full 40 s (over 8 epochs of start-up) under the agent
        "slow_startup": Watched(
            job("--store", "tensor", "--items", "600", "--batch", "20", "--workers", "2",
                "--rate", "20", "--init-sleep", "3"),
            40.0, make_watch=_watch, env=agent_env,
        ),
        "staircase": Watched(
            job("--store", "tensor", "--items", "2000", "--batch", "20", "--rate", "10",
                "--workers", "2", "--persistent", "--keep-per-epoch", str(96 * MIB)),
            90.0, fired("memory_growth"), _staircase_watch,
        ),
        "ceiling": Watched(
            job("--store", "list", "--items", "1000000", "--workers", "2", "--batch", "50",
                "--rate", "20", "--shuffle", "--persistent"),
            480.0, _CeilingWatch(),
        ),
    }  # fmt: skip


register_long_jobs(__name__, _long_jobs)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Watched]]:
    yield long_jobs(__name__, tmp_path_factory)
    release_long_jobs(__name__)


@pytest.mark.slow
def test_memmap_dataset_read_by_four_workers_is_not_a_leak(jobs: dict[str, Watched]) -> None:
    """4 workers random-read a 1 GiB np.memmap: they map ever more clean file pages (USS and PSS
    climb, as in the report: "grew from 162 MiB to 1.3 GiB" after 41 s) but nothing leaks. The
    mapped pages are shown as their own reclaimable figure; no alert is raised in 100 s."""
    w = jobs["memmap"].result()
    watched = jobs["memmap"].watched_s
    assert watched is not None and watched >= 100.0, watched
    last = w.snapshots[-1]
    m = last.memory
    assert m.pss_file_sum_bytes is not None and m.pss_anon_sum_bytes is not None
    assert m.pss_file_sum_bytes > 256 * MIB, "the workers should have mapped a good part of the file"
    first_uss = next(s.memory.uss_sum_bytes for s in w.snapshots if s.memory.uss_sum_bytes is not None)
    assert m.uss_sum_bytes is not None and m.uss_sum_bytes - first_uss > 128 * MIB  # USS "grew"
    assert not _alerts(w), _alerts(w)
    state = DashboardState()
    state.ingest(last)
    screen = "\n".join(text_of(line) for line in memory_lines(state, 200, False))
    assert "mapped files " in screen and "reclaimable" in screen
    workers = last.workers()
    assert len(workers) == 4 and all(p.pss_file_bytes is not None for p in workers if p.pss_bytes)
    # the Workers table has the mapped pages in their own column
    cols = table_columns(200, batches=False, gpu=False)
    at = [c.key for c in cols].index("file")
    rows = [r for r in state.rows.values() if r.process.role == "worker" and r.process.pss_file_bytes]
    assert rows and all(text_of(table_cells(r, cols, 0.25)).split()[at] != DASH for r in rows)


@pytest.mark.slow
def test_copy_on_read_still_fires_with_the_anonymous_split(jobs: dict[str, Watched]) -> None:
    """The leak the anonymous split must keep: 3M Python strings read by 2 workers (75 s at most)."""
    w = jobs["anonymous_split"].result()
    alert = next((a for s in w.snapshots for a in s.alerts if a.kind == "memory_growth"), None)
    assert alert is not None, "copy-on-read was not caught"
    assert alert.evidence["cause"] == "copy_on_read", alert.message
    assert "without mapped files" in alert.message or "anonymous" in alert.message, alert.message


@pytest.mark.slow
def test_slow_worker_startup_without_persistent_workers_is_not_input_bound(jobs: dict[str, Watched]) -> None:
    """2 workers that take 3 s to start (worker_init_fn), re-created every epoch of ~1.5 s of
    steady work: the trainer waits for start-up each epoch, but its steady-state data wait is
    low. Start-up is its own figure (per epoch, share of wall time), never a data wait of 1.0;
    no input_bound; the advice is persistent_workers=True with the number behind it."""
    from dlmon.analysis import advise
    from dlmon.ui.views import throughput_lines

    w = jobs["slow_startup"].result()
    watched = jobs["slow_startup"].watched_s
    assert watched is not None and watched >= 40.0, watched
    loaders = [ld for s in w.snapshots for ld in s.loaders]
    assert loaders, "the agent did not answer"
    waits = [ld.data_wait_fraction for ld in loaders if ld.data_wait_fraction is not None]
    # before: every reading taken during a start-up was 1.0 (about 60% of them here); a stray one
    # at an epoch's edge (the trainer catching up on prefetched batches, more of them on a loaded
    # machine) is a real wait
    assert waits and sum(1 for x in waits if x >= 0.99) <= max(2, len(waits) // 20), waits
    # the median, not the mean: on CI two such strays among 57 readings put the mean at 0.1003
    assert statistics.median(waits) < 0.1 and sum(waits) / len(waits) < 0.2, waits
    assert "input_bound" not in w.kinds_seen(), _alerts(w)
    last = w.snapshots[-1]
    ld = last.loaders[0]
    assert ld.startup_s_total is not None and ld.epochs_started is not None and ld.epochs_started >= 4
    assert ld.startup_s_total / ld.epochs_started >= 2.5  # ~3 s of worker_init_fn each epoch
    advice = advise(w.snapshots)
    line = next(x for x in advice.lines if x.topic == "persistent_workers")
    assert "Set persistent_workers=True" in line.text and "s per epoch" in line.text, line
    state = DashboardState()
    state.ingest(last)
    screen = "\n".join(text_of(x) for x in throughput_lines(state, 200, False))
    assert "worker start-up " in screen and "s/epoch" in screen, screen


_KILLED_TRAINER = """
import os, signal, time
import torch
from torch.utils.data import DataLoader

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000
    def __getitem__(self, i):
        time.sleep(0.05)
        return i

it = iter(DataLoader(Slow(), batch_size=4, num_workers=2))
next(it)
time.sleep(2.0)  # the workers are seen attached first
os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies; its workers notice within ~5 s and exit
"""


@pytest.mark.slow
def test_headless_final_frame_holds_the_truth_after_orphans_exit(tmp_path: Path) -> None:
    """A killed trainer orphans its workers (orphan_worker is raised); they exit a few seconds
    later and the run ends. The last record line no longer carries orphan_worker, and the headless
    alert log says "CLEARED" for it."""
    import json
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_KILLED_TRAINER)
    record = tmp_path / "rec.jsonl"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlmon",
            "run",
            "--headless",
            "--interval",
            "0.25",
            "--record",
            str(record),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    snapshots = [x for x in lines if "processes" in x]
    kinds = [{a["kind"] for a in x["alerts"]} for x in snapshots]
    assert any("orphan_worker" in k for k in kinds), result.stderr
    last = snapshots[-1]
    assert last["target"]["alive"] is False
    assert not [p for p in last["processes"] if p["state"] not in ("Z", "X")]  # the orphans exited
    assert "orphan_worker" not in kinds[-1], last["alerts"]
    assert "RAISED" in result.stderr and "orphan_worker" in result.stderr
    assert "CLEARED orphan_worker" in result.stderr, result.stderr


_TEMPORARY_LOADER = """
import sys, time
import torch
from torch.utils.data import DataLoader, Dataset

class Slow(Dataset):
    def __len__(self):
        return 10**6
    def __getitem__(self, i):
        time.sleep(0.02)
        return torch.zeros(4)

end = time.monotonic() + 14
for batch in DataLoader(Slow(), batch_size=8, num_workers=1):  # the loader object dies at once
    if time.monotonic() > end:
        break
"""


@pytest.mark.slow
def test_a_loader_built_in_the_for_statement_is_live_and_judged(tmp_path: Path) -> None:
    """`for batch in DataLoader(...)` keeps only the iterator: the agent marked the loader dead
    as soon as the DataLoader object was collected, so a starved job (one slow worker: the
    trainer waits nearly all the time) never got its input_bound verdict. The row lives while
    its iterator does."""
    import json
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_TEMPORARY_LOADER)
    record = tmp_path / "rec.jsonl"
    cmd = [sys.executable, "-m", "dlmon", "run", "--headless", "--interval", "0.5", "--record", str(record)]
    result = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    snapshots = [x for x in map(json.loads, record.read_text().splitlines()) if "processes" in x]
    iterating = [s for s in snapshots if any(x["batches_total"] for x in s["loaders"])]
    assert iterating and all(x["alive"] for s in iterating[:-2] for x in s["loaders"]), iterating[-3]
    kinds = {a["kind"] for s in snapshots for a in s["alerts"]}
    assert "input_bound" in kinds, result.stderr


# -- warm-up and the staircase ------------------------------------------------------------------


def _warm_up_history(
    load_s: float, total: float, seconds: int = 300, refresh: float = 10.0
) -> list[Snapshot]:
    """A trainer that loads ``total`` bytes over its first ``load_s`` seconds, then stays flat
    (RSS at once, PSS/USS re-read every ``refresh`` s, staggered); two flat workers."""
    out = []
    for k in range(seconds):
        t = float(k)
        procs = []
        for i in range(3):
            offset = (i * refresh / 3) % refresh
            read_at = max(0.0, ((t - offset) // refresh) * refresh + offset)
            if i == 0:
                level = 300 * MIB + total * min(1.0, read_at / load_s)
                rss = 500 * MIB + total * min(1.0, t / load_s)
                procs.append(
                    proc(MAIN_PID, "main", uss=level, pss=level + 100 * MIB, rss=rss, age=t - read_at)
                )
            else:
                procs.append(
                    proc(
                        MAIN_PID + i,
                        uss=50 * MIB,
                        pss=100 * MIB,
                        rss=400 * MIB,
                        age=t - read_at,
                        worker_id=i - 1,
                    )
                )
        out.append(snap(t, procs))
    return out


@pytest.mark.parametrize(("load_s", "total_gib"), [(5, 2), (30, 3), (45, 1), (60, 3)])
def test_warm_up_that_levels_off_is_not_a_leak(load_s: float, total_gib: float) -> None:
    """Loading a dataset or weights (1-3 GiB over the first seconds to a minute, then flat) has no
    earlier level to compare with; before, 45 s / 1 GiB and 60 s / 3 GiB raised memory_growth."""
    analyzer = Analyzer(cores=2, strict=True)
    outs = [analyzer(s) for s in _warm_up_history(load_s, total_gib * GIB)]
    assert not [a.message for s in outs for a in s.alerts]


def test_a_leak_from_the_start_heading_for_the_limit_is_not_held_back_by_the_warm_up_wait() -> None:
    """The warm-up wait gives way when the limit is near: 2 GiB left, +1 GiB/min from t=0."""
    analyzer = Analyzer(cores=2, strict=True)
    found = None
    for s in _warm_up_history(600.0, 10 * GIB, seconds=110):
        s = analyzer(dataclasses.replace(s, memory=dataclasses.replace(s.memory, available_bytes=2 * GIB)))
        if found is None and any(a.kind == "memory_growth" for a in s.alerts):
            found = s.time - T0
    assert found is not None and found < 100, found


@pytest.mark.slow
def test_true_staircase_is_caught_within_a_few_epochs(jobs: dict[str, Watched]) -> None:
    """The trainer keeps 96 MiB at each epoch end (a history of tensors kept by the loop), never
    given back; epochs of ~10 s. Real process, watched for 90 s at most (its watch's warm-up wait
    is scaled like the epochs: see _staircase_watch)."""
    w = jobs["staircase"].result()
    alert = next((a for s in w.snapshots for a in s.alerts if a.kind == "memory_growth"), None)
    assert alert is not None, "the staircase was not caught within 9 epochs"
    assert alert.evidence["cause"] == "main_process", alert.message
    watched = jobs["staircase"].watched_s
    assert watched is not None and watched < 90.0, watched


# -- input_bound's advice: per rank, never what the loader already does --------------------------


def _input_bound_history(ranks: int, workers: int, cpu: float, seconds: int = 40) -> list[Snapshot]:
    """``ranks`` training processes on one node, each iterating its own loader of ``workers``."""
    out = []
    for k in range(seconds):
        procs = []
        loaders = []
        for r in range(ranks):
            rank_pid = MAIN_PID + 100 * r
            if r:
                procs.append(proc(rank_pid, "child", cpu=50.0))
            pids = [rank_pid + 1 + i for i in range(workers)]
            procs.extend(proc(p, ppid=rank_pid, cpu=cpu) for p in pids)
            loaders.append(
                loader(id=f"{rank_pid}:1", pid=rank_pid, num_workers=workers, wait=0.6, worker_pids=pids)
            )
        out.append(snap(float(k), procs, loaders=loaders))
    return out


def _input_bound_advice(history: list[Snapshot], cores: int) -> list[str]:
    analyzer = Analyzer(cores=cores, strict=True)
    last = [analyzer(s) for s in history][-1]
    return [a.advice for a in last.alerts if a.kind == "input_bound"]


def test_ddp_ranks_share_the_node_cores_in_the_advice() -> None:
    """8 ranks x 4 CPU-bound workers on 56 cores: 7 cores per rank, so "raise from 4 to 6", not
    "from 4 to 55" per rank (8 x 55 workers on 56 cores)."""
    advice = _input_bound_advice(_input_bound_history(8, 4, cpu=97.0), cores=56)
    assert advice and all("from 4 to 6" in a and "8 ranks" in a for a in advice), advice


def test_latency_bound_loader_is_never_told_to_raise_to_what_it_has() -> None:
    """1 idle worker on 2 cores: before, "Raise num_workers (up to 1 ...)" to a loader with 1."""
    advice = _input_bound_advice(_input_bound_history(1, 1, cpu=5.0), cores=2)
    assert advice and "from 1 to 2" in advice[0] and "up to 1" not in advice[0], advice


def _input_bound_alert(gpus_of_tick: list[GpuDevice]) -> Alert:
    history = [dataclasses.replace(s, gpus=tuple(gpus_of_tick)) for s in _input_bound_history(1, 1, cpu=5.0)]
    analyzer = Analyzer(cores=2, strict=True)
    last = [analyzer(s) for s in history][-1]
    (alert,) = [a for a in last.alerts if a.kind == "input_bound"]
    return alert


def test_an_idle_gpu_confirms_input_bound() -> None:
    """Issue 24, beyond: the trainer's own GPU, idle while its loader is waited on, is said with
    the figure (the wait costs GPU time)."""
    alert = _input_bound_alert([gpu(0, util=30.0), gpu(1, util=100.0, pids=(4242,))])
    assert "its GPU 0 was idle 70% of that time" in alert.message, alert.message
    assert alert.severity == "critical"  # waits 60%
    assert alert.evidence["gpus"] == "0" and alert.evidence["gpu_busy_percent"] == 30.0


def test_a_busy_gpu_says_the_wait_is_hidden_and_is_never_critical() -> None:
    """The GPU busy 97% of the window: the loader's wait is hidden behind queued GPU work, so the
    verdict says so and stays a warning, however long the wait."""
    alert = _input_bound_alert([gpu(0, util=97.0)])
    assert "yet its GPU 0 was busy 97% of that time: the wait is hidden" in alert.message, alert.message
    assert alert.severity == "warning"


def _own_sm(device: GpuDevice, sm: float) -> GpuDevice:
    from dlmon.model import GpuProcess

    return dataclasses.replace(device, processes=(GpuProcess(MAIN_PID, None, sm_percent=sm),))


def test_the_trainers_own_sm_share_outranks_a_gpu_kept_busy_by_a_colleague() -> None:
    """NVML's per-process figure: the GPU is 99% busy, but with a colleague's kernels; the
    trainer's own kept it busy 20%: the wait costs it, and the verdict says whose figure it is."""
    alert = _input_bound_alert([_own_sm(gpu(0, util=99.0), 20.0)])
    assert "its kernels kept GPU 0 busy only 20% of that time" in alert.message, alert.message
    assert alert.severity == "critical" and alert.evidence["gpu_busy_own"] is True
    busy = _input_bound_alert([_own_sm(gpu(0, util=99.0), 95.0)])
    assert "yet its kernels kept GPU 0 busy 95% of that time: the wait is hidden" in busy.message
    assert busy.severity == "warning"


def test_a_starved_trainers_bursts_never_read_as_a_busy_gpu() -> None:
    """NVML samples a process only in the periods it ran a kernel: a trainer alone on its GPU,
    running in bursts between long waits, averages 95% over its own samples while the device
    is busy 30%. The own figure is never above the device's (found in review: the verdict was
    tempered to "the wait is hidden" and kept from critical on a starved job)."""
    alert = _input_bound_alert([_own_sm(gpu(0, util=30.0), 95.0)])
    assert "its kernels kept GPU 0 busy only 30% of that time" in alert.message, alert.message
    assert alert.severity == "critical"


def test_a_gpu_kept_busy_by_another_process_is_not_the_trainers_when_nvml_gives_no_own_figure() -> None:
    """No per-process figure (not supported): the device's utilisation is the trainer's only where
    it is alone on the GPU; beside another rank or a colleague, 97% busy may be all theirs (found
    in review: tempered to a warning while the trainer starved)."""
    alert = _input_bound_alert([gpu(0, util=97.0, pids=(MAIN_PID, 7))])
    assert "GPU" not in alert.message, alert.message
    assert alert.severity == "critical" and alert.evidence["gpus"] is None


def test_a_stray_context_on_another_ranks_gpu_does_not_halve_the_trainers_own() -> None:
    """A rank listed on GPU 0 only by a stray context (every rank touching cuda:0), where rank 0's
    kernels run, and on its own GPU 1 busy 95%: its own GPU's figure says the wait is hidden (found
    in review: the mean over both, 47%, kept the verdict critical and named both GPUs)."""
    from dlmon.model import GpuProcess

    gpu0 = dataclasses.replace(
        gpu(0, util=99.0),
        processes=(
            GpuProcess(MAIN_PID, 500 * 2**20, sm_percent=0.0),
            GpuProcess(4242, None, sm_percent=99.0),
        ),
    )
    alert = _input_bound_alert([gpu0, _own_sm(gpu(1, util=95.0), 95.0)])
    assert "yet its kernels kept GPU 1 busy 95% of that time: the wait is hidden" in alert.message, (
        alert.message
    )
    assert alert.severity == "warning" and alert.evidence["gpus"] == "1"


def test_input_bound_names_no_gpu_the_trainer_is_not_on_or_whose_reading_is_stale() -> None:
    """A colleague's GPU (NVML does not list the trainer there) and a stale reading say nothing
    about the trainer's GPU: the verdict is as without a GPU."""
    for gpus in (
        [gpu(0, util=10.0, pids=(4242,))],
        [dataclasses.replace(gpu(0, util=10.0), stale_age_s=30.0)],
    ):
        alert = _input_bound_alert(gpus)
        assert "GPU" not in alert.message, alert.message
        assert alert.severity == "critical" and alert.evidence["gpus"] is None


# -- GPUs: only the job's, and fragmentation against the peak --------------------------------------


def test_vram_pressure_only_on_the_gpus_this_job_uses() -> None:
    """GPU 1 is a colleague's (NVML lists only pid 4242 there) and 99% full: not this job's alert.
    The job's own GPU 0 at 99% is."""
    gpus = [gpu(0, used=79.5 * GIB, total=80 * GIB), gpu(1, used=79.5 * GIB, total=80 * GIB, pids=(4242,))]
    analyzer = Analyzer(cores=2, strict=True)
    last = [analyzer(snap(float(t), [proc(1001)], gpus=gpus)) for t in range(8)][-1]
    subjects = [a.subject for a in last.alerts if a.kind == "vram_pressure"]
    assert subjects == ["GPU 0"], subjects


def test_fragmentation_is_judged_against_peak_allocated() -> None:
    """Reserved 30 GiB, allocated 10 GiB between steps but 28 GiB at the step's peak: the cache is
    what the step needs, not fragmentation."""
    gpus = [gpu(0, used=40 * GIB, allocated=10 * GIB, reserved=30 * GIB, peak=28 * GIB)]
    analyzer = Analyzer(cores=2, strict=True)
    outs = [analyzer(snap(float(t), [proc(1001)], gpus=gpus)) for t in range(8)]
    assert not [a.message for s in outs for a in s.alerts]


# -- second reading (review of issue 8) --------------------------------------------------------


def test_advise_sizes_with_the_targets_cores_not_dlmons() -> None:
    """A record from a 1-core container (``target_cores``) advised here: the cores are the
    target's, as the Analyzer already takes them; before, advise used this machine's."""
    from dlmon.analysis import advise, default_cores

    target = 1.0 if default_cores() != 1 else 6.0
    history = [
        dataclasses.replace(snap(float(t), [proc(MAIN_PID + 1, ppid=MAIN_PID)]), target_cores=target)
        for t in range(5)
    ]
    assert advise(history).cores == int(target)


def test_analyzer_takes_the_targets_cores_from_the_snapshot() -> None:
    """0.5 core of CPU quota is one core (never zero); 12 cores of a replayed machine are 12."""
    for target, expected in ((0.5, 1), (12.0, 12)):
        history = _input_bound_history(1, 0, cpu=5.0)
        analyzer = Analyzer(strict=True)
        last = [analyzer(dataclasses.replace(s, target_cores=target)) for s in history][-1]
        found = [a for a in last.alerts if a.kind == "input_bound"]
        assert found and found[0].evidence["cores"] == expected, found


def test_ddp_ranks_without_workers_share_the_cores_in_the_advice() -> None:
    """8 ranks with num_workers=0 on 56 cores: "start at 6" per rank, not 8 per rank (64 workers
    on 56 cores); before, ranks were only counted when they had workers."""
    advice = _input_bound_advice(_input_bound_history(8, 0, cpu=5.0), cores=56)
    assert advice and all("start at 6" in a and "8 ranks" in a for a in advice), advice


def test_vram_pressure_still_fires_when_nvml_cannot_list_the_jobs_processes() -> None:
    """In a container NVML's pids are the host's: dlmon lists no process on any GPU, and without
    the agent there are no torch figures. The GPUs seen are then judged (they are the container's);
    before, vram_pressure was silent on a 99% full GPU."""
    gpus = [gpu(0, used=79.5 * GIB, total=80 * GIB, pids=())]
    analyzer = Analyzer(cores=2, strict=True)
    last = [analyzer(snap(float(t), [proc(1001)], gpus=gpus)) for t in range(8)][-1]
    assert [a.subject for a in last.alerts if a.kind == "vram_pressure"] == ["GPU 0"]


def _job_anon(s: Snapshot) -> float | None:
    procs = [p for p in s.processes if p.state not in ("Z", "X")]
    if not procs or any(p.pss_anon_bytes is None for p in procs):
        return None
    return float(sum(p.pss_anon_bytes or 0 for p in procs))


class _CeilingWatch:
    """Collects, tick by tick, the job's anonymous PSS and every ceiling the memory_growth alert
    predicts; says stop once the job has levelled off (under 2% over the last 45 s, and not before
    150 s and the first alert)."""

    def __init__(self) -> None:
        self.predicted: list[tuple[float, int, Alert]] = []
        self.levels: list[tuple[float, float]] = []
        self.first: Alert | None = None

    def timeline(self, every_s: float = 10.0) -> list[str]:
        """Every ``every_s``: seconds, the job's anonymous PSS and the ceiling the alert said (MiB)."""
        if not self.levels:
            return []
        t0, out, next_t = self.levels[0][0], [], self.levels[0][0]
        for t, v in self.levels:
            if t >= next_t:
                said = [(c, str(a.evidence["ceiling_basis"])) for tp, c, a in self.predicted if tp <= t]
                tail = f" -> {said[-1][0] / MIB:.0f} ({said[-1][1]})" if said else ""
                out.append(f"{t - t0:.0f}s {v / MIB:.0f}{tail}")
                next_t = t + every_s
        return out

    def __call__(self, w: Watch, s: Snapshot) -> bool:
        level = _job_anon(s)
        if level is not None:
            self.levels.append((s.time, level))
        for a in s.alerts:
            if a.kind != "memory_growth":
                continue
            self.first = self.first or a
            ceiling = a.evidence.get("ceiling_bytes")
            if isinstance(ceiling, int):
                self.predicted.append((s.time, ceiling, a))
        recent = [v for t, v in self.levels if t >= s.time - 45.0]
        return bool(
            self.first and w.elapsed() > 150.0 and recent and max(recent) - min(recent) < 0.02 * recent[-1]
        )


@pytest.mark.slow
def test_copy_on_read_ceiling_predicts_where_a_real_job_levels_off(jobs: dict[str, Watched]) -> None:
    """1M Python strings read at random by 2 workers (1000 samples/s): each worker copies the
    store's pages as it touches them, ever fewer untouched ones left, until every page is its
    own. The ceiling the alert predicts (job anonymous PSS) must be within 25% of where the
    real job levels off (watched for 480 s at most); it fits in this machine's memory, so the
    alert is info with no ETA."""
    jobs["ceiling"].result()
    seen = jobs["ceiling"].stop
    assert isinstance(seen, _CeilingWatch)
    predicted, levels, first = seen.predicted, seen.levels, seen.first
    assert first is not None, "copy-on-read was not caught"
    assert first.evidence["cause"] == "copy_on_read", first.message
    final = median([v for t, v in levels if t >= levels[-1][0] - 20.0])
    start_level = levels[0][1]
    assert final - start_level > 64 * MIB, "the workers should have copied the store"
    assert predicted, "no ceiling was given"
    # the prediction once the rise has shown its shape (from 30 s after the first alert on; the
    # median of what the alert said over that time: one tick's fit is noisy on a loaded machine)
    t_first = predicted[0][0]
    later = [(t, c, a) for t, c, a in predicted if t >= t_first + 30.0] or predicted[-1:]
    ceiling = median([float(c) for _, c, _ in later])
    alert = later[0][2]
    bases = sorted({str(a.evidence["ceiling_basis"]) for _, _, a in later})
    assert abs(ceiling - final) <= 0.25 * final, (
        ceiling / MIB,
        final / MIB,
        bases,
        alert.message,
        seen.timeline(),
    )
    assert alert.evidence["fits"] is True and alert.evidence["eta_s"] is None, alert.message
    assert "levels off at ≈" in alert.message and "no OOM" in alert.message, alert.message
    print(
        f"ceiling at first alert {predicted[0][1] / MIB:.0f} MiB, median from 30 s later "
        f"{ceiling / MIB:.0f} MiB ({bases}), real level {final / MIB:.0f} MiB "
        f"(from {start_level / MIB:.0f} MiB)"
    )


def test_advise_sizes_num_workers_per_rank_on_an_8_rank_node() -> None:
    """8 torchrun ranks x 4 workers (200 MiB each) on 56 cores and 400 GiB free, every loader
    waiting: each rank gets 7 cores and 50 GiB, so "raise from 4 to 6" (before: "to 55" per rank,
    8 x 55 workers on 56 cores)."""
    from dlmon.analysis import advise, format_advice

    history = []
    for k in range(6):
        procs, loaders = [], []
        for r in range(8):
            rank_pid = MAIN_PID + 100 * r
            if r:
                procs.append(proc(rank_pid, "child", cpu=50.0, uss=2 * GIB, pss=2 * GIB))
            pids = [rank_pid + 1 + i for i in range(4)]
            procs.extend(proc(p, ppid=rank_pid, cpu=97.0, uss=200 * MIB, pss=250 * MIB) for p in pids)
            loaders.append(
                loader(id=f"{rank_pid}:1", pid=rank_pid, num_workers=4, wait=0.6, worker_pids=pids)
            )
        history.append(snap(float(k), procs, loaders=loaders, total=512 * GIB, available=400 * GIB))
    advice = advise(history, cores=56)
    text = format_advice(advice)
    assert advice.ranks == 8 and advice.recommended_num_workers == 6, text
    assert "Raise num_workers from 4 to 6" in text and "to 55" not in text, text
    assert "56 cores / 8 ranks - 1 = 6" in text and "50.0 GiB per rank" in text, text
