"""Whole snapshots of real training-like processes."""

from __future__ import annotations

import json
import time

import pytest

from conftest import Spawn
from dlmon.collect.sampler import NoSuchProcess, Sampler
from dlmon.flow.recording import encode_snapshot
from dlmon.model.serialize import snapshot_from_dict, snapshot_to_dict

pytest.importorskip("torch")

DATALOADER_4_WORKERS = """
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Images(Dataset):
        def __init__(self):
            self.store = torch.randn(2000, 3, 32, 32)    # ~24 MiB, shared with the forked workers
        def __len__(self):
            return len(self.store)
        def __getitem__(self, i):
            return self.store[i] * 2

    loader = DataLoader(Images(), batch_size=32, num_workers=4, persistent_workers=True)
    it = iter(loader)
    for _ in range(8):
        next(it)
    print("READY", flush=True)
    import time; time.sleep(300)
"""

# Fields docs/snapshot.md promises in every snapshot.
REQUIRED = {
    "top": {
        "schema", "time", "target", "processes", "memory", "shm", "gpus", "disks", "pressure",
        "processes_without_held_fds",
    },
    "target": {"pid", "cmdline", "alive", "exit_code"},
    "process": {
        "pid", "ppid", "role", "worker_id", "state", "cpu_percent", "num_threads", "rss_bytes",
        "uss_bytes", "pss_bytes", "shmem_bytes", "swap_bytes", "read_bytes", "write_bytes",
        "read_bytes_per_s", "write_bytes_per_s", "gpu_memory_bytes",
    },
    "memory": {
        "total_bytes", "available_bytes", "cgroup_limit_bytes", "cgroup_current_bytes",
        "swap_used_bytes", "rss_sum_bytes", "pss_sum_bytes",
    },
    "shm": {"total_bytes", "used_bytes"},
    "disk": {
        "name", "read_bytes_per_s", "write_bytes_per_s", "util_percent", "r_await_ms", "w_await_ms",
        "queue_depth",
    },
    "pressure": {"io_some_avg10", "io_full_avg10", "memory_some_avg10", "cpu_some_avg10"},
}  # fmt: skip


@pytest.mark.slow
def test_real_dataloader_workers_are_found_and_pss_is_below_the_rss_sum(spawn: Spawn) -> None:
    proc = spawn(DATALOADER_4_WORKERS, timeout=120)
    sampler = Sampler(proc.pid, unlimited_smaps=True)
    sampler.sample()
    time.sleep(0.5)
    snap = sampler.sample()
    workers = snap.workers()
    assert len(workers) == 4
    assert {w.comm for w in workers} == {"pt_data_worker"}
    assert all(w.ppid == proc.pid for w in workers)
    assert snap.processes[0].role == "main" and snap.processes[0].pid == proc.pid
    m = snap.memory
    assert m.pss_missing == 0 and m.pss_sum_bytes is not None and m.rss_sum_bytes is not None
    assert m.pss_sum_bytes < m.rss_sum_bytes  # forked workers share pages RSS counts five times
    assert m.available_bytes is not None and m.total_bytes is not None
    assert snap.gpu.available is False or snap.gpus  # on this machine: no GPU, said so
    sampler.close()


def test_snapshot_json_has_every_documented_field_and_round_trips(spawn: Spawn) -> None:
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(300)')
    sampler = Sampler(proc.pid, unlimited_smaps=True)
    sampler.sample()
    time.sleep(0.2)
    snap = sampler.sample()
    data = json.loads(encode_snapshot(snap))
    assert REQUIRED["top"] <= data.keys()
    assert REQUIRED["target"] <= data["target"].keys()
    assert REQUIRED["process"] <= data["processes"][0].keys()
    assert REQUIRED["memory"] <= data["memory"].keys()
    assert REQUIRED["shm"] <= data["shm"].keys()
    assert REQUIRED["pressure"] <= data["pressure"].keys()
    for disk in data["disks"]:
        assert REQUIRED["disk"] <= disk.keys()
    assert snapshot_from_dict(data) == snap
    assert snapshot_to_dict(snapshot_from_dict(data)) == data


def test_target_exit_is_reported_and_sampling_goes_on(spawn: Spawn) -> None:
    proc = spawn('print("READY", flush=True)\nimport sys; sys.stdin.readline()')
    sampler = Sampler(proc.pid, exit_code=lambda: 7)
    assert sampler.sample().target.alive
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    proc.wait()
    after = sampler.sample()
    assert after.target.alive is False and after.target.exit_code == 7
    assert after.processes == ()
    assert after.memory.available_bytes is not None  # the machine is still described


def test_no_such_process() -> None:
    with pytest.raises(NoSuchProcess):
        Sampler(2**22 + 1)


def test_a_target_seen_gone_gets_its_exit_code_even_when_the_launcher_answers_late() -> None:
    """A SIGKILLed trainer is gone from /proc before its launcher can reap it (or while another
    thread of the launcher is inside wait()): poll() said None for a few ms, the final snapshot
    had no exit code, and the exit verdict lost "the trainer was killed by SIGKILL" (CI)."""
    import signal
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    answers: list[int | None] = [None, None, None]

    def late_exit_code() -> int | None:
        return answers.pop(0) if answers else 128 + signal.SIGKILL

    sampler = Sampler(child.pid, exit_code=late_exit_code)
    try:
        child.kill()
        child.wait()
        s = sampler.sample()
        assert not s.target.alive
        assert s.target.exit_code == 137
    finally:
        sampler.close()


def test_vram_is_given_to_processes_from_fresh_gpu_readings_only() -> None:
    """Review finding 5: a stale device's process list is old; its VRAM is not attributed."""
    from dlmon.collect.sampler import _with_gpu_memory
    from dlmon.model.snapshot import GpuDevice, GpuProcess, ProcessSample

    processes = (ProcessSample(10, 1, 1, "main", "python", "S"), ProcessSample(11, 1, 10, "worker", "w", "S"))
    fresh = GpuDevice(0, "a", "GPU-0", 5, 10, 1.0, processes=(GpuProcess(10, 3),))
    stale = GpuDevice(
        1, "b", "GPU-1", 5, 10, 1.0, processes=(GpuProcess(10, 4), GpuProcess(11, 2)), stale_age_s=6.0
    )
    main, worker = _with_gpu_memory(processes, (fresh, stale))
    assert main.gpu_memory_bytes == 3
    assert worker.gpu_memory_bytes is None


def test_only_the_one_shot_attach_waits_long_for_nvml_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding 6: ``advise`` and the tune runner pass ``unlimited_smaps`` too; their first
    tick must not wait the one-shot attach's 10 s for NVML. Only attach_once asks for that."""
    import os

    from dlmon.collect import sampler as sampler_module
    from dlmon.collect.gpu_sweep import FIRST_DEADLINE_S
    from dlmon.launch import attach

    seen: list[float] = []

    class Sweep:
        def __init__(self, collector: object, *, first_deadline_s: float) -> None:
            seen.append(first_deadline_s)

    monkeypatch.setattr(sampler_module, "GpuSweep", Sweep)
    Sampler(os.getpid(), unlimited_smaps=True)
    assert seen == [FIRST_DEADLINE_S]
    monkeypatch.setattr(
        attach, "open_sampler", lambda pid, **kwargs: seen.append(kwargs["gpu_first_deadline_s"]) or 1 / 0
    )
    with pytest.raises(ZeroDivisionError):
        attach.attach_once(os.getpid(), as_json=True)
    assert (
        seen == [FIRST_DEADLINE_S, attach.ONE_SHOT_GPU_DEADLINE_S]
        and attach.ONE_SHOT_GPU_DEADLINE_S > FIRST_DEADLINE_S
    )


def test_a_live_source_closes_its_sampler_once_sampling_ends() -> None:
    """Review finding 7: the dashboard's source never closed its Sampler, leaving its GPU
    sweep thread (and /proc fds) behind."""
    import os
    import threading

    from dlmon.flow.sources import LiveSource

    closed = threading.Event()
    sampler = Sampler(os.getpid())
    close = sampler.close

    def spy() -> None:
        close()
        closed.set()

    sampler.close = spy  # type: ignore[method-assign]
    ended = threading.Event()
    source = LiveSource(os.getpid(), 0.05, sampler=sampler)
    source.start(lambda snapshot: None, lambda reason: ended.set())
    source.stop()
    assert ended.wait(30) and closed.wait(30)
