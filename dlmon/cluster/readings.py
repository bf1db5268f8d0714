"""What one node answered: its series, or why nothing came, and when it was read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dlmon.cluster.exposition import Labels, Series

# The series the view reads; a source may fetch only these (a Prometheus query per name).
NEEDED = (
    "dlmon_build_info",
    "dlmon_host_info",
    "dlmon_snapshot_timestamp_seconds",
    "dlmon_sample_interval_seconds",
    "dlmon_target_up",
    "dlmon_loader_batches_total",
    "dlmon_loader_batches_per_second",
    "dlmon_loader_data_wait_ratio",
    "dlmon_loader_data_wait_wall_ratio",
    "dlmon_loader_workers",
    "dlmon_job_data_wait_wall_ratio",
    "dlmon_process_cpu_ratio",
    "dlmon_process_swap_bytes",
    "dlmon_memory_available_bytes",
    "dlmon_cgroup_memory_limit_bytes",
    "dlmon_cgroup_memory_working_set_bytes",
    "dlmon_cgroup_memory_usage_bytes",
    "dlmon_memory_growth_eta_seconds",
    "dlmon_gpu_memory_used_bytes",
    "dlmon_gpu_memory_total_bytes",
    "dlmon_gpu_utilization_ratio",
    "dlmon_disk_utilization_ratio",
    "dlmon_pressure_io_some_ratio",
    "dlmon_alert",
    "dlmon_alert_active",
)
# Per-interval figures that swing from one sample to the next: averaged over the readings of a
# window (several scrapes, or avg_over_time), where the rest is read as it is now.
AVERAGED = frozenset(
    {
        "dlmon_loader_batches_per_second",
        "dlmon_loader_data_wait_ratio",
        "dlmon_loader_data_wait_wall_ratio",
        "dlmon_job_data_wait_wall_ratio",
        "dlmon_process_cpu_ratio",
        "dlmon_gpu_utilization_ratio",
        "dlmon_disk_utilization_ratio",
        "dlmon_pressure_io_some_ratio",
    }
)


@dataclass(frozen=True, slots=True)
class NodeReading:
    address: str  # as the user named it (HOST:PORT), or Prometheus's ``instance``
    series: tuple[Series, ...]
    read_at: float  # Unix time of the reading on this machine's clock (Prometheus: its scrape)
    error: str | None = None  # why nothing was read: one line


def averaged(readings: Sequence[tuple[Series, ...]]) -> tuple[Series, ...]:
    """One reading from several of the same node: AVERAGED series by their mean over the readings
    that hold them, everything else from the last (a loader gone since is gone)."""
    if not readings:
        return ()
    sums: dict[tuple[str, Labels], list[float]] = {}
    for reading in readings:
        for s in reading:
            if s.name in AVERAGED:
                sums.setdefault((s.name, s.labels), []).append(s.value)
    last = readings[-1]
    out = [s for s in last if s.name not in AVERAGED]
    out += [Series(s.name, s.labels, sum(v) / len(v)) for s in last if (v := sums.get((s.name, s.labels)))]
    return tuple(out)
