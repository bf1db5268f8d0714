"""One call, one Snapshot: the process tree, the machine, the cgroup, the disks and the GPUs."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from dlmon.collect.agent_client import AgentClient, AgentReading, merge_torch_memory
from dlmon.collect.cgroup import CgroupMemoryReader, UsableCores
from dlmon.collect.disks import DiskStatsReader
from dlmon.collect.gpu import GpuCollector
from dlmon.collect.gpu_holders import DeviceHolders, with_other_processes
from dlmon.collect.gpu_sweep import DEFAULT_DEADLINE_S, FIRST_DEADLINE_S, GpuSource, GpuSweep
from dlmon.collect.kernel import KernelLog
from dlmon.collect.processes import ProcessTracker
from dlmon.collect.procfs import CLOCK_TICKS, boot_time, read_cmdline
from dlmon.collect.shm_usage import JobShm
from dlmon.collect.smaps_budget import BudgetPolicy, SmapsBudget
from dlmon.collect.stacks import StallProbe
from dlmon.collect.system import read_meminfo, read_oom_kill_count, read_pressure, read_shm
from dlmon.model import (
    GpuDevice,
    MemorySummary,
    ProcessSample,
    RankInfo,
    Snapshot,
    TargetInfo,
)
from dlmon.model.format import DEAD_STATES

ExitCodeProvider = Callable[[], "int | None"]


@dataclass(frozen=True, slots=True)
class TickCost:
    """CPU seconds of the sampler thread in one ``Sampler.sample()``, by part
    (benchmarks/sampler.py prints it; the whole is what the budget covers). ``gpu`` is the CPU
    of the GPU thread's sweep that finished for this tick; ``gpu_wall`` what the tick waited for
    it, at most the sweep's deadline."""

    reads: float  # stat of every process; status and io of those that moved
    discovery: float  # children files, thread lists
    fds: float  # fd directory listings
    smaps: float  # smaps_rollup reads (the budgeted part)
    build_processes: float  # ProcessSample objects
    gpu: float  # NVML
    agent: float  # polls of the in-process agents
    system: float  # meminfo, cgroup, shm, disks, PSI, vmstat
    build_snapshot: float  # merging and the Snapshot
    total: float
    gpu_wall: float = 0.0  # seconds of wall time the sampler waited for NVML


class NoSuchProcess(Exception):
    """The pid to watch does not exist."""


class Sampler:
    """Builds Snapshots of one target. Owned by one thread; keeps state between calls for rates.

    ``unlimited_smaps`` reads PSS/USS of every process on every call (``--once``); otherwise
    they are refreshed under the CPU budget of ``policy``. ``gpu_first_deadline_s`` is how long
    the first tick waits for NVML's start (the one-shot attach waits longer: its one reading is
    the whole output; a watch, ``advise`` or a tune trial must not freeze that long).
    """

    def __init__(
        self,
        pid: int,
        *,
        policy: BudgetPolicy | None = None,
        unlimited_smaps: bool = False,
        gpu: GpuCollector | None = None,
        gpu_source: GpuSource | None = None,
        gpu_first_deadline_s: float = FIRST_DEADLINE_S,
        exit_code: ExitCodeProvider | None = None,
        agent: AgentClient | None = None,
        proc_root: str = "/proc",
        sys_root: str = "/sys",
        dev_root: str = "/dev",
    ) -> None:
        from dlmon.collect.procfs import ProcessGone

        try:
            self.processes = ProcessTracker(
                pid, SmapsBudget(policy, unlimited=unlimited_smaps), proc_root=proc_root
            )
        except ProcessGone as exc:
            raise NoSuchProcess(f"no such process: {pid}") from exc
        self.pid = pid
        self.proc_root = proc_root
        self._holders = DeviceHolders(proc_root, dev_root)
        self.cmdline = read_cmdline(pid, proc_root)
        self.host = socket.gethostname()
        try:
            self.start_unix_time: float | None = (
                boot_time(proc_root) + self.processes.target_identity[1] / CLOCK_TICKS
            )
        except (OSError, RuntimeError):
            self.start_unix_time = None
        self._cgroup = CgroupMemoryReader(pid, proc_root=proc_root)
        self._cores = UsableCores(pid, proc_root=proc_root)
        self._disks = DiskStatsReader(proc_root=proc_root, sys_root=sys_root)
        if gpu_source is not None:  # shared with other jobs' samplers (export --all-jobs)
            self._gpu: GpuSource = gpu_source
        else:
            collector = gpu if gpu is not None else GpuCollector(slow_device_s=DEFAULT_DEADLINE_S)
            self._gpu = GpuSweep(collector, first_deadline_s=gpu_first_deadline_s)
        self._agent = agent if agent is not None else AgentClient()
        self._exit_code = exit_code
        self._exit_retried = False
        self._last_time: float | None = None
        self._ranks: dict[tuple[int, int], tuple[int, int | None, int | None]] = {}
        self.last_cost: TickCost | None = None
        self._kernel = KernelLog()
        self._job_shm = JobShm(proc_root)
        self._stall = StallProbe(self._agent)

    def _dead_exit_code(self) -> int | None:
        """The exit code of a target seen gone. It is not reapable yet while its other threads
        are still exiting (or while the launcher's own ``wait()`` holds the lock), and ``poll()``
        then answers None for a few ms: a final snapshot without the code lost "the trainer was
        killed by SIGKILL" from the exit verdict (CI). Up to 1 s of retries, once per sampler."""
        if self._exit_code is None:
            return None
        tries = 1 if self._exit_retried else 20  # waited once: the orphan watch's ticks never wait
        self._exit_retried = True
        for _ in range(tries):
            code = self._exit_code()
            if code is not None:
                return code
            time.sleep(0.05)
        return None

    def sample(self) -> Snapshot:
        cpu_start = time.thread_time()
        now = time.monotonic()
        wall = time.time()
        processes = self.processes.sample()
        target_state = self.processes.last_target_state
        alive = target_state is not None and target_state not in ("Z", "X")
        t_gpu = time.thread_time()
        gpu = self._gpu.sample()  # on the GPU thread; CPU counted from its sweep
        gpu_status, gpus = gpu.status, gpu.devices
        if any(g.unattributed_processes for g in gpus):  # a container: NVML's pids are the host's
            live_pids = [p.pid for p in processes if p.state not in DEAD_STATES]
            holders = self._holders.read(live_pids)
            if holders is not None:  # else no GPU's processes are certainly not the job's
                gpus = with_other_processes(gpus, holders)
        processes = _with_gpu_memory(processes, gpus)
        t_agent = time.thread_time()
        # Agents serve in the trainer and its Python children (ranks), never in workers.
        reading = self._agent.poll(
            [p.pid for p in processes if p.role != "worker" and p.state not in ("Z", "X")]
        )
        t_system = time.thread_time()
        meminfo = read_meminfo(self.proc_root)
        cgroup = self._cgroup.read()
        shm = read_shm(self.pid if alive else None, self.proc_root)
        disks = self._disks.sample()  # timed at its own read, not at the tick start
        pressure = read_pressure(f"{self.proc_root}/pressure")
        oom_kill_count = read_oom_kill_count(self.proc_root)
        target_cores = self._cores.read() if alive else None
        shm = self._job_shm.attach(shm, self.pid, (p.pid for p in processes))
        kernel_events = self._kernel.sample([self.pid, *(p.pid for p in processes)])
        stacks = self._stall.probe(reading, processes)
        t_build = time.thread_time()
        if reading is not None:
            processes = _with_agent_identity(processes, reading)
            gpus = merge_torch_memory(gpus, reading)
        processes = keep_ranks(processes, self._ranks)
        self._remember_identity(reading)
        rss = [p.rss_bytes for p in processes if p.rss_bytes is not None]
        pss = [p.pss_bytes for p in processes if p.pss_bytes is not None]
        uss = [p.uss_bytes for p in processes if p.uss_bytes is not None]
        live = [p for p in processes if p.state not in ("Z", "X")]
        total, available = meminfo.total_bytes, meminfo.available_bytes
        memory = MemorySummary(
            total_bytes=total,
            available_bytes=available,
            used_bytes=None if total is None or available is None else total - available,
            shmem_bytes=meminfo.shmem_bytes,
            dirty_bytes=meminfo.dirty_bytes,
            swap_total_bytes=meminfo.swap_total_bytes,
            swap_used_bytes=(
                None
                if meminfo.swap_total_bytes is None or meminfo.swap_free_bytes is None
                else meminfo.swap_total_bytes - meminfo.swap_free_bytes
            ),
            cgroup_limit_bytes=cgroup.limit_bytes if cgroup else None,
            cgroup_current_bytes=cgroup.current_bytes if cgroup else None,
            rss_sum_bytes=sum(rss) if rss else None,
            pss_sum_bytes=sum(pss) if pss else None,
            uss_sum_bytes=sum(uss) if uss else None,
            pss_missing=sum(1 for p in live if p.pss_bytes is None),
            oom_kill_count=oom_kill_count,
            cgroup_working_set_bytes=cgroup.working_set_bytes if cgroup else None,
            cgroup_cache_bytes=cgroup.cache_bytes if cgroup else None,
            cgroup_unavailable=None if cgroup else self._cgroup.reason,
            pss_anon_sum_bytes=_sum_if_all(
                None if p.pss_bytes is None or p.pss_file_bytes is None else p.pss_bytes - p.pss_file_bytes
                for p in live
                if p.pss_bytes is not None
            ),
            pss_file_sum_bytes=_sum_if_all(p.pss_file_bytes for p in live if p.pss_bytes is not None),
        )
        snapshot = Snapshot(
            time=wall,
            interval_s=None if self._last_time is None else round(now - self._last_time, 6),
            host=self.host,
            target=TargetInfo(
                pid=self.pid,
                start_time=self.processes.target_identity[1],
                cmdline=self.cmdline,
                alive=alive,
                exit_code=None if alive else self._dead_exit_code(),
                start_unix_time=self.start_unix_time,
            ),
            processes=processes,
            memory=memory,
            shm=shm,
            gpu=gpu_status,
            gpus=gpus,
            disks=disks,
            pressure=pressure,
            cgroup=cgroup,
            loaders=reading.loaders if reading else (),
            pinned=reading.pinned if reading else None,
            agent_loaded_unix_time=max(reading.injected.values()) if reading and reading.injected else None,
            agent_note=self._agent.note(),
            worker_deaths=self._agent.known_deaths(),
            exceptions=self._agent.known_exceptions(),
            kernel_events=kernel_events,
            stacks=stacks,
            processes_without_held_fds=self.processes.without_held_fds,
            target_cores=target_cores,
            rotation_ticks=self.processes.rotation,
            processes_in_rotation=self.processes.rotated_last_tick,
        )
        end = time.thread_time()
        part = self.processes.cost
        self.last_cost = TickCost(
            reads=part.reads,
            discovery=part.discovery,
            fds=part.fds,
            smaps=part.smaps,
            build_processes=part.build,
            gpu=t_agent - t_gpu + gpu.cpu_s,
            agent=t_system - t_agent,
            system=t_build - t_system,
            build_snapshot=end - t_build + (t_gpu - cpu_start - part.total()),
            total=end - cpu_start + gpu.cpu_s,
            gpu_wall=gpu.wall_s,
        )
        if self._last_time is not None:
            # The budget covers the whole thread: smaps reads get what everything else left.
            cheap_cpu = end - cpu_start + gpu.cpu_s - self.processes.smaps_cpu_last_tick
            self.processes.record_tick_cost(cheap_cpu, now - self._last_time)
        self._last_time = now
        return snapshot

    def _remember_identity(self, reading: AgentReading | None) -> None:
        """The agent's worker ids and thread counts, for the tracker to build next tick's rows
        with (a row rebuilt for them costs as much as reading the process)."""
        if reading is None:
            self.processes.worker_hints = self.processes.thread_hints = {}
            return
        self.processes.worker_hints = {
            pid: index for loader in reading.loaders for index, pid in enumerate(loader.worker_pids)
        }
        self.processes.thread_hints = dict(reading.num_threads)

    def close(self) -> None:
        self.processes.close()
        self._gpu.close()
        self._kernel.close()


def _sum_if_all(values: Iterable[int | None]) -> int | None:
    """The sum, or None when any value is unknown (an old kernel without the smaps split)."""
    total = 0
    seen = False
    for v in values:
        if v is None:
            return None
        total, seen = total + v, True
    return total if seen else None


def _with_gpu_memory(
    processes: tuple[ProcessSample, ...], gpus: tuple[GpuDevice, ...]
) -> tuple[ProcessSample, ...]:
    """Each process's VRAM summed over devices, from NVML's per-process list. A stale device's
    list is left out: it is old, and the process may since have exited or freed that memory (the
    orphan alert would say an orphan holds it)."""
    used: dict[int, int] = {}
    for device in gpus:
        if device.stale_age_s is not None:
            continue
        for proc in device.processes:
            if proc.used_memory_bytes is not None:
                used[proc.pid] = used.get(proc.pid, 0) + proc.used_memory_bytes
    if not used:
        return processes
    from dataclasses import replace

    return tuple(replace(p, gpu_memory_bytes=used[p.pid]) if p.pid in used else p for p in processes)


def _with_agent_identity(
    processes: tuple[ProcessSample, ...], reading: AgentReading
) -> tuple[ProcessSample, ...]:
    """Worker ids from the loaders' worker pid lists (in worker-id order); torch threads per process.

    A pid the agent lists as a worker is a worker even before it renamed itself.
    """
    from dataclasses import replace

    worker_ids = {pid: index for loader in reading.loaders for index, pid in enumerate(loader.worker_pids)}
    threads = reading.num_threads
    ranks = _ranks_of(processes, reading)
    if not worker_ids and not threads and not ranks:
        return processes
    out = []
    for p in processes:
        worker_id = worker_ids.get(p.pid)
        torch_threads = threads.get(p.pid, p.torch_threads)
        if worker_id is not None and (p.worker_id != worker_id or p.role != "worker"):
            p = replace(p, worker_id=worker_id, role="worker")
        if p.torch_threads != torch_threads:
            p = replace(p, torch_threads=torch_threads)
        rank = ranks.get(p.pid)
        if rank is not None and p.rank != rank.rank:
            p = replace(p, rank=rank.rank, local_rank=rank.local_rank, node_rank=rank.node_rank)
        out.append(p)
    return tuple(out)


def _ranks_of(processes: tuple[ProcessSample, ...], reading: AgentReading) -> dict[int, RankInfo]:
    """pid -> rank: the processes whose agent said so, and the workers of their loaders (or their
    children), which inherit their trainer's rank."""
    if not reading.ranks:
        return {}
    ranks = dict(reading.ranks)
    for p in processes:  # the parent is the truth; a loader's pid list can name a dead worker's reused pid
        if p.role == "worker" and p.ppid is not None and p.ppid in reading.ranks:
            ranks.setdefault(p.pid, reading.ranks[p.ppid])
    for loader in reading.loaders:
        rank = reading.ranks.get(loader.pid)
        if rank is not None:
            for pid in loader.worker_pids:
                ranks.setdefault(pid, rank)
    return ranks


def keep_ranks(
    processes: tuple[ProcessSample, ...], known: dict[tuple[int, int], tuple[int, int | None, int | None]]
) -> tuple[ProcessSample, ...]:
    """A process's rank never changes (its agent reads it once): one tick without its agent's
    reply (a timeout under load) keeps the rank it had, so its Prometheus series keep their labels
    and ``--rank`` keeps hiding it. ``known`` ((pid, start_time) -> rank) is updated in place."""
    from dataclasses import replace

    out = []
    for p in processes:
        key = (p.pid, p.start_time)
        if p.rank is not None:
            known[key] = (p.rank, p.local_rank, p.node_rank)
        elif key in known:
            rank, local_rank, node_rank = known[key]
            p = replace(p, rank=rank, local_rank=local_rank, node_rank=node_rank)
        out.append(p)
    live = {(p.pid, p.start_time) for p in processes}
    for key in [k for k in known if k not in live]:
        del known[key]
    return tuple(out)
