"""The dashboard tests' job: a realistic Snapshot at a fixed time, built by
:func:`support.snapshots.snap` (the one way a test snapshot is made) with a real machine's figures
(a cgroup v2 limit, an NVMe disk, pinned memory, an alert); and a source with no thread.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from types import MappingProxyType

from dlmon.flow.sources import EndSink, SnapshotSink
from dlmon.model import (
    Alert,
    CgroupMemory,
    DiskSample,
    GpuDevice,
    GpuProcess,
    GpuStatus,
    LoaderSample,
    MemorySummary,
    PinnedMemory,
    Pressure,
    ProcessSample,
    ShmSample,
    Snapshot,
    TargetInfo,
)
from support.snapshots import T0 as SNAP_T0
from support.snapshots import snap

GiB = 1024**3
MiB = 1024**2
T0 = 1_764_460_800.0  # 2025-11-30 00:00:00 UTC: every test snapshot is at a fixed time
BOOT = T0 - 86_400.0
CLOCK_TICKS = 100
MAIN_PID = 4242
WORKER_PIDS = (4250, 4251, 4252, 4253)
ZOMBIE_PID = WORKER_PIDS[3]
CMDLINE = "python train.py --epochs 90 --batch-size 64 --data /data/imagenet"
NO_GPU_REASON = "NVML not available: libnvidia-ml.so.1 not found (no NVIDIA driver here)"


def fixed_clock() -> float:
    return T0 + 0.5


def _proc(
    pid: int,
    role: str,
    *,
    worker_id: int | None,
    t: float,
    rss: int,
    uss: int,
    pss: int,
    cpu: float,
    read: float,
    state: str = "S",
    pss_age: float = 0.5,
    gpu: int | None = None,
) -> ProcessSample:
    return ProcessSample(
        pid=pid,
        start_time=int((T0 - 3720 - BOOT) * CLOCK_TICKS) + pid,
        ppid=MAIN_PID if role == "worker" else 1,
        role=role,
        comm="pt_data_worker" if role == "worker" else "python",
        state=state,
        worker_id=worker_id,
        cpu_percent=cpu,
        num_threads=1 if role == "worker" else 24,
        rss_bytes=rss,
        rss_anon_bytes=rss // 3,
        rss_file_bytes=rss // 3,
        shmem_bytes=rss // 3,
        uss_bytes=uss,
        pss_bytes=pss,
        pss_shmem_bytes=pss // 4,
        swap_bytes=0,
        pss_age_s=pss_age,
        locked_bytes=0,
        pinned_bytes=0,
        read_bytes=int(read * 1000),
        write_bytes=0,
        read_bytes_per_s=read,
        write_bytes_per_s=0.0,
        voluntary_ctxt_switches=1000,
        nonvoluntary_ctxt_switches=50,
        nonvoluntary_ctxt_switches_per_s=3.0,
        num_fds=40,
        gpu_memory_bytes=gpu,
    )


def make_snapshot(
    t: float = T0,
    *,
    gpus: int = 0,
    alive: bool = True,
    exit_code: int | None = None,
    growth_per_s: float = 200 * 1024,
    loaders: bool = True,
    alerts: bool = True,
    interval: float = 1.0,
    workers: int = 4,
    zombie: bool = True,
) -> Snapshot:
    """A main + ``workers`` workers (the last one a zombie), a cgroup limit, one disk, a loader,
    an alert, and no GPU (or ``gpus`` devices). Memory grows by ``growth_per_s`` in the main."""
    dt = t - T0
    wave = math.sin(dt / 30.0)
    main_rss = int(6 * GiB + growth_per_s * dt)
    procs = [
        _proc(
            MAIN_PID,
            "main",
            worker_id=None,
            t=t,
            rss=main_rss,
            uss=int(3 * GiB + growth_per_s * dt),
            pss=int(4 * GiB + growth_per_s * dt),
            cpu=97.0 + 2 * wave,
            read=2.0e6,
            gpu=int(20.5 * GiB) if gpus else None,
        )
    ]
    pids = WORKER_PIDS[:workers] if workers <= len(WORKER_PIDS) else range(4250, 4250 + workers)
    for i, pid in enumerate(pids):
        is_zombie = zombie and i == len(pids) - 1
        if is_zombie:
            procs.append(
                ProcessSample(
                    pid=pid,
                    start_time=int((T0 - 3700 - BOOT) * CLOCK_TICKS),
                    ppid=MAIN_PID,
                    role="worker",
                    comm="pt_data_worker",
                    state="Z",
                    worker_id=i,
                    cpu_percent=0.0,
                    unavailable=MappingProxyType({"memory": "zombie", "smaps": "zombie"}),
                )
            )
            continue
        procs.append(
            _proc(
                pid,
                "worker",
                worker_id=i,
                t=t,
                rss=int(5.8 * GiB + i * 40 * MiB),
                uss=int(180 * MiB + i * 12 * MiB),
                pss=int(1.1 * GiB + i * 20 * MiB),
                cpu=42.0 + 7 * i + 3 * wave,
                read=(31.0 + 4 * i) * 1e6,
                state="D" if i == 1 else "S",
                pss_age=48.0 if i == 2 else 0.7,
                gpu=int(0.5 * GiB) if gpus else None,
            )
        )
    rss_sum = sum(p.rss_bytes or 0 for p in procs)
    pss_sum = sum(p.pss_bytes or 0 for p in procs)
    uss_sum = sum(p.uss_bytes or 0 for p in procs)
    limit = 16 * GiB
    current = int(pss_sum + 1.2 * GiB)
    memory = MemorySummary(
        total_bytes=64 * GiB,
        available_bytes=int(64 * GiB - current - 8 * GiB),
        used_bytes=int(current + 8 * GiB),
        shmem_bytes=int(2.1 * GiB),
        dirty_bytes=12 * MiB,
        swap_total_bytes=4 * GiB,
        swap_used_bytes=0,
        cgroup_limit_bytes=limit,
        cgroup_current_bytes=current,
        rss_sum_bytes=rss_sum,
        pss_sum_bytes=pss_sum,
        uss_sum_bytes=uss_sum,
        pss_missing=0,
        oom_kill_count=0,
    )
    devices: tuple[GpuDevice, ...] = ()
    if gpus:
        devices = tuple(
            GpuDevice(
                index=i,
                name="NVIDIA H100 80GB HBM3",
                uuid=f"GPU-0000{i}",
                memory_used_bytes=int((22.1 + 3 * i) * GiB),
                memory_total_bytes=80 * GiB,
                utilization_percent=91.0 - 30 * i if i < 2 else 70.0 + 3 * i,
                processes=(GpuProcess(MAIN_PID, int(20.5 * GiB)), GpuProcess(WORKER_PIDS[0], int(0.5 * GiB))),
                torch_allocated_bytes=int(17.9 * GiB),
                torch_reserved_bytes=int(20.0 * GiB),
                torch_peak_allocated_bytes=int(19.2 * GiB),
            )
            for i in range(gpus)
        )
    loader_list: tuple[LoaderSample, ...] = ()
    if loaders:
        live_workers = WORKER_PIDS[: max(0, workers - 1)]
        loader_list = (
            LoaderSample(
                id="loader-1",
                name="train.py:88",
                pid=MAIN_PID,
                num_workers=workers,
                batch_size=64,
                pin_memory=True,
                persistent_workers=False,
                prefetch_factor=2,
                batches_total=int(12_000 + 9.5 * dt),
                batches_per_s=9.5 + wave,
                samples_per_s=(9.5 + wave) * 64,
                data_wait_fraction=0.34 + 0.05 * wave,
                worker_pids=WORKER_PIDS[:workers],
                batches_per_worker=tuple(4000 + 100 * k for k in range(len(live_workers)))
                + ((0,) if zombie and workers else ()),
            ),
        )
    alert_list: tuple[Alert, ...] = ()
    if alerts:
        alert_list = (
            Alert(
                kind="memory_growth",
                severity="warning",
                subject=f"main (pid {MAIN_PID})",
                message="PSS grew 11.7 MiB/min for 10 min (4.1 GiB -> 4.2 GiB)",
                advice="look for tensors kept across iterations (losses appended without .item())",
                since=T0 - 130.0,
            ),
        )
    base = snap(
        t - SNAP_T0,
        procs,
        pid=MAIN_PID,
        alive=alive,
        interval=interval,
        disks=(
            DiskSample(
                name="nvme0n1",
                reads_per_s=1800.0,
                writes_per_s=12.0,
                read_bytes_per_s=142.3e6,
                write_bytes_per_s=1.1e6,
                util_percent=87.0,
                r_await_ms=3.4,
                w_await_ms=0.8,
                queue_depth=4.2,
            ),
        ),
        pressure=Pressure(io_some_avg10=12.5, io_full_avg10=3.1, memory_some_avg10=0.0),
        loaders=loader_list,
        gpus=devices,
    )
    # the figures snap() leaves generic, as a real GPU box under a cgroup v2 limit gives them
    return dataclasses.replace(
        base,
        time=t,
        host="gpu-box-7",
        target=TargetInfo(
            pid=MAIN_PID,
            start_time=procs[0].start_time,
            cmdline=CMDLINE,
            alive=alive,
            exit_code=exit_code,
        ),
        memory=memory,
        shm=ShmSample(path="/dev/shm", total_bytes=32 * GiB, used_bytes=int(1.4 * GiB), available_bytes=None),
        gpu=GpuStatus(available=bool(gpus), reason=None if gpus else NO_GPU_REASON, driver_version=None),
        cgroup=CgroupMemory(
            version=2, path="/kubepods/pod1", limit_bytes=limit, current_bytes=current, oom_kill_count=0
        ),
        pinned=PinnedMemory(bytes=512 * MiB, source="torch.cuda.host_memory_stats") if gpus else None,
        alerts=alert_list,
    )


RANK_PID0 = 5000  # ranks 5000..; rank r's workers 6000 + 100 r + i


def make_ddp_snapshot(
    t: float = T0, *, gpus: int = 8, disks: int = 6, ranks: int = 8, workers: int = 8, interval: float = 1.0
) -> Snapshot:
    """A DDP job as torchrun runs it: a launcher (main), ``ranks`` rank processes (children with a
    loader each, one GPU each) and ``workers`` workers per rank; ``gpus`` devices, ``disks`` disks."""
    base = make_snapshot(t, gpus=gpus, interval=interval, workers=0, zombie=False, loaders=False)
    dt = t - T0
    wave = math.sin(dt / 30.0)
    launcher = dataclasses.replace(
        base.processes[0],
        comm="torchrun",
        cpu_percent=0.3,
        rss_bytes=90 * MiB,
        uss_bytes=40 * MiB,
        pss_bytes=50 * MiB,
        gpu_memory_bytes=None,
    )
    procs: list[ProcessSample] = [launcher]
    loaders: list[LoaderSample] = []
    for r in range(ranks):
        rank_pid = RANK_PID0 + r
        rank = dataclasses.replace(
            _proc(
                rank_pid,
                "child",
                worker_id=None,
                t=t,
                rss=int(7 * GiB),
                uss=int(3 * GiB),
                pss=int((3.5 + 0.1 * r) * GiB),
                cpu=95.0 - r,
                read=1.0e6,
                gpu=int(20 * GiB) if gpus else None,
            ),
            ppid=MAIN_PID,
        )
        procs.append(rank)
        pids = tuple(6000 + 100 * r + i for i in range(workers))
        for i, pid in enumerate(pids):
            procs.append(
                dataclasses.replace(
                    _proc(
                        pid,
                        "worker",
                        worker_id=i,
                        t=t,
                        rss=int(3 * GiB),
                        uss=int(150 * MiB + i * MiB),
                        pss=int(600 * MiB + r * 10 * MiB),
                        cpu=40.0 + i,
                        read=(10.0 + r) * 1e6,
                    ),
                    ppid=rank_pid,
                )
            )
        rate = 6.0 + r * 0.5 + wave
        loaders.append(
            LoaderSample(
                id=f"loader-r{r}",
                name=f"train.py:88 rank {r}",
                pid=rank_pid,
                num_workers=workers,
                batch_size=32,
                pin_memory=True,
                persistent_workers=True,
                prefetch_factor=2,
                batches_total=int(5000 + rate * dt),
                batches_per_s=rate,
                samples_per_s=rate * 32,
                data_wait_fraction=0.05 + 0.04 * r,
                worker_pids=pids,
                batches_per_worker=tuple(600 + k for k in range(workers)),
            )
        )
    disk_list = tuple(
        dataclasses.replace(
            base.disks[0],
            name=f"nvme{k}n1",
            util_percent=87.0 - 15 * k,
            read_bytes_per_s=(142.3 - 20 * k) * 1e6,
        )
        for k in range(disks)
    )
    pss_sum = sum(p.pss_bytes or 0 for p in procs)
    memory = dataclasses.replace(
        base.memory,
        total_bytes=2 * 1024 * GiB,
        available_bytes=1900 * GiB,
        used_bytes=148 * GiB,
        cgroup_limit_bytes=None,
        cgroup_current_bytes=None,
        pss_sum_bytes=pss_sum,
        rss_sum_bytes=sum(p.rss_bytes or 0 for p in procs),
        uss_sum_bytes=sum(p.uss_bytes or 0 for p in procs),
    )
    return dataclasses.replace(
        base, processes=tuple(procs), loaders=tuple(loaders), disks=disk_list, memory=memory, cgroup=None
    )


def run_of(seconds: float, step: float = 5.0, **kw: object) -> list[Snapshot]:
    """Snapshots every ``step`` seconds over ``seconds``, ending at T0 (charts need a history)."""
    n = int(seconds / step)
    return [make_snapshot(T0 - (n - k) * step, interval=step, **kw) for k in range(n + 1)]  # type: ignore[arg-type]


class FakeSource:
    """A Source with no thread: ``start`` delivers the given snapshots at once, on the caller's
    thread; tests then push more with :meth:`push` and end it with :meth:`end`."""

    def __init__(
        self,
        snapshots: Iterable[Snapshot] = (),
        *,
        live: bool = True,
        log_path: str | None = None,
        description: str = f"{CMDLINE} (pid {MAIN_PID})",
    ) -> None:
        self.snapshots = list(snapshots)
        self._live = live
        self._log_path = log_path
        self._description = description
        self.on_snapshot: SnapshotSink | None = None
        self.on_end: EndSink | None = None
        self.started = 0
        self.stopped = 0

    @property
    def description(self) -> str:
        return self._description

    @property
    def log_path(self) -> str | None:
        return self._log_path

    @property
    def live(self) -> bool:
        return self._live

    def start(self, on_snapshot: SnapshotSink, on_end: EndSink) -> None:
        self.started += 1
        self.on_snapshot = on_snapshot
        self.on_end = on_end
        for snapshot in self.snapshots:
            on_snapshot(snapshot)

    def stop(self) -> None:
        self.stopped += 1

    def push(self, snapshot: Snapshot) -> None:
        assert self.on_snapshot is not None, "the app has not started the source"
        self.on_snapshot(snapshot)

    def end(self, reason: str) -> None:
        assert self.on_end is not None
        self.on_end(reason)
