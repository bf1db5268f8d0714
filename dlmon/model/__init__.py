"""Frozen dataclasses describing what dlmon measured. No I/O here."""

from dlmon.model.history import History
from dlmon.model.snapshot import (
    SCHEMA_VERSION,
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
    RankInfo,
    ShmSample,
    Snapshot,
    TargetInfo,
    WorkerDeath,
)

__all__ = [
    "SCHEMA_VERSION",
    "Alert",
    "CgroupMemory",
    "DiskSample",
    "GpuDevice",
    "GpuProcess",
    "GpuStatus",
    "History",
    "LoaderSample",
    "MemorySummary",
    "PinnedMemory",
    "Pressure",
    "ProcessSample",
    "RankInfo",
    "ShmSample",
    "Snapshot",
    "TargetInfo",
    "WorkerDeath",
]
