"""What dlmon exports to Prometheus, as tables: one line per metric.

A new Snapshot field becomes a metric by adding one ``gauge(...)`` / ``counter(...)`` line to the
table of its group. Names follow Prometheus conventions: ``dlmon_`` prefix, base units
(``_bytes``, ``_seconds``, ratios 0..1), counters end in ``_total``.

Labels stay bounded: a DataLoader worker known to the agent is keyed by ``loader`` and
``worker_id`` only, so a respawned worker (every epoch without persistent_workers) continues its
series instead of adding new ones; its current pid is the value of ``dlmon_worker_pid``. The
trainer and other processes are keyed by role and rank, with an empty ``pid``, unless
``Published.pid_labels`` (``--prometheus-pids``) asks for the pid: across a fleet, a pid label
makes every restart of every job a new set of series. Processes that share a role and rank (two
children of one rank) keep their pids, all of them. A loader's id (``PID:N``, the ``loader``
label of the loader, worker and alert series) holds its process's pid either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Generic, TypeVar

from dlmon.analysis.wait import by_process, job_wall_wait
from dlmon.model import Alert, DiskSample, GpuDevice, LoaderSample, ProcessSample, Snapshot
from dlmon.model.format import DEAD_STATES

T = TypeVar("T")
Number = float | int | None
_EMPTY_COUNTS: Mapping[tuple[str, str], int] = MappingProxyType({})
_EMPTY_SECONDS: Mapping[str, float] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Published:
    """What one scrape renders: the newest snapshot plus the counters dlmon keeps over the run."""

    snapshot: Snapshot
    alerts_raised: Mapping[tuple[str, str], int] = field(default_factory=lambda: _EMPTY_COUNTS)
    data_wait_seconds: Mapping[str, float] = field(default_factory=lambda: _EMPTY_SECONDS)
    pid_labels: bool = False  # a pid label on the trainer's and other processes' series


@dataclass(frozen=True, slots=True)
class Metric(Generic[T]):
    name: str
    help: str
    read: Callable[[T], Number]
    counter: bool = False


def gauge(name: str, help: str, read: Callable[[T], Number]) -> Metric[T]:
    return Metric(name, help, read)


def counter(name: str, help: str, read: Callable[[T], Number]) -> Metric[T]:
    return Metric(name, help, read, counter=True)


def attr(path: str, scale: float = 1.0) -> Callable[[Any], Number]:
    """Read a (dotted) attribute; ``scale`` converts to base units (percent -> ratio: 0.01)."""
    get = attrgetter(path)

    def read(obj: Any) -> Number:
        try:
            value = get(obj)
        except AttributeError:  # a None on the way (no cgroup, no shm)
            return None
        if isinstance(value, bool):
            return int(value)
        if not isinstance(value, int | float):
            return None
        return value * scale if scale != 1.0 else value

    return read


@dataclass(frozen=True, slots=True)
class Group(Generic[T]):
    """Metrics sharing one set of labels; ``items`` yields (label values, object) per series."""

    labels: tuple[str, ...]
    items: Callable[[Published], Iterable[tuple[tuple[str, ...], T]]]
    metrics: tuple[Metric[T], ...]


# --- per process -------------------------------------------------------------------------------

# The distributed rank (empty outside one): a function of the process or loader a series is already
# keyed by, so it adds no series; at most the ranks on this machine (RANK / LOCAL_RANK / GROUP_RANK).
RANK_LABELS = ("rank", "local_rank", "node_rank")
PROCESS_LABELS = ("pid", "role", "loader", "worker_id", *RANK_LABELS)


def rank_values(x: ProcessSample | LoaderSample | None) -> tuple[str, str, str]:
    if x is None or x.rank is None:
        return ("", "", "")

    def text(v: int | None) -> str:
        return "" if v is None else str(v)

    return (str(x.rank), text(x.local_rank), text(x.node_rank))


def worker_slots(snapshot: Snapshot) -> dict[int, tuple[str, int]]:
    """worker pid -> (loader id, worker id), from the agent's loaders."""
    slots: dict[int, tuple[str, int]] = {}
    for loader in snapshot.loaders:
        for worker_id, pid in enumerate(loader.worker_pids):
            slots[pid] = (loader.id, worker_id)
    return slots


def _role_and_rank(p: ProcessSample) -> tuple[str, ...]:
    return (p.role, *rank_values(p))


def process_series(published: Published) -> list[tuple[tuple[str, ...], ProcessSample]]:
    snapshot = published.snapshot
    slots = worker_slots(snapshot)
    seen: set[tuple[str, ...]] = set()
    out: list[tuple[tuple[str, ...], ProcessSample]] = []
    # Without pid labels, a process is keyed by role and rank only while it is the one process of
    # that role and rank: were the first of two to have the pid-less series, it would pass to the
    # other when the first exits (its counters jumping, its gauges another process's)
    sharing: dict[tuple[str, ...], int] = {}
    for p in snapshot.processes:
        sharing[_role_and_rank(p)] = sharing.get(_role_and_rank(p), 0) + 1
    # Live processes first: a zombie of the previous epoch must not take its successor's slot.
    for p in sorted(snapshot.processes, key=lambda p: p.state in DEAD_STATES):
        alone = sharing[_role_and_rank(p)] == 1
        labels = ("" if alone and not published.pid_labels else str(p.pid), p.role, "", "")
        if p.role == "worker":
            loader, worker_id = slots.get(p.pid, ("", p.worker_id))
            if worker_id is not None:
                labels = ("", p.role, loader, str(worker_id))
        if (*labels, *rank_values(p)) in seen:
            labels = (str(p.pid), p.role, labels[2], labels[3])
        seen.add((*labels, *rank_values(p)))
        out.append(((*labels, *rank_values(p)), p))
    return out


PROCESS: Group[ProcessSample] = Group(
    PROCESS_LABELS,
    process_series,
    (
        gauge("dlmon_process_pss_bytes", "Proportional set size (shared pages split).", attr("pss_bytes")),
        gauge("dlmon_process_uss_bytes", "Unique set size: pages only this process maps.", attr("uss_bytes")),
        gauge("dlmon_process_rss_bytes", "Resident set size (counts shared pages fully).", attr("rss_bytes")),
        gauge("dlmon_process_rss_anon_bytes", "Resident anonymous memory.", attr("rss_anon_bytes")),
        gauge("dlmon_process_rss_file_bytes", "Resident file-backed memory.", attr("rss_file_bytes")),
        gauge(
            "dlmon_process_rss_shmem_bytes",
            "Resident shared memory (/dev/shm, shared tensors).",
            attr("shmem_bytes"),
        ),
        gauge("dlmon_process_pss_shmem_bytes", "PSS of shared memory.", attr("pss_shmem_bytes")),
        gauge(
            "dlmon_process_pss_anon_bytes",
            "PSS of anonymous pages (heap, copied-on-read objects).",
            attr("pss_anon_bytes"),
        ),
        gauge(
            "dlmon_process_pss_file_bytes",
            "PSS of file-backed pages (mapped datasets, libraries): reclaimable.",
            attr("pss_file_bytes"),
        ),
        gauge("dlmon_process_fd_limit", "RLIMIT_NOFILE soft limit of the process.", attr("fd_limit")),
        gauge("dlmon_process_swap_bytes", "Swapped-out memory.", attr("swap_bytes")),
        gauge(
            "dlmon_process_locked_bytes",
            "mlock()ed memory (VmLck); CUDA pinned memory is not in it.",
            attr("locked_bytes"),
        ),
        gauge(
            "dlmon_process_pinned_bytes",
            "Long-term page pins: RDMA, io_uring (VmPin); CUDA pinned memory is not in it.",
            attr("pinned_bytes"),
        ),
        gauge(
            "dlmon_process_gpu_memory_bytes",
            "GPU memory used by this process (NVML).",
            attr("gpu_memory_bytes"),
        ),
        gauge(
            "dlmon_process_pss_age_seconds",
            "Age of the PSS/USS/swap figures (read on a budget).",
            attr("pss_age_s"),
        ),
        gauge(
            "dlmon_process_pss_still",
            "1 when nothing in the process tree moved since the PSS reading: it holds however old.",
            attr("pss_still"),
        ),
        gauge("dlmon_process_cpu_ratio", "CPU use in cores (1 = one core busy).", attr("cpu_percent", 0.01)),
        gauge("dlmon_process_threads", "Threads of the process.", attr("num_threads")),
        gauge("dlmon_process_open_fds", "Open file descriptors.", attr("num_fds")),
        gauge(
            "dlmon_process_torch_threads", "torch.get_num_threads() in the process.", attr("torch_threads")
        ),
        gauge("dlmon_process_zombie", "1 while the process is a zombie.", lambda p: int(p.state == "Z")),
        counter("dlmon_process_read_bytes_total", "Bytes read from the block layer.", attr("read_bytes")),
        counter("dlmon_process_write_bytes_total", "Bytes written to the block layer.", attr("write_bytes")),
        counter(
            "dlmon_process_nonvoluntary_context_switches_total",
            "Involuntary context switches.",
            attr("nonvoluntary_ctxt_switches"),
        ),
    ),
)


def _loaders_by_id(snapshot: Snapshot) -> dict[str, LoaderSample]:
    return {lo.id: lo for lo in snapshot.loaders}


def worker_pid_series(published: Published) -> list[tuple[tuple[str, ...], int]]:
    by_id = _loaders_by_id(published.snapshot)
    return [
        ((loader, str(worker_id), *rank_values(by_id.get(loader))), pid)
        for pid, (loader, worker_id) in worker_slots(published.snapshot).items()
    ]


WORKER: Group[int] = Group(
    ("loader", "worker_id", *RANK_LABELS),
    worker_pid_series,
    (gauge("dlmon_worker_pid", "The current pid of this DataLoader worker slot.", lambda pid: pid),),
)

# --- the job and the machine -------------------------------------------------------------------


def one(published: Published) -> list[tuple[tuple[str, ...], Snapshot]]:
    return [((), published.snapshot)]


def host_series(published: Published) -> list[tuple[tuple[str, ...], int]]:
    return [((published.snapshot.host,), 1)]


# The machine's name as an info series, joined where wanted (``* on (instance) group_left (host)
# max by (instance, host) (dlmon_host_info)``: export --all-jobs serves one per job), rather than
# a label on every series: the target's ``instance`` already keeps nodes apart, and a label
# copied onto hundreds of series is what Prometheus advises against.
HOST: Group[int] = Group(
    ("host",),
    host_series,
    (gauge("dlmon_host_info", "The machine dlmon runs on (its hostname); value 1.", lambda n: n),),
)


JOB: Group[Snapshot] = Group(
    (),
    one,
    (
        gauge("dlmon_target_up", "1 while the watched training process is alive.", attr("target.alive")),
        gauge(
            "dlmon_target_start_time_seconds",
            "Unix time the training process started.",
            attr("target.start_unix_time"),
        ),
        gauge("dlmon_snapshot_timestamp_seconds", "Unix time of the snapshot served.", attr("time")),
        gauge("dlmon_sample_interval_seconds", "Seconds between the last two samples.", attr("interval_s")),
        gauge("dlmon_processes", "Processes in the job's tree.", lambda s: len(s.processes)),
        gauge(
            "dlmon_job_pss_bytes",
            "The job's true memory: PSS summed over its processes.",
            attr("memory.pss_sum_bytes"),
        ),
        gauge("dlmon_job_uss_bytes", "USS summed over the job's processes.", attr("memory.uss_sum_bytes")),
        gauge(
            "dlmon_job_rss_sum_bytes",
            "RSS summed over the job (double-counts shared pages).",
            attr("memory.rss_sum_bytes"),
        ),
        gauge(
            "dlmon_job_pss_missing_processes",
            "Processes whose PSS is not known yet.",
            attr("memory.pss_missing"),
        ),
        gauge(
            "dlmon_job_pss_anon_bytes",
            "The job's anonymous PSS (PSS minus file-backed pages): what growth detection watches.",
            attr("memory.pss_anon_sum_bytes"),
        ),
        gauge(
            "dlmon_job_pss_file_bytes",
            "The job's PSS of mapped files (reclaimable).",
            attr("memory.pss_file_sum_bytes"),
        ),
        gauge(
            "dlmon_target_cores",
            "Cores the target may use (affinity, cgroup CPU quota).",
            attr("target_cores"),
        ),
        gauge(
            "dlmon_processes_without_held_fds",
            "Processes dlmon reads by path because of its own fd limit.",
            attr("processes_without_held_fds"),
        ),
        gauge("dlmon_memory_total_bytes", "Machine memory.", attr("memory.total_bytes")),
        gauge("dlmon_memory_available_bytes", "Machine memory available.", attr("memory.available_bytes")),
        gauge("dlmon_memory_shmem_bytes", "Machine-wide shared memory (Shmem).", attr("memory.shmem_bytes")),
        gauge("dlmon_memory_dirty_bytes", "Dirty page cache.", attr("memory.dirty_bytes")),
        gauge("dlmon_swap_total_bytes", "Swap space.", attr("memory.swap_total_bytes")),
        gauge("dlmon_swap_used_bytes", "Swap in use.", attr("memory.swap_used_bytes")),
        counter(
            "dlmon_oom_kills_total", "OOM kills on the machine (/proc/vmstat).", attr("memory.oom_kill_count")
        ),
        gauge(
            "dlmon_cgroup_memory_limit_bytes",
            "The memory cgroup's effective limit.",
            attr("cgroup.limit_bytes"),
        ),
        gauge(
            "dlmon_cgroup_memory_usage_bytes",
            "The memory cgroup's current usage.",
            attr("cgroup.current_bytes"),
        ),
        gauge(
            "dlmon_cgroup_memory_working_set_bytes",
            "The cgroup's working set (usage minus inactive file cache): what the OOM decision tracks.",
            attr("memory.cgroup_working_set_bytes"),
        ),
        gauge(
            "dlmon_cgroup_memory_cache_bytes",
            "The cgroup's reclaimable page cache (inactive file).",
            attr("memory.cgroup_cache_bytes"),
        ),
        counter(
            "dlmon_cgroup_oom_kills_total",
            "OOM kills in the job's memory cgroup.",
            attr("cgroup.oom_kill_count"),
        ),
        gauge("dlmon_shm_size_bytes", "Size of the /dev/shm the job sees.", attr("shm.total_bytes")),
        gauge("dlmon_shm_used_bytes", "Used /dev/shm.", attr("shm.used_bytes")),
        gauge("dlmon_shm_available_bytes", "Available /dev/shm.", attr("shm.available_bytes")),
        gauge(
            "dlmon_pinned_memory_bytes",
            "CUDA pinned host memory pool of the job (torch's caching host allocator; counted in shm too).",
            attr("pinned.bytes"),
        ),
        gauge(
            "dlmon_pinned_memory_in_use_bytes",
            "The part of the CUDA pinned pool handed out (the rest is cached for reuse).",
            attr("pinned.in_use_bytes"),
        ),
        gauge("dlmon_pressure_io_some_ratio", "PSI io some avg10.", attr("pressure.io_some_avg10", 0.01)),
        gauge("dlmon_pressure_io_full_ratio", "PSI io full avg10.", attr("pressure.io_full_avg10", 0.01)),
        gauge(
            "dlmon_pressure_memory_some_ratio",
            "PSI memory some avg10.",
            attr("pressure.memory_some_avg10", 0.01),
        ),
        gauge(
            "dlmon_pressure_memory_full_ratio",
            "PSI memory full avg10.",
            attr("pressure.memory_full_avg10", 0.01),
        ),
        gauge("dlmon_pressure_cpu_some_ratio", "PSI cpu some avg10.", attr("pressure.cpu_some_avg10", 0.01)),
    ),
)

# --- DataLoaders -------------------------------------------------------------------------------


def loader_series(published: Published) -> list[tuple[tuple[str, ...], tuple[LoaderSample, float | None]]]:
    return [
        (
            (lo.id, lo.role or "", lo.name, *rank_values(lo)),
            (lo, published.data_wait_seconds.get(lo.id)),
        )  # role "": not known
        for lo in published.snapshot.loaders
    ]


def _lo(path: str) -> Callable[[tuple[LoaderSample, float | None]], Number]:
    read = attr(path)
    return lambda pair: read(pair[0])


LOADER: Group[tuple[LoaderSample, float | None]] = Group(
    ("loader", "role", "site", *RANK_LABELS),
    loader_series,
    (
        counter(
            "dlmon_loader_batches_total", "Batches the training took from this loader.", _lo("batches_total")
        ),
        counter(
            "dlmon_loader_samples_total", "Samples the training took from this loader.", _lo("samples_total")
        ),
        counter("dlmon_loader_epochs_total", "Epochs finished.", _lo("epochs")),
        counter(
            "dlmon_loader_startup_seconds_total",
            "Seconds spent in worker start-up (first batch of each epoch); not in data-wait.",
            _lo("startup_s_total"),
        ),
        counter(
            "dlmon_loader_data_wait_seconds_total",
            "Seconds the training waited for this loader (data-wait ratio x interval, summed).",
            lambda pair: pair[1],
        ),
        gauge(
            "dlmon_loader_batches_per_second",
            "Batches per second over the last interval.",
            _lo("batches_per_s"),
        ),
        gauge(
            "dlmon_loader_samples_per_second",
            "Samples per second over the last interval.",
            _lo("samples_per_s"),
        ),
        gauge(
            "dlmon_loader_data_wait_ratio",
            "Share of the last interval spent waiting for data.",
            _lo("data_wait_fraction"),
        ),
        gauge(
            "dlmon_loader_data_wait_wall_ratio",
            "Share of the last interval's wall time the training waited for this loader (its own "
            "ratio is within its own iteration: a validation loader's bursts).",
            _lo("wall_wait_fraction"),
        ),
        gauge("dlmon_loader_workers", "num_workers.", _lo("num_workers")),
        gauge("dlmon_loader_batch_size", "batch_size.", _lo("batch_size")),
        gauge("dlmon_loader_prefetch_factor", "prefetch_factor.", _lo("prefetch_factor")),
        gauge("dlmon_loader_pin_memory", "1 if pin_memory.", _lo("pin_memory")),
        gauge("dlmon_loader_persistent_workers", "1 if persistent_workers.", _lo("persistent_workers")),
    ),
)


def loader_worker_series(published: Published) -> list[tuple[tuple[str, ...], int]]:
    return [
        ((lo.id, str(worker_id), *rank_values(lo)), count)
        for lo in published.snapshot.loaders
        for worker_id, count in enumerate(lo.batches_per_worker)
    ]


LOADER_WORKER: Group[int] = Group(
    ("loader", "worker_id", *RANK_LABELS),
    loader_worker_series,
    (counter("dlmon_worker_batches_total", "Batches this worker slot produced.", lambda n: n),),
)

# --- disks and GPUs ----------------------------------------------------------------------------


def disk_series(published: Published) -> list[tuple[tuple[str, ...], DiskSample]]:
    return [((d.name,), d) for d in published.snapshot.disks]


DISK: Group[DiskSample] = Group(
    ("disk",),
    disk_series,
    (
        gauge("dlmon_disk_read_bytes_per_second", "Disk reads, bytes/s.", attr("read_bytes_per_s")),
        gauge("dlmon_disk_write_bytes_per_second", "Disk writes, bytes/s.", attr("write_bytes_per_s")),
        gauge("dlmon_disk_reads_per_second", "Read requests/s.", attr("reads_per_s")),
        gauge("dlmon_disk_writes_per_second", "Write requests/s.", attr("writes_per_s")),
        gauge(
            "dlmon_disk_utilization_ratio",
            "Share of time the disk was busy (%util).",
            attr("util_percent", 0.01),
        ),
        gauge("dlmon_disk_read_await_seconds", "Mean read latency (r_await).", attr("r_await_ms", 0.001)),
        gauge("dlmon_disk_write_await_seconds", "Mean write latency (w_await).", attr("w_await_ms", 0.001)),
        gauge("dlmon_disk_queue_depth", "Mean queue depth (aqu-sz).", attr("queue_depth")),
    ),
)


def gpu_series(published: Published) -> list[tuple[tuple[str, ...], GpuDevice]]:
    return [((g.key,), g) for g in published.snapshot.gpus]  # a MIG device: "0:1"


GPU: Group[GpuDevice] = Group(
    ("gpu",),
    gpu_series,
    (
        gauge("dlmon_gpu_memory_used_bytes", "GPU memory used (all processes).", attr("memory_used_bytes")),
        gauge("dlmon_gpu_memory_total_bytes", "GPU memory.", attr("memory_total_bytes")),
        gauge("dlmon_gpu_utilization_ratio", "GPU busy share.", attr("utilization_percent", 0.01)),
        gauge("dlmon_gpu_power_watts", "GPU power draw since the previous sweep.", attr("power_w")),
        gauge("dlmon_gpu_sm_active_ratio", "Share of SMs busy (GPM).", attr("sm_active_percent", 0.01)),
        gauge(
            "dlmon_gpu_sm_occupancy_ratio",
            "Warps active against the SMs' maximum (GPM).",
            attr("sm_occupancy_percent", 0.01),
        ),
        gauge(
            "dlmon_gpu_pcie_rx_bytes_per_second",
            "PCIe bytes to the GPU per second (NVML's counter).",
            attr("pcie_rx_bytes_per_s"),
        ),
        gauge(
            "dlmon_gpu_pcie_tx_bytes_per_second",
            "PCIe bytes from the GPU per second (NVML's counter).",
            attr("pcie_tx_bytes_per_s"),
        ),
        gauge(
            "dlmon_gpu_torch_allocated_bytes", "torch.cuda.memory_allocated.", attr("torch_allocated_bytes")
        ),
        gauge("dlmon_gpu_torch_reserved_bytes", "torch.cuda.memory_reserved.", attr("torch_reserved_bytes")),
        gauge(
            "dlmon_gpu_torch_peak_allocated_bytes",
            "torch.cuda.max_memory_allocated.",
            attr("torch_peak_allocated_bytes"),
        ),
    ),
)

# --- alerts and deaths -------------------------------------------------------------------------


def alert_series(published: Published) -> list[tuple[tuple[str, ...], int]]:
    return [((a.kind, a.severity, a.subject), 1) for a in published.snapshot.alerts]


def alert_place(alert: Alert, snapshot: Snapshot) -> tuple[str, str]:
    """(rank, loader id) an alert is about, "" where it names none: from its evidence (``rank``,
    ``loader_id``, ``pid``), else the loader whose label its subject names."""
    evidence = alert.evidence
    loader: LoaderSample | None = None
    loader_id = evidence.get("loader_id")
    pid = evidence.get("pid")
    for lo in snapshot.loaders:
        if lo.id == loader_id or alert.subject == f"loader {lo.label}":
            loader = lo
            break
    rank = evidence.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool):
        rank = loader.rank if loader is not None else None
    if rank is None and isinstance(pid, int):
        process = next((p for p in snapshot.processes if p.pid == pid), None)
        rank = process.rank if process is not None else None
    return ("" if rank is None else str(rank), loader.id if loader is not None else "")


def _cause(alert: Alert) -> str:
    cause = alert.evidence.get("cause")
    return cause if isinstance(cause, str) and len(cause) <= 40 else ""


def placed_alert_series(published: Published) -> list[tuple[tuple[str, ...], int]]:
    """One series per (kind, severity, rank, loader, cause): bounded by the kinds, the ranks on
    this machine and their loaders; the subject and message stay in dlmon (they carry numbers)."""
    keys = {
        (a.kind, a.severity, *alert_place(a, published.snapshot), _cause(a))
        for a in published.snapshot.alerts
    }
    return [(key, 1) for key in sorted(keys)]


def active_count_series(published: Published) -> list[tuple[tuple[str, ...], int]]:
    counts: dict[tuple[str, ...], int] = {}
    for a in published.snapshot.alerts:
        counts[(a.kind,)] = counts.get((a.kind,), 0) + 1
    return sorted(counts.items())


def time_to_oom_series(published: Published) -> list[tuple[tuple[str, ...], float]]:
    """The soonest end of headroom a memory_growth verdict forecasts, while one is active."""
    etas: list[float] = []
    for a in published.snapshot.alerts:
        eta = a.evidence.get("eta_s")
        if a.kind == "memory_growth" and isinstance(eta, int | float) and not isinstance(eta, bool):
            etas.append(float(eta))
    return [((), min(etas))] if etas else []


def raised_series(published: Published) -> list[tuple[tuple[str, ...], int]]:
    return [((kind, severity), n) for (kind, severity), n in sorted(published.alerts_raised.items())]


def death_series(published: Published) -> list[tuple[tuple[str, ...], int]]:
    counts: dict[tuple[str, ...], int] = {}
    for death in published.snapshot.worker_deaths:
        key = (death.loader_id or "", death.signal_name or (str(death.signal) if death.signal else "exit"))
        counts[key] = counts.get(key, 0) + 1
    return sorted(counts.items())


ALERT: Group[int] = Group(
    ("kind", "severity", "subject"),
    alert_series,
    (gauge("dlmon_alert_active", "1 for each alert active now.", lambda n: n),),
)
PLACED_ALERT: Group[int] = Group(
    ("kind", "severity", "rank", "loader", "cause"),
    placed_alert_series,
    (gauge("dlmon_alert", "1 while an alert of this kind is active on this rank and loader.", lambda n: n),),
)
ACTIVE_COUNT: Group[int] = Group(
    ("kind",),
    active_count_series,
    (gauge("dlmon_alerts_active", "Alerts of this kind active now.", lambda n: n),),
)
TIME_TO_OOM: Group[float] = Group(
    (),
    time_to_oom_series,
    (
        gauge(
            "dlmon_memory_growth_eta_seconds",
            "While memory_growth is active: seconds until the growth uses up the memory headroom.",
            lambda v: v,
        ),
    ),
)
ALERTS_RAISED: Group[int] = Group(
    ("kind", "severity"),
    raised_series,
    (counter("dlmon_alerts_raised_total", "Alerts raised (or escalated) since dlmon started.", lambda n: n),),
)


def job_wait_series(published: Published) -> list[tuple[tuple[str, ...], float]]:
    out: list[tuple[tuple[str, ...], float]] = []
    shares = [
        (pid, rank_values(loaders[0]), share)
        for pid, loaders in sorted(by_process(published.snapshot.loaders).items())
        if (share := job_wall_wait(loaders)) is not None
    ]
    # as process_series: the pid-less series only for the one process of its rank, never passed on
    sharing: dict[tuple[str, str, str], int] = {}
    for _, ranks, _ in shares:
        sharing[ranks] = sharing.get(ranks, 0) + 1
    for pid, ranks, share in shares:
        pid_label = "" if sharing[ranks] == 1 and not published.pid_labels else str(pid)
        out.append(((pid_label, *ranks), share))
    return out


JOB_WAIT: Group[float] = Group(
    ("pid", *RANK_LABELS),
    job_wait_series,
    (
        gauge(
            "dlmon_job_data_wait_wall_ratio",
            "Share of the last interval's wall time this training process waited for data, over its loaders.",
            lambda v: v,
        ),
    ),
)
DEATHS: Group[int] = Group(
    ("loader", "cause"),
    death_series,
    (counter("dlmon_worker_deaths_total", "DataLoader workers that died, by cause.", lambda n: n),),
)

GROUPS: tuple[Group[Any], ...] = (
    HOST,
    JOB,
    PROCESS,
    WORKER,
    LOADER,
    LOADER_WORKER,
    JOB_WAIT,
    DISK,
    GPU,
    ALERT,
    PLACED_ALERT,
    ACTIVE_COUNT,
    TIME_TO_OOM,
    ALERTS_RAISED,
    DEATHS,
)
