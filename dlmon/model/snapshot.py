"""The Snapshot: one immutable reading of a training job and the machine around it.

Every field that could not be measured is ``None`` (JSON ``null``), never 0: a zero is a
measurement. Where a whole group of fields is missing for a known reason (permission denied,
a zombie has no address space) the reason is kept in ``unavailable``.

The JSON form (``dlmon.model.serialize``) uses exactly these field names; see docs/snapshot.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

SCHEMA_VERSION = 1

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """One process of the target's tree.

    A process is identified by ``(pid, start_time)``: ``start_time`` is field 22 of
    /proc/PID/stat (clock ticks after boot), so a reused pid is a different process.
    """

    pid: int
    start_time: int
    ppid: int | None
    role: str  # "main" | "worker" | "child"
    comm: str
    state: str  # one letter as in /proc/PID/stat: R S D Z T t X I ...
    worker_id: int | None = None
    cpu_percent: float | None = None
    num_threads: int | None = None
    rss_bytes: int | None = None
    rss_anon_bytes: int | None = None
    rss_file_bytes: int | None = None
    shmem_bytes: int | None = None  # RssShmem: resident shared memory (/dev/shm, torch shared tensors)
    uss_bytes: int | None = None  # Private_Clean + Private_Dirty (+ Private_Hugetlb)
    pss_bytes: int | None = None
    pss_shmem_bytes: int | None = None
    swap_bytes: int | None = None
    pss_age_s: float | None = None  # how old uss/pss/swap are: smaps_rollup is read on a budget
    # /proc/PID/status VmLck: mlock()ed memory; VmPin: long-term pins (RDMA memory regions,
    # io_uring buffers). Neither counts CUDA pinned memory (the driver pins it with
    # pin_user_pages and touches neither counter; cudaHostAlloc memory is RssShmem): that is
    # Snapshot.pinned. The names stay as they are for the records.
    locked_bytes: int | None = None  # VmLck
    pinned_bytes: int | None = None  # VmPin
    read_bytes: int | None = None  # /proc/PID/io read_bytes: bytes that reached the block layer
    write_bytes: int | None = None
    read_bytes_per_s: float | None = None
    write_bytes_per_s: float | None = None
    voluntary_ctxt_switches: int | None = None
    nonvoluntary_ctxt_switches: int | None = None
    nonvoluntary_ctxt_switches_per_s: float | None = None
    major_faults_per_s: float | None = None  # pages read back in from swap or a mapped file (stat majflt)
    num_fds: int | None = None
    gpu_memory_bytes: int | None = None
    torch_threads: int | None = None  # torch.get_num_threads() in this process, from the agent
    unavailable: Mapping[str, str] = field(
        default_factory=lambda: _EMPTY
    )  # group ("io", "smaps", ...) -> reason
    # smaps_rollup's split (Linux >= 5.7, else None), as old as pss_age_s says:
    pss_anon_bytes: int | None = None  # PSS of anonymous pages: heap, copied-on-read objects
    pss_file_bytes: int | None = None  # PSS of file-backed pages: mmapped datasets, libraries
    anonymous_bytes: int | None = None  # anonymous pages resident (shared copy-on-write ones too)
    fd_limit: int | None = None  # RLIMIT_NOFILE soft limit (/proc/PID/limits "Max open files"), read rarely
    # Nothing in the tree faulted a page in, changed RSS, joined or left since the smaps reading
    # (however old): it holds unless a sharer outside the tree moved (collect/smaps_budget.py).
    pss_still: bool = False
    # the distributed rank (torchrun / SLURM environment, from the agent); a worker has its trainer's
    rank: int | None = None
    local_rank: int | None = None
    node_rank: int | None = None


@dataclass(frozen=True, slots=True)
class RankInfo:
    """A process's place in a distributed job, as its launcher's environment says (RANK, ...)."""

    rank: int
    local_rank: int | None = None
    node_rank: int | None = None
    world_size: int | None = None

    def label(self) -> str:
        """``rank 3 (local 1)``; the local rank only where it differs from the rank."""
        local = f" (local {self.local_rank})" if self.local_rank not in (None, self.rank) else ""
        return f"rank {self.rank}{local}"


@dataclass(frozen=True, slots=True)
class TargetInfo:
    pid: int
    start_time: int | None
    cmdline: str
    alive: bool
    exit_code: int | None = None  # known only when dlmon started the target
    start_unix_time: float | None = None  # when the target started, for uptime (also in replays)


@dataclass(frozen=True, slots=True)
class Pressure:
    """PSI averages over 10 s, in percent of wall time (``/proc/pressure/*`` or a cgroup's)."""

    io_some_avg10: float | None = None
    io_full_avg10: float | None = None
    memory_some_avg10: float | None = None
    memory_full_avg10: float | None = None
    cpu_some_avg10: float | None = None


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """The memory cgroup the target lives in; its limit is the one that kills in a container."""

    version: int  # 1 or 2
    path: str
    limit_bytes: int | None  # effective: the smallest limit on the way to the root; None = unlimited
    current_bytes: int | None
    oom_kill_count: int | None
    pressure: Pressure | None = None  # v2 only
    # usage minus inactive_file (v1 total_inactive_file), as the kubelet/cAdvisor compute it:
    # what the kernel cannot simply drop; headroom and ETA are computed from it
    working_set_bytes: int | None = None
    cache_bytes: int | None = None  # page cache charged to the cgroup (v2 file, v1 total_cache)
    inactive_file_bytes: int | None = None  # the part of the cache reclaimed first
    usage_path: str | None = None  # the cgroup whose usage is read: the one that holds the limit


@dataclass(frozen=True, slots=True)
class MemorySummary:
    total_bytes: int | None
    available_bytes: int | None
    used_bytes: int | None  # total - available, as `free` computes it
    shmem_bytes: int | None  # system-wide Shmem
    dirty_bytes: int | None
    swap_total_bytes: int | None
    swap_used_bytes: int | None
    cgroup_limit_bytes: int | None
    cgroup_current_bytes: int | None
    rss_sum_bytes: int | None  # double-counts pages shared by forked workers
    pss_sum_bytes: int | None  # the job's true total; None until at least one PSS was read
    uss_sum_bytes: int | None
    pss_missing: int = 0  # processes in the tree whose PSS is not known (yet)
    oom_kill_count: int | None = None  # /proc/vmstat oom_kill, machine-wide
    cgroup_working_set_bytes: int | None = None  # cgroup usage - inactive_file
    cgroup_cache_bytes: int | None = None  # page cache charged to the cgroup (reclaimable)
    cgroup_unavailable: str | None = None  # why there are no cgroup figures
    pss_anon_sum_bytes: int | None = None  # the job's PSS of anonymous + shmem pages (not files)
    pss_file_sum_bytes: int | None = None  # the job's PSS of file-backed pages (mapped datasets)


@dataclass(frozen=True, slots=True)
class ShmSample:
    path: str  # as seen from the target's mount namespace when readable
    total_bytes: int | None
    used_bytes: int | None
    available_bytes: int | None
    job_segments: int | None = None  # the job's torch_<pid>_* files in it (file_system strategy)
    job_bytes: int | None = None  # ... and the bytes they hold


@dataclass(frozen=True, slots=True)
class DiskSample:
    """One whole disk, with the figures of ``iostat -x`` over the last interval."""

    name: str
    reads_per_s: float | None
    writes_per_s: float | None
    read_bytes_per_s: float | None
    write_bytes_per_s: float | None
    util_percent: float | None
    r_await_ms: float | None
    w_await_ms: float | None
    queue_depth: float | None  # aqu-sz


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int | None
    # NVML's per-process SM utilisation since the previous sweep (mean of its samples): the share
    # of time this process's kernels ran. None: no sample (not reported, or no kernel ran).
    sm_percent: float | None = None


@dataclass(frozen=True, slots=True)
class GpuDevice:
    index: int
    name: str | None
    uuid: str | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization_percent: float | None
    processes: tuple[GpuProcess, ...] = ()
    torch_allocated_bytes: int | None = None  # from the in-process agent
    torch_reserved_bytes: int | None = None
    torch_peak_allocated_bytes: int | None = None
    unavailable_reason: str | None = None  # why figures of this device are missing, e.g. "NVML: GPU is lost"
    # None: read in this tick. Else how old (s) the figures are: NVML did not answer by the tick's
    # deadline (a hung call, a device backed off after one) and the last reading stands in.
    stale_age_s: float | None = None
    # MIG: on a MIG device (a slice of the card ``index``), its index among that card's MIG
    # devices; None on a whole card. ``mig_mode`` is True on a card in MIG mode and on its slices
    # (the card's utilisation is then not reported, and its memory and processes are the slices').
    mig_index: int | None = None
    mig_mode: bool | None = None
    # In a container's pid namespace NVML's pids are the host's and match no pid dlmon sees: the
    # processes NVML lists here are counted instead of listed, with their VRAM (None on the host,
    # where ``processes`` has them). ``other_processes``: how many of those are certainly not
    # the job's (more than the job's processes holding /dev/nvidiaN open); None: not known.
    unattributed_processes: int | None = None
    unattributed_memory_bytes: int | None = None
    other_processes: int | None = None
    minor_number: int | None = None  # N of /dev/nvidiaN (None: a MIG device, or not known)
    power_w: float | None = None  # mean draw since the previous sweep, from the energy counter
    # why the clocks are held down now (NVML's clock event reasons), e.g. ("hw thermal",)
    clock_events: tuple[str, ...] = ()
    # PCIe traffic since the previous sweep, from NVML's byte counters (field values), the GPU's view:
    # rx = to the GPU (batches copied in), tx = from it
    pcie_rx_bytes_per_s: float | None = None
    pcie_tx_bytes_per_s: float | None = None
    # GPM (Hopper and later), since the previous sweep: the share of SMs busy, and of warps active
    # against the most the SMs could hold. Utilisation says a kernel ran; these, how much of the GPU
    sm_active_percent: float | None = None
    sm_occupancy_percent: float | None = None

    @property
    def key(self) -> str:
        """Unique among a snapshot's devices: "3" for GPU 3, "3:1" for MIG device 1 on it."""
        return str(self.index) if self.mig_index is None else f"{self.index}:{self.mig_index}"

    @property
    def is_mig_parent(self) -> bool:
        """A card in MIG mode: its work runs on its MIG devices, which are judged instead."""
        return bool(self.mig_mode) and self.mig_index is None


@dataclass(frozen=True, slots=True)
class GpuStatus:
    available: bool
    reason: str | None = None  # why not, when not available
    driver_version: str | None = None
    process_memory_note: str | None = None  # why per-process VRAM is unavailable (a container's pids)


@dataclass(frozen=True, slots=True)
class LoaderSample:
    """One DataLoader as the in-process agent sees it."""

    id: str
    name: str  # where it was constructed, file:line
    pid: int  # the process that iterates it
    num_workers: int | None = None
    batch_size: int | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    prefetch_factor: int | None = None
    batches_total: int | None = None
    batches_per_s: float | None = None
    samples_per_s: float | None = None
    data_wait_fraction: float | None = None
    worker_pids: tuple[int, ...] = ()  # current workers, in worker-id order
    batches_per_worker: tuple[int, ...] = ()
    samples_total: int | None = None
    epochs: int | None = None  # epochs finished (iterators run to StopIteration)
    multiprocessing_context: str | None = None  # fork, spawn, forkserver
    alive: bool = True  # False once the DataLoader object was garbage-collected
    # worker start-up: building the iterator and the first batch of each epoch, a call still in
    # progress included; it is not in data_wait_fraction (which is steady-state only)
    startup_s_total: float | None = None
    epochs_started: int | None = None
    in_call_s: float | None = None  # how long the trainer has been inside __next__ now (0: not waiting)
    in_startup: bool | None = None  # that call is the first of an epoch (workers starting up)
    # the share of the interval's wall time the trainer spent waiting for this loader (steady
    # state, like data_wait_fraction, which is the share within this loader's own iteration): a
    # validation loader waiting 65% of its own bursts may cost the job 3% of its time
    wall_wait_fraction: float | None = None
    role: str | None = None  # "train" | "validation" | "test" | "other"; None: not known
    # "framework" (it said so) | "pattern" (iterated in short bursts between another loader's batches)
    role_source: str | None = None
    framework: str | None = None  # "Lightning" | "HF Trainer" | "accelerate" | "torchdata"
    # the distributed rank of the process that iterates it (None: not a distributed job, or unknown)
    rank: int | None = None
    local_rank: int | None = None
    node_rank: int | None = None
    world_size: int | None = None

    @property
    def label(self) -> str:
        """The name alerts use: ``train.py:31 (rank 1)`` in a distributed job, else the name (a
        job of one rank, such as any single-task SLURM job, is not called "rank 0")."""
        if self.rank is None or self.world_size == 1:
            return self.name
        return f"{self.name} (rank {self.rank})"


@dataclass(frozen=True, slots=True)
class PinnedMemory:
    """CUDA pinned (page-locked) host memory of the job: torch's caching host allocator's pool,
    summed over the processes whose agent reports it. The pool is cudaHostAlloc'd shared memory,
    so it is counted in its process's RssShmem too (VmPin and VmLck do not count it)."""

    bytes: int | None  # the pool: pinned blocks held, in use or cached for reuse
    source: str  # "torch.cuda.host_memory_stats:<pool key> (in use: <key>)", the keys the torch gave
    in_use_bytes: int | None = None  # the part handed out; None where the torch does not say

    def plus(self, other: PinnedMemory) -> PinnedMemory:
        """Two processes' pools together (an in-use part only when both say it)."""
        in_use = (
            self.in_use_bytes + other.in_use_bytes
            if self.in_use_bytes is not None and other.in_use_bytes is not None
            else None
        )
        total = None if self.bytes is None or other.bytes is None else self.bytes + other.bytes
        return PinnedMemory(total, self.source or other.source, in_use)


@dataclass(frozen=True, slots=True)
class WorkerDeath:
    """A DataLoader worker that died, as the in-process agent saw it (before torch raised)."""

    pid: int
    worker_id: int | None
    loader_id: str | None  # LoaderSample.id
    signal: int | None  # e.g. 9 for SIGKILL, 7 for SIGBUS
    exit_code: int | None
    time: float | None  # Unix time
    signal_name: str | None = None  # "SIGKILL"
    reported_by: int | None = None  # the training process whose worker it was
    loader_name: str | None = None  # LoaderSample.name of its loader
    source: str | None = None  # "agent" (socket), "journal" (the agent's death file), "kernel" (/dev/kmsg)


@dataclass(frozen=True, slots=True)
class TrainingException:
    """An exception the in-process agent saw end a DataLoader call or a thread of the training,
    written to its journal before the process could die of it (dlmon.agent._last_words)."""

    reported_by: int  # the training process
    origin: str  # "next" (left a DataLoader's __next__), "main" (uncaught, main thread), "thread"
    type: str  # "RuntimeError", "torch.OutOfMemoryError"
    message: str  # its first line (torch's "Caught X in DataLoader worker process N." for a worker's)
    time: float | None  # Unix time
    thread: str | None = None
    worker_id: int | None = None  # the DataLoader worker that raised it (torch re-raised it)
    worker_type: str | None = None  # the worker's own exception: "KeyError"
    worker_message: str | None = None  # "'label'"
    file: str | None = None  # the user's frame: the last one outside torch, site-packages, stdlib
    line: int | None = None
    function: str | None = None
    loader_id: str | None = None  # LoaderSample.id ("next" only)
    loader_name: str | None = None
    batches: int | None = None  # batches the loader had returned when it raised
    batch_bytes: int | None = None  # bytes of the tensors of one batch (the epoch's first)
    sharing_strategy: str | None = None  # torch.multiprocessing's: "file_descriptor" | "file_system"
    open_fds: int | None = None  # descriptors open in the process when it raised
    fd_limit: int | None = None  # its RLIMIT_NOFILE soft limit
    address_space_limit: int | None = None  # RLIMIT_AS, for a MemoryError (None: unlimited)
    traceback: str = ""  # the (worker's) traceback's text, its end kept when long
    worker_origin: str | None = None  # "worker" | "pin_memory" (the pin-memory thread re-raised it)
    raised_there: bool | None = None  # the user's frame is the innermost: its own line raised it
    num_workers: int | None = None  # the loader's settings ("next"), for a job that died before a poll
    prefetch_factor: int | None = None


@dataclass(frozen=True, slots=True)
class KernelEvent:
    """A kernel log line (/dev/kmsg) about a process of the job: an OOM kill or a segfault."""

    kind: str  # "oom_kill" | "segfault"
    pid: int
    comm: str | None
    time: float | None  # Unix time (from the kernel's monotonic stamp)
    constraint: str | None = None  # oom_kill: "cgroup" (a memory cgroup's limit) | "machine" | other
    memcg: str | None = None  # oom_kill: the cgroup whose limit was hit
    anon_rss_bytes: int | None = None  # oom_kill: the victim's memory at the kill
    file_rss_bytes: int | None = None
    shmem_rss_bytes: int | None = None
    total_vm_bytes: int | None = None
    line: str = ""  # the kernel's own line, at most 300 characters
    memcg_limit_bytes: int | None = None  # oom_kill in a cgroup: that cgroup's limit, read right after
    memcg_peak_bytes: int | None = None  # ... and its peak usage (v1 max_usage_in_bytes, v2 memory.peak)


@dataclass(frozen=True, slots=True)
class StackFrame:
    file: str
    line: int | None
    function: str


@dataclass(frozen=True, slots=True)
class ProcessStack:
    """Where a process is stuck: its Python stack (one thread), taken when dlmon saw a stall."""

    pid: int
    role: str  # "main" | "worker"
    worker_id: int | None
    time: float  # Unix time it was taken
    thread: str | None  # "MainThread", or None for a worker's dump (its current thread)
    frames: tuple[StackFrame, ...]  # outermost first, innermost last
    state: str | None = None  # /proc/PID/stat state then
    wchan: str | None = None  # the kernel function it sleeps in (/proc/PID/wchan)
    reading: str | None = None  # a regular file it has open for reading, if any (/proc/PID/fd)
    # "agent" (sys._current_frames), "faulthandler" (worker dump), "crash", "py-spy" / "gdb" (read from
    # outside: a worker forked before the agent), "none" (no way to read it: frames empty)
    source: str = ""


@dataclass(frozen=True, slots=True)
class Alert:
    """A verdict from dlmon.analysis, with the numbers behind it."""

    kind: str  # one of dlmon.analysis.kinds.KINDS (the detectors' registry), e.g. "input_bound"
    severity: str  # "info" | "warning" | "critical"
    subject: str  # which process / loader / disk, e.g. "worker 3 (pid 1234)", "disk vda"
    message: str  # one plain sentence with the numbers
    advice: str  # what to change
    since: float  # Unix time the condition was first raised
    evidence: Mapping[str, float | int | str | bool | None] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True, slots=True)
class Snapshot:
    time: float  # Unix time of the sample
    interval_s: float | None  # seconds since the previous sample; rates are over this interval
    host: str
    target: TargetInfo
    processes: tuple[ProcessSample, ...]
    memory: MemorySummary
    shm: ShmSample | None
    gpu: GpuStatus
    gpus: tuple[GpuDevice, ...]
    disks: tuple[DiskSample, ...]
    pressure: Pressure | None
    cgroup: CgroupMemory | None
    loaders: tuple[LoaderSample, ...] = ()
    pinned: PinnedMemory | None = None
    worker_deaths: tuple[WorkerDeath, ...] = ()  # cumulative over the run, from the agent
    alerts: tuple[Alert, ...] = ()  # active alerts after this sample (dlmon.analysis)
    schema: int = SCHEMA_VERSION
    # Processes dlmon reads by path (with identity checks) instead of through held fds, because
    # holding more would pass its share of RLIMIT_NOFILE: "fd limit: N processes read without held fds".
    processes_without_held_fds: int = 0
    agent_note: str | None = None  # why the in-process agent is unreachable, when dlmon can tell
    # the cores the target may use: its affinity and its cgroup's CPU quota, whichever is smaller
    target_cores: float | None = None
    kernel_events: tuple[KernelEvent, ...] = ()  # OOM kills / segfaults of the job's processes (recent)
    stacks: tuple[ProcessStack, ...] = ()  # stacks of stuck processes, taken during a stall
    # A tree too big for the sampler's budget: workers are read every ``rotation_ticks`` ticks
    # and ``processes_in_rotation`` rows of this snapshot are their last reading, shown again.
    rotation_ticks: int = 1
    processes_in_rotation: int = 0
    # detector failures the analyzer swallowed so far (it never raises), and the newest one
    analysis_errors: int = 0
    analysis_error: str | None = None
    # exceptions that left a DataLoader or ended a thread of the training, cumulative (its last words)
    exceptions: tuple[TrainingException, ...] = ()
    # the agent was loaded into the running job then (``attach --inject``): its loader counts begin
    # there, not at the job's start. None: it started with the job, or there is no agent
    agent_loaded_unix_time: float | None = None

    def workers(self) -> tuple[ProcessSample, ...]:
        return tuple(p for p in self.processes if p.role == "worker")


# One step of the per-tick pipeline: a snapshot in, the same snapshot (or one with more in it) out.
# The analysis (dlmon.analysis.Analyzer) is one: it returns the snapshot with its alerts.
SnapshotStep = Callable[[Snapshot], Snapshot]
