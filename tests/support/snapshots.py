"""Synthetic snapshots for the analysis tests: every required field, sensible defaults."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from dlmon.model import (
    CgroupMemory,
    DiskSample,
    GpuDevice,
    GpuProcess,
    GpuStatus,
    LoaderSample,
    MemorySummary,
    Pressure,
    ProcessSample,
    ShmSample,
    Snapshot,
    TargetInfo,
    WorkerDeath,
)

MIB = 1024 * 1024
GIB = 1024 * MIB
T0 = 1_700_000_000.0
MAIN_PID = 1000


def proc(
    pid: int,
    role: str = "worker",
    *,
    start_time: int | None = None,
    ppid: int | None = MAIN_PID,
    state: str = "S",
    uss: float | None = None,
    pss: float | None = None,
    rss: float | None = 400 * MIB,
    age: float | None = 0.0,
    cpu: float | None = 5.0,
    threads: int | None = 2,
    nvcsw: float | None = 1.0,
    shmem: float | None = None,
    swap: float | None = 0,
    gpu: float | None = None,
    read_bps: float | None = 0.0,
    worker_id: int | None = None,
) -> ProcessSample:
    comm = {"worker": "pt_data_worker", "main": "python"}.get(role, "sh")
    return ProcessSample(
        pid=pid,
        start_time=start_time if start_time is not None else pid,
        ppid=None if role == "main" else ppid,
        role=role,
        comm=comm,
        state=state,
        worker_id=worker_id,
        cpu_percent=cpu,
        num_threads=threads,
        rss_bytes=None if state == "Z" or rss is None else int(rss),
        rss_anon_bytes=None if state == "Z" or rss is None else int(rss * 0.9),
        uss_bytes=None if uss is None else int(uss),
        pss_bytes=None if pss is None else int(pss),
        pss_age_s=age if pss is not None else None,
        shmem_bytes=None if shmem is None else int(shmem),
        swap_bytes=None if swap is None else int(swap),
        nonvoluntary_ctxt_switches_per_s=nvcsw,
        read_bytes_per_s=read_bps,
        gpu_memory_bytes=None if gpu is None else int(gpu),
    )


def disk(
    name: str = "vda",
    util: float | None = 1.0,
    r_await: float | None = 0.2,
    queue: float | None = 0.01,
    read_bps: float | None = 1e5,
) -> DiskSample:
    return DiskSample(
        name=name,
        reads_per_s=100.0,
        writes_per_s=0.0,
        read_bytes_per_s=read_bps,
        write_bytes_per_s=0.0,
        util_percent=util,
        r_await_ms=r_await,
        w_await_ms=None,
        queue_depth=queue,
    )


def loader(
    *,
    id: str = "L1",
    name: str = "train.py:42",
    pid: int = MAIN_PID,
    num_workers: int | None = 4,
    batch_size: int | None = 64,
    prefetch_factor: int | None = 2,
    pin_memory: bool | None = False,
    persistent_workers: bool | None = True,
    wait: float | None = 0.01,
    worker_pids: Sequence[int] = (),
) -> LoaderSample:
    return LoaderSample(
        id=id,
        name=name,
        pid=pid,
        num_workers=num_workers,
        batch_size=batch_size,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor,
        batches_total=100,
        batches_per_s=10.0,
        samples_per_s=640.0,
        data_wait_fraction=wait,
        worker_pids=tuple(worker_pids),
    )


def gpu(
    index: int = 0,
    used: float | None = 4 * GIB,
    total: float | None = 80 * GIB,
    allocated: float | None = None,
    reserved: float | None = None,
    pids: Sequence[int] = (MAIN_PID,),  # the processes NVML lists on it: the job's trainer by default
    peak: float | None = None,
    util: float | None = 90.0,
) -> GpuDevice:
    return GpuDevice(
        index=index,
        name="H100",
        uuid=f"GPU-{index}",
        memory_used_bytes=None if used is None else int(used),
        memory_total_bytes=None if total is None else int(total),
        utilization_percent=util,
        torch_allocated_bytes=None if allocated is None else int(allocated),
        torch_reserved_bytes=None if reserved is None else int(reserved),
        torch_peak_allocated_bytes=None if peak is None else int(peak),
        processes=tuple(GpuProcess(pid, None) for pid in pids),
    )


def snap(
    t: float,
    processes: Iterable[ProcessSample] = (),
    *,
    pid: int = MAIN_PID,
    alive: bool = True,
    interval: float | None = 1.0,
    total: float = 24 * GIB,
    available: float | None = 20 * GIB,
    cgroup_limit: float | None = None,
    cgroup_current: float | None = None,
    cgroup_oom: int | None = None,
    oom: int | None = 0,
    swap_used: float | None = 0,
    shm: tuple[float, float] | None = (12 * GIB, 12 * GIB),  # (total, available)
    disks: Iterable[DiskSample] = (),
    pressure: Pressure | None = None,
    loaders: Iterable[LoaderSample] = (),
    deaths: Iterable[WorkerDeath] = (),
    gpus: Iterable[GpuDevice] = (),
) -> Snapshot:
    procs = tuple(processes)
    if not any(p.role == "main" for p in procs) and alive:
        procs = (proc(pid, "main", uss=300 * MIB, pss=350 * MIB), *procs)
    rss = [p.rss_bytes for p in procs if p.rss_bytes is not None]
    pss = [p.pss_bytes for p in procs if p.pss_bytes is not None]
    uss = [p.uss_bytes for p in procs if p.uss_bytes is not None]
    cgroup = (
        CgroupMemory(
            version=1,
            path="/test",
            limit_bytes=None if cgroup_limit is None else int(cgroup_limit),
            current_bytes=None if cgroup_current is None else int(cgroup_current),
            oom_kill_count=cgroup_oom,
        )
        if cgroup_limit is not None or cgroup_current is not None or cgroup_oom is not None
        else None
    )
    return Snapshot(
        time=T0 + t,
        interval_s=interval,
        host="test",
        target=TargetInfo(pid=pid, start_time=pid, cmdline="python train.py", alive=alive),
        processes=procs,
        memory=MemorySummary(
            total_bytes=int(total),
            available_bytes=None if available is None else int(available),
            used_bytes=None if available is None else int(total - available),
            shmem_bytes=0,
            dirty_bytes=0,
            swap_total_bytes=8 * GIB,
            swap_used_bytes=None if swap_used is None else int(swap_used),
            cgroup_limit_bytes=None if cgroup_limit is None else int(cgroup_limit),
            cgroup_current_bytes=None if cgroup_current is None else int(cgroup_current),
            rss_sum_bytes=sum(rss) if rss else None,
            pss_sum_bytes=sum(pss) if pss else None,
            uss_sum_bytes=sum(uss) if uss else None,
            pss_missing=sum(1 for p in procs if p.pss_bytes is None and p.state != "Z"),
            oom_kill_count=oom,
        ),
        shm=None if shm is None else ShmSample("/dev/shm", int(shm[0]), int(shm[0] - shm[1]), int(shm[1])),
        gpu=GpuStatus(available=bool(tuple(gpus)), reason=None),
        gpus=tuple(gpus),
        disks=tuple(disks),
        pressure=pressure,
        cgroup=cgroup,
        loaders=tuple(loaders),
        worker_deaths=tuple(deaths),
    )


Curve = Callable[[int, float], float]  # (process index, time of the reading) -> USS bytes


def memory_history(duration_s: float, worker_uss: Curve, **kwargs: object) -> list[Snapshot]:
    """A job whose PSS/USS are read on a budget: see :func:`memory_snapshots`."""
    return list(memory_snapshots(duration_s, worker_uss, **kwargs))  # type: ignore[arg-type]


def memory_snapshots(
    duration_s: float,
    worker_uss: Curve,
    *,
    workers: int = 4,
    interval: float = 1.0,
    refresh_s: float = 10.0,
    main_uss: Curve | None = None,
    shared: float = 400 * MIB,
    rss: float = 419 * MIB,
    **snap_kwargs: object,
) -> Iterator[Snapshot]:
    """A job whose PSS/USS are read on a budget: process i is re-read every ``refresh_s``
    (staggered), so between reads each snapshot repeats the old value with a growing age."""
    n = workers + 1
    ticks = int(duration_s / interval) + 1
    for k in range(ticks):
        t = k * interval
        procs = []
        for i in range(n):
            offset = (i * refresh_s / n) % refresh_s
            read_at = math.floor((t - offset) / refresh_s) * refresh_s + offset
            if read_at < 0:
                read_at = 0.0
            if i == 0:
                u = main_uss(0, read_at) if main_uss else 300 * MIB
                procs.append(
                    proc(MAIN_PID, "main", uss=u, pss=u + shared / n, rss=rss + 200 * MIB, age=t - read_at)
                )
            else:
                u = worker_uss(i - 1, read_at)
                procs.append(
                    proc(
                        MAIN_PID + i,
                        "worker",
                        uss=u,
                        pss=u + shared / n,
                        rss=rss,
                        age=t - read_at,
                        worker_id=i - 1,
                    )
                )
        yield snap(t, procs, interval=interval if k else None, **snap_kwargs)  # type: ignore[arg-type]


def copy_on_read_history(
    duration_s: float,
    *,
    workers: int = 4,
    store: float = 2 * GIB,
    untouched: float = 1 * GIB,
    tau_s: float = 120.0,
    main_private: float = 300 * MIB,
    worker_private: float = 50 * MIB,
    libraries: float = 100 * MIB,
    refresh_s: float = 10.0,
    cgroup_room: float | None = None,
    generations_s: float | None = None,
    kept_per_generation: float = 0.0,
    **snap_kwargs: object,
) -> list[Snapshot]:
    """A trainer whose Python-object ``store`` its workers copy on read, page by page: a share
    1 - exp(-t/τ) of it is copied by every worker at time t (since their fork); ``untouched``
    anonymous pages (torch's own heap) stay shared for good. Every figure is what smaps_rollup
    would give: Pss_Anon, Pss_File, Anonymous, USS. The true level where the job's anonymous PSS
    stops is main_private + workers * worker_private + untouched + (workers + 1) * store.
    ``cgroup_room``: a v1 cgroup whose limit is the job's first working set plus this.
    ``generations_s``: persistent_workers=False: new workers (new pids) every that many seconds,
    which start copying from nothing again; ``kept_per_generation``: the trainer keeps that much
    more at each restart (a staircase under the sawtooth)."""
    n = workers + 1
    out: list[Snapshot] = []
    limit: float | None = None
    for k in range(int(duration_s) + 1):
        t = float(k)
        gen = int(t // generations_s) if generations_s else 0
        born = gen * generations_s if generations_s else 0.0
        procs: list[ProcessSample] = []
        for i in range(n):
            offset = (i * refresh_s / n) % refresh_s
            read_at = max(0.0, math.floor((t - offset) / refresh_s) * refresh_s + offset)
            if generations_s and i and read_at < born:
                read_at = born  # a new worker is read at its start
            copied = 1.0 - math.exp(-max(0.0, read_at - born) / tau_s)
            shared = untouched / n + (1.0 - copied) * store / n
            kept = gen * kept_per_generation if i == 0 else 0.0
            private = (main_private + kept if i == 0 else worker_private) + copied * store
            pss_anon = private + shared
            anonymous = private + untouched + (1.0 - copied) * store
            base = proc(
                MAIN_PID + (i + gen * 100 if i else 0),
                "main" if i == 0 else "worker",
                uss=private,
                pss=pss_anon + libraries / n,
                rss=anonymous + libraries,
                age=t - read_at,
                worker_id=None if i == 0 else i - 1,
            )
            procs.append(
                dataclasses.replace(
                    base,
                    start_time=base.pid,
                    rss_anon_bytes=int(anonymous),
                    pss_anon_bytes=int(pss_anon),
                    pss_file_bytes=int(libraries / n),
                    anonymous_bytes=int(anonymous),
                )
            )
        used = float(sum(p.pss_bytes or 0 for p in procs))
        if cgroup_room is not None and limit is None:
            limit = used + cgroup_room
        extra: dict[str, object] = dict(snap_kwargs)
        if limit is not None:
            extra.update(cgroup_limit=limit, cgroup_current=used)
        out.append(snap(t, procs, interval=1.0 if k else None, **extra))  # type: ignore[arg-type]
    return out


def after_startup(
    history: Sequence[Snapshot], seconds: int = 20, trainer: float = 300 * MIB
) -> list[Snapshot]:
    """``history`` shifted ``seconds`` later, after the trainer's own start-up as ``dlmon run``
    sees it: the trainer alone (python and torch imported, the dataset being built) at a flat
    ``trainer`` bytes, no workers and no loader yet; the machine and cgroup as in ``history[0]``."""
    first = history[0]
    main = proc(MAIN_PID, "main", uss=trainer, pss=trainer, rss=trainer)
    main = dataclasses.replace(
        main, pss_anon_bytes=int(trainer), pss_file_bytes=0, anonymous_bytes=int(trainer)
    )
    cgroup = first.cgroup and dataclasses.replace(first.cgroup, current_bytes=int(trainer))
    memory = dataclasses.replace(
        first.memory,
        cgroup_current_bytes=None if first.memory.cgroup_current_bytes is None else int(trainer),
    )
    startup = [
        dataclasses.replace(
            first,
            time=T0 + k,
            interval_s=1.0 if k else None,
            processes=(main,),
            loaders=(),
            cgroup=cgroup,
            memory=memory,
        )
        for k in range(seconds)
    ]
    return startup + [dataclasses.replace(s, time=s.time + seconds, interval_s=1.0) for s in history]


def respawning_history(
    duration_s: float,
    *,
    epoch_s: float = 2.0,
    workers: int = 2,
    trainer: Callable[[float], float] = lambda t: 400 * MIB,
    training_from_s: float = 0.0,
    interval: float = 0.5,
    refresh_s: float = 10.0,
    worker_ids: bool = True,
) -> list[Snapshot]:
    """A trainer whose DataLoader workers die and respawn every ``epoch_s`` (persistent_workers=
    False), from ``training_from_s`` on. ``trainer(t)``: its RssAnon at t. Each worker is forked
    from it, so its RssAnon counts the trainer's copy-on-write pages whole (plus 20 MiB of its
    own); a worker lives less than ``refresh_s`` and is never read for PSS (as on a real budget),
    and the last quarter of each epoch has no workers (the old ones gone, the new not forked yet).
    The trainer's PSS is read every ``refresh_s``. Without ``worker_ids`` (no agent) the workers'
    ids are unknown, so are their restarts."""
    out: list[Snapshot] = []
    for k in range(int(duration_s / interval) + 1):
        t = k * interval
        read_at = math.floor(t / refresh_s) * refresh_s
        anon = trainer(t)
        main = proc(MAIN_PID, "main", uss=trainer(read_at), pss=trainer(read_at), rss=anon, age=t - read_at)
        procs = [dataclasses.replace(main, rss_anon_bytes=int(anon))]
        gen = int((t - training_from_s) // epoch_s)
        into = (t - training_from_s) - gen * epoch_s
        if t >= training_from_s and into < 0.75 * epoch_s:
            for i in range(workers):
                pid = MAIN_PID + 1 + gen * workers + i
                w = proc(pid, rss=anon + 20 * MIB, age=None, worker_id=i if worker_ids else None)
                procs.append(dataclasses.replace(w, rss_anon_bytes=int(anon + 20 * MIB)))
        out.append(snap(t, procs, interval=interval if k else None))
    return out


def trainer_history(
    duration_s: float,
    *,
    trainer: Callable[[float], float],
    training_from_s: float = 10.0,
    workers: int = 4,
    interval: float = 1.0,
    refresh_s: float = 10.0,
) -> list[Snapshot]:
    """A trainer whose RssAnon is ``trainer(t)``, with ``workers`` persistent DataLoader workers
    (flat, read for PSS every ``refresh_s`` like the trainer) from ``training_from_s`` on."""
    out: list[Snapshot] = []
    for k in range(int(duration_s / interval) + 1):
        t = k * interval
        read_at = math.floor(t / refresh_s) * refresh_s
        anon = trainer(t)
        main = proc(MAIN_PID, "main", uss=trainer(read_at), pss=trainer(read_at), rss=anon, age=t - read_at)
        procs = [dataclasses.replace(main, rss_anon_bytes=int(anon))]
        if t >= training_from_s:
            procs += [
                proc(MAIN_PID + 1 + i, uss=50 * MIB, pss=150 * MIB, age=t - read_at, worker_id=i)
                for i in range(workers)
            ]
        out.append(snap(t, procs, interval=interval if k else None))
    return out
