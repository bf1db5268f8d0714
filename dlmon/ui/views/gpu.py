"""The GPU panel: one line per device, and in full the VRAM of every process on it."""

from __future__ import annotations

from dlmon.model import GpuDevice, ProcessSample
from dlmon.ui.fmt import NA, cbytes, cpct, duration, ratio
from dlmon.ui.state import DashboardState
from dlmon.ui.text import BAR, SEP, Line, Lines, Span, collapse, fit, fit_with_more, flow, wrap
from dlmon.ui.views.common import label, used_of


def gpu_lines(
    state: DashboardState, width: int, compact: bool, detailed: bool = False, rows: int | None = None
) -> Lines:
    """One line per device; with ``detailed`` (the panel in full) also torch's figures and the
    VRAM of every process (the workers table has a GPU column for the job's own)."""
    s = state.latest
    if s is None:
        return ((("waiting for data…", "dim"),),)
    lead = [label("GPU", 5)] if compact else []
    if not s.gpus:
        reason = s.gpu.reason or ("no NVIDIA device found" if s.gpu.available else "not available")
        if not compact:
            return wrap(f"no GPU: {reason}", width, "dim")
        return (fit([[("no GPU: ", "dim"), (reason, "dim")]], width, lead=lead),)
    roles = {p.pid: p for p in s.processes}
    if compact:
        parts = []
        for g in s.gpus:
            used = ratio(g.memory_used_bytes, g.memory_total_bytes)
            parts.append(
                [(f"{g.key}: ", "dim")]
                + (
                    [("MIG mode", "dim")]
                    if g.is_mig_parent and g.memory_used_bytes is None
                    else [(used_of(g.memory_used_bytes, g.memory_total_bytes, True), _level(used))]
                )
                + (
                    [(" util n/a in MIG", "dim")]
                    if g.mig_mode and g.utilization_percent is None and not g.is_mig_parent
                    else []
                    if g.is_mig_parent
                    else [(f" {_util(g.utilization_percent)}", "")]
                )
                + ([(f" n/a: {g.unavailable_reason}", "warn")] if g.unavailable_reason else [])
                + ([(f" {_stale(g)}", "warn")] if g.stale_age_s is not None else [])
            )
        return (fit_with_more(parts, width, BAR, lead, "GPUs"),)
    if not detailed and rows is not None and len(s.gpus) > rows:
        return collapse(
            [_gpu_head(g, width, detailed) for g in s.gpus],
            rows,
            [
                [(f"{g.key} ", "b"), (_util(u), _util_style(u))]
                for g, u in ((g, g.utilization_percent) for g in s.gpus)
            ],
            width,
        )
    out: list[Line] = []
    for g in s.gpus:
        out.append(_gpu_head(g, width, detailed))
        if not detailed:
            continue
        procs: list[list[Span]] = []
        if g.torch_allocated_bytes is not None or g.torch_reserved_bytes is not None:
            procs.append(
                [
                    ("torch alloc ", "dim"),
                    (cbytes(g.torch_allocated_bytes, NA), ""),
                    (" reserved ", "dim"),
                    (cbytes(g.torch_reserved_bytes, NA), ""),
                    (" peak ", "dim"),
                    (cbytes(g.torch_peak_allocated_bytes, NA), ""),
                ]
            )
        for gp in sorted(g.processes, key=lambda x: -(x.used_memory_bytes or 0)):
            p = roles.get(gp.pid)
            who = _who(p) if p is not None else "other"
            sm: list[Span] = [] if gp.sm_percent is None else [(f" sm {gp.sm_percent:.0f}%", "")]
            vram = cbytes(gp.used_memory_bytes, NA)
            procs.append([(f"pid {gp.pid} ", "dim"), (f"{who} ", ""), (vram, ""), *sm])
        if g.unattributed_processes:
            procs.append(_unattributed(g))
        out.extend(flow(procs, width, SEP, lead=[("  ", "")]))
    if detailed and s.gpu.process_memory_note:
        out.extend(wrap(s.gpu.process_memory_note, width, "dim"))
    return tuple(out)


#: Said instead of a bare n/a: NVML does not report utilisation on a MIG card or its slices.
MIG_UTIL = "utilisation not reported in MIG mode"


def _rate(bytes_per_s: float | None) -> str:
    return NA if bytes_per_s is None else cbytes(bytes_per_s) + "/s"


def _gpu_head(g: GpuDevice, width: int, detailed: bool) -> Line:
    used = ratio(g.memory_used_bytes, g.memory_total_bytes)
    name = f"GPU{g.key} " if g.mig_index is None else f"GPU{g.key} MIG "
    if g.is_mig_parent and g.memory_used_bytes is None:
        memory: list[Span] = [(name, "b"), ("MIG mode: memory and processes per MIG device", "dim")]
    else:
        memory = [
            (name, "b"),
            ("mem ", "dim"),
            (used_of(g.memory_used_bytes, g.memory_total_bytes, True), _level(used)),
        ] + ([(f" ({used * 100:.0f}%)", _level(used))] if used is not None else [])
    if g.mig_mode and g.utilization_percent is None:
        util: list[Span] = [(MIG_UTIL, "dim")]
    else:
        util = [("util ", "dim"), (_util(g.utilization_percent), _util_style(g.utilization_percent))]
    head: list[list[Span]] = [memory, util]
    if g.power_w is not None:
        head.append([(f"{g.power_w:.0f} W", "")])
    if g.sm_active_percent is not None:
        occupancy = [] if g.sm_occupancy_percent is None else [(f" occ {g.sm_occupancy_percent:.0f}%", "")]
        head.append([("SMs busy ", "dim"), (f"{g.sm_active_percent:.0f}%", ""), *occupancy])
    if g.pcie_rx_bytes_per_s is not None or g.pcie_tx_bytes_per_s is not None:
        head.append(
            [
                ("pcie in ", "dim"),
                (_rate(g.pcie_rx_bytes_per_s), ""),
                (" out ", "dim"),
                (_rate(g.pcie_tx_bytes_per_s), ""),
            ]
        )
    if g.clock_events:
        head.append([("clocks held down: ", "warn"), (", ".join(g.clock_events), "warn")])
    if g.unavailable_reason:
        head.append([("n/a: ", "warn"), (g.unavailable_reason, "warn")])
    if g.stale_age_s is not None:
        head.append([(_stale(g), "warn")])
    if g.torch_allocated_bytes is not None and not detailed:
        head.append([("torch ", "dim"), (used_of(g.torch_allocated_bytes, g.torch_reserved_bytes, True), "")])
    head.append([(g.name or "unknown device", "dim")])
    return fit(head, width, SEP)


def _unattributed(g: GpuDevice) -> list[Span]:
    """A container: NVML's processes on ``g`` by host pid, counted; how many are not the job's."""
    n = g.unattributed_processes or 0
    spans: list[Span] = [
        (f"{n} process{'' if n == 1 else 'es'} by host pid ", "dim"),
        (cbytes(g.unattributed_memory_bytes, NA), ""),
    ]
    others = g.other_processes
    if others is not None:
        spans.append(
            (" (none the job's)", "dim")
            if others == n
            else (f" ({others} not the job's)", "dim")
            if others
            else (" (maybe the job's)", "dim")
        )
    return spans


def _stale(g: GpuDevice) -> str:
    """NVML did not answer in time: the figures shown are this old (a reading that came just
    after the tick gave up is under a second old, which "0s" would read as fresh)."""
    age = g.stale_age_s
    return f"stale {'<1s' if age is not None and age < 1.0 else duration(age)} (NVML slow)"


def _util(util: float | None) -> str:
    return f"{cpct(util, NA)}%" if util is not None else NA


def _who(p: ProcessSample) -> str:
    if p.role == "worker":
        return f"worker {p.worker_id}" if p.worker_id is not None else "worker"
    return p.role


def _level(fraction: float | None) -> str:
    if fraction is None:
        return ""
    return "crit" if fraction > 0.95 else "warn" if fraction > 0.85 else ""


def _util_style(util: float | None) -> str:
    if util is None:
        return ""
    return "warn" if util < 30 else "ok" if util > 80 else ""
