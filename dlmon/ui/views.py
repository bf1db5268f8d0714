"""What each panel says, as styled lines: pure functions of the dashboard state (no UI imports).

A line is a tuple of ``(text, style)`` spans; the style names map to component classes of the
widgets (``dlmon.tcss``), so colour lives in the stylesheet and every meaning is also in the
words (NO_COLOR shows the same information). Panels compare the lines they get with the ones
they show and repaint only when they differ.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dlmon.analysis.growth_reading import GROWING, NO_GROWTH, WARMING_UP, GrowthReading, growth_reading
from dlmon.analysis.startup import startup_of
from dlmon.analysis.verdict import exit_verdict
from dlmon.analysis.wait import by_process, job_wall_wait
from dlmon.model import Alert, GpuDevice, LoaderSample, MemorySummary, ProcessSample, RankInfo, Snapshot
from dlmon.model.format import fd_limit_note, rotation_note, target_stopped
from dlmon.ui.columns import COLUMNS as COLUMNS
from dlmon.ui.columns import SORTS, Column, pss_stale, row_state
from dlmon.ui.fmt import DASH, NA, cbytes, cpct, duration, human_bytes, mbps, ratio
from dlmon.ui.state import DashboardState, ProcessRow, RankGroup
from dlmon.ui.text import (
    BAR,
    SEP,
    Line,
    Lines,
    Span,
    clip,
    collapse,
    fit,
    fit_with_more,
    flow,
    truncate,
    width_of,
    wrap,
)
from dlmon.ui.text import (
    text_of as text_of,  # re-exported: the tests read panels with it
)

STYLES = (
    *("b", "label", "dim", "ok", "warn", "crit", "head", "sorted", "title", "key", "stale"),
    *("cursor", "cursor-blur"),
)
AGENT_HINT = (
    "No DataLoader figures: they come from the in-process agent. Start the job with "
    "`dlmon run -- python train.py`, or add `import dlmon.agent; dlmon.agent.start()` to it."
)
AGENT_HINT_SHORT = "no loader data: `dlmon run`, or `import dlmon.agent; dlmon.agent.start()`"

_SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
_SEVERITY_STYLE = {"critical": "crit", "warning": "warn", "info": "dim"}
_SEVERITY_WORD = {"critical": "CRIT", "warning": "WARN", "info": "INFO"}


def label(text: str, width: int) -> Span:
    return (text.ljust(width), "label")


# ---- header ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HeaderInfo:
    description: str
    live: bool
    paused: bool
    now: float
    boot_time: float | None
    clock_ticks: int
    interval: float | None
    stale_after: float | None  # seconds without a snapshot before the header says so


def header_line(state: DashboardState, info: HeaderInfo, width: int) -> Line:
    s = state.latest
    left: list[Span] = [(" dlmon ", "title"), (" ", "")]
    right: list[list[Span]] = []
    if info.paused:
        right.append([("PAUSED", "warn")])
    if s is None:
        body = "waiting for the first sample of " + info.description
        if state.end_reason is not None:
            body = f"no data: the source ended ({state.end_reason})"
        return (*left, (clip(body, width - 8), "dim"))
    t = s.target
    if not t.alive:
        code = f"code {t.exit_code}" if t.exit_code is not None else "code unknown"
        right.append([(f"target exited ({code})", "crit")])
    else:
        uptime = None
        if t.start_unix_time is not None:
            uptime = s.time - t.start_unix_time
        elif info.boot_time is not None and t.start_time is not None:  # recordings made before it
            uptime = s.time - (info.boot_time + t.start_time / info.clock_ticks)
        right.append([("up ", "dim"), (duration(uptime), "")])
        if target_stopped(s):  # SIGSTOP or ^Z: alive, but no progress until SIGCONT
            right.insert(-1, [("target stopped", "warn")])
    right.append([(f"pid {t.pid}", "")])
    n = len(s.alerts)
    worst = min((_SEVERITY_ORDER.get(a.severity, 3) for a in s.alerts), default=3)
    alert_style = "crit" if worst == 0 else "warn" if worst == 1 else "dim"
    right.append([(f"{n} alert" + ("" if n == 1 else "s"), alert_style if n else "dim")])
    if not info.live:
        right.append([("replay", "warn")])
    if state.end_reason is not None and t.alive:
        right.append([(f"ended: {state.end_reason}", "warn")])
    elif info.stale_after is not None and t.alive and info.now - s.time > info.stale_after:
        right.append([(f"no data for {duration(info.now - s.time)}", "warn")])
    gpus = len(s.gpus)
    right.append([(f"{gpus} GPU" + ("" if gpus == 1 else "s"), "" if gpus else "dim")])
    right.append([(s.host, "")])
    right.append([(time.strftime("%H:%M:%S", time.localtime(s.time)), "dim")])

    # the command takes what the figures leave, but at least 12 cells
    avail = width - width_of(left)
    parts: list[list[Span]] = []
    used = 0
    for part in right:
        need = width_of(part) + 3
        if used + need > avail - 12:
            break
        parts.append(part)
        used += need
    cmd = clip(" ".join((t.cmdline or info.description).split()), max(1, avail - used - 1))
    out: list[Span] = [*left, (cmd, "b")]
    for part in parts:
        out.append(BAR)
        out.extend(part)
    return tuple(out)


# ---- memory ---------------------------------------------------------------------------------
def _of(used: int | None, total: int | None, compact: bool) -> str:
    f = cbytes if compact else human_bytes
    if total is None:
        return f(used) if compact else human_bytes(used)
    return f"{f(used)}/{f(total)}" if compact else f"{human_bytes(used)} of {human_bytes(total)}"


def _cgroup_used(m: MemorySummary) -> int | None:
    """The cgroup's working set (usage - inactive page cache); raw usage from older records."""
    return m.cgroup_working_set_bytes if m.cgroup_working_set_bytes is not None else m.cgroup_current_bytes


def memory_trend(state: DashboardState) -> GrowthReading:
    """The memory_growth rule's reading of the job (its alert, or its warm-up), never a slope of
    our own: the Trend line and the alert never disagree, and a warm-up is not read as a trend."""
    s = state.latest
    if s is None:
        return GrowthReading(WARMING_UP)
    watched = s.time - state.first_time if state.first_time is not None else None
    reading = growth_reading(s.alerts, watched)
    if reading.state == WARMING_UP and not s.target.alive:
        return GrowthReading(WARMING_UP)  # the job ended: no warm-up left to count down
    return reading


LIMIT_IN_REACH = 4.0  # the cgroup limit is drawn when it is at most this many times the job's PSS


@dataclass(frozen=True, slots=True)
class MemoryChartPlan:
    """What the memory chart plots: the job on its own scale; the machine stays in the text."""

    unit: str
    scale: float
    limit: bool  # the cgroup limit is close enough to share the job's axis
    anon: bool  # the kernel splits anon / file PSS: the anon line is what a leak moves


def memory_chart_plan(state: DashboardState) -> MemoryChartPlan:
    s = state.latest
    pss = s.memory.pss_sum_bytes if s is not None else None
    limit = s.memory.cgroup_limit_bytes if s is not None else None
    anon = (
        s is not None and s.memory.pss_anon_sum_bytes is not None and s.memory.pss_file_sum_bytes is not None
    )
    in_reach = bool(pss and limit and limit <= LIMIT_IN_REACH * pss)
    top = float(limit) if in_reach and limit else float(pss or 0)
    if top >= 2**30:
        return MemoryChartPlan("GiB", float(2**30), in_reach, anon)
    return MemoryChartPlan("MiB", float(2**20), in_reach, anon)


def _trend_text(reading: GrowthReading, compact: bool) -> list[Span]:
    if reading.state == WARMING_UP:
        if compact:
            return [("trend: warm-up", "dim")]
        left = f", {duration(reading.warmup_left_s)} left" if reading.warmup_left_s is not None else ""
        return [(f"none yet (warm-up{left})", "dim")]
    if reading.state == NO_GROWTH:
        return [("no growth", "ok")]
    spans: list[Span] = [("growing", "warn")]
    if reading.rate_bytes_per_s is not None:
        per_min = reading.rate_bytes_per_s * 60
        amount = cbytes(abs(per_min)) if compact else human_bytes(abs(per_min))
        spans = [(f"{'+' if per_min >= 0 else '-'}{amount}/min", "warn")]
    eta = reading.eta_s
    if eta is not None:
        style = "crit" if eta < 600 else "warn" if eta < 3600 else "dim"
        spans.append((f" full in ~{duration(eta)}" if compact else f" · limit in ~{duration(eta)}", style))
    elif reading.fits and not compact:
        spans.append((" · levels off below the limit", "ok"))
    return spans


def _trend_basis(reading: GrowthReading) -> str:
    if reading.state == GROWING and reading.window_s is not None:
        return f"(memory_growth, last {duration(reading.window_s)})"
    return "" if reading.state == WARMING_UP else "(memory_growth rule)"


def memory_lines(state: DashboardState, width: int, compact: bool) -> Lines:
    s = state.latest
    if s is None:
        return ((("waiting for data…", "dim"),),)
    m = s.memory
    cg_used = _cgroup_used(m)
    pct = ratio(cg_used, m.cgroup_limit_bytes)
    cg_style = "crit" if (pct or 0) > 0.9 else "warn" if (pct or 0) > 0.75 else ""
    avail_style = ""
    if m.available_bytes is not None and m.total_bytes:
        avail_style = "crit" if m.available_bytes < 0.05 * m.total_bytes else ""
    double = ratio(m.rss_sum_bytes, m.pss_sum_bytes)
    pss_text = human_bytes(m.pss_sum_bytes) if not compact else cbytes(m.pss_sum_bytes, NA)
    if m.pss_missing and m.pss_sum_bytes is not None:
        pss_text += f" (+{m.pss_missing} unread)"
    reading = memory_trend(state)
    shm = s.shm
    swap = m.swap_used_bytes
    pinned = s.pinned.bytes if s.pinned is not None else None
    f = cbytes if compact else human_bytes

    system: list[list[Span]] = [
        [("used ", "dim"), (_of(m.used_bytes, m.total_bytes, compact), "")],
        [("avail ", "dim"), (f(m.available_bytes, NA), avail_style)],
    ]
    cache = m.cgroup_cache_bytes
    cache_part: list[Span] = (
        [("cache ", "dim"), (f(cache), ""), ("" if compact else " (reclaimable)", "dim")] if cache else []
    )
    if m.cgroup_limit_bytes is not None:
        cg = _of(cg_used, m.cgroup_limit_bytes, compact)
        name = "cgroup "
        if m.cgroup_working_set_bytes is not None:
            name = "cgroup ws " if compact else "cgroup working set "
        system.append([(name, "dim"), (cg, cg_style), (f" {pct * 100:.0f}%" if pct else "", cg_style)])
    elif s.cgroup is not None:
        system.append([("cgroup ", "dim"), ("no limit", "dim")])
    elif m.cgroup_unavailable is not None:
        system.append([("cgroup ", "dim"), (m.cgroup_unavailable, "dim")])
    if cache_part and (m.cgroup_limit_bytes is not None or s.cgroup is not None):
        system.append(cache_part)
    if m.oom_kill_count and state.oom_baseline is not None:
        new = m.oom_kill_count - state.oom_baseline
        if new > 0:
            system.append([(f"OOM kills +{new} while watching", "crit")])
        else:
            system.append([(f"OOM kills {m.oom_kill_count} since boot", "dim")])
    job: list[list[Span]] = [
        [("PSS ", "dim"), (pss_text, "b"), ("" if compact else " (true total)", "dim")],
        [
            ("RSS sum ", "dim"),
            (f(m.rss_sum_bytes, NA), ""),
            (f" ({double:.1f}x PSS)" if double is not None else "", "warn" if (double or 0) > 2 else "dim"),
        ],
        [("USS ", "dim"), (f(m.uss_sum_bytes, NA), "")],
        _trend_text(reading, compact),
    ]
    if m.pss_file_sum_bytes is not None and m.pss_anon_sum_bytes is not None:
        job.insert(1, [("anon ", "dim"), (f(m.pss_anon_sum_bytes), "")])
        job.insert(2, [("mapped files ", "dim"), (f(m.pss_file_sum_bytes), ""), (" reclaimable", "dim")])
    shared: list[list[Span]] = [
        [("shm ", "dim"), (f(m.shmem_bytes, NA), "")],
        [
            ("/dev/shm ", "dim"),
            (_of(shm.used_bytes, shm.total_bytes, compact) if shm is not None else NA, ""),
        ],
        [("pinned ", "dim"), (f(pinned, NA), "")],
        [("swap ", "dim"), (_of(swap, m.swap_total_bytes, compact), "warn" if swap else "")],
    ]
    if s.processes_without_held_fds:
        shared.append([(fd_limit_note(s.processes_without_held_fds), "warn")])
    rotation = rotation_note(s)
    if rotation:
        shared.append([(rotation, "dim")])
    if compact:
        lead = 5
        return (
            fit(system, width, BAR, lead=[label("MEM", lead)]),
            fit(job, width, BAR, lead=[label("", lead)]),
            fit(shared, width, BAR, lead=[label("", lead)]),
        )
    lead = 8
    return (
        fit(system, width, SEP, lead=[label("System", lead)]),
        fit(job[:-1], width, SEP, lead=[label("Job", lead)]),
        fit(
            [[("PSS", "dim")], _trend_text(reading, False), [(_trend_basis(reading), "dim")]],
            width,
            (" ", ""),
            [label("Trend", lead)],
        ),
        fit(shared, width, SEP, lead=[label("Shared", lead)]),
    )


# ---- GPU ------------------------------------------------------------------------------------
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
                [
                    (f"{g.index}: ", "dim"),
                    (_of(g.memory_used_bytes, g.memory_total_bytes, True), _level(used)),
                    (f" {_util(g.utilization_percent)}", ""),
                ]
                + ([(f" n/a: {g.unavailable_reason}", "warn")] if g.unavailable_reason else [])
            )
        return (fit_with_more(parts, width, BAR, lead, "GPUs"),)
    if not detailed and rows is not None and len(s.gpus) > rows:
        return collapse(
            [_gpu_head(g, width, detailed) for g in s.gpus],
            rows,
            [
                [(f"{g.index} ", "b"), (_util(u), _util_style(u))]
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
            procs.append([(f"pid {gp.pid} ", "dim"), (f"{who} ", ""), (cbytes(gp.used_memory_bytes, NA), "")])
        out.extend(flow(procs, width, SEP, lead=[("  ", "")]))
    if detailed and s.gpu.process_memory_note:
        out.extend(wrap(s.gpu.process_memory_note, width, "dim"))
    return tuple(out)


def _gpu_head(g: GpuDevice, width: int, detailed: bool) -> Line:
    used = ratio(g.memory_used_bytes, g.memory_total_bytes)
    head: list[list[Span]] = [
        [
            (f"GPU{g.index} ", "b"),
            ("mem ", "dim"),
            (_of(g.memory_used_bytes, g.memory_total_bytes, True), _level(used)),
        ]
        + ([(f" ({used * 100:.0f}%)", _level(used))] if used is not None else []),
        [("util ", "dim"), (_util(g.utilization_percent), _util_style(g.utilization_percent))],
    ]
    if g.unavailable_reason:
        head.append([("n/a: ", "warn"), (g.unavailable_reason, "warn")])
    if g.torch_allocated_bytes is not None and not detailed:
        head.append([("torch ", "dim"), (_of(g.torch_allocated_bytes, g.torch_reserved_bytes, True), "")])
    head.append([(g.name or "unknown device", "dim")])
    return fit(head, width, SEP)


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


# ---- IO -------------------------------------------------------------------------------------
def io_lines(state: DashboardState, width: int, compact: bool, rows: int | None = None) -> Lines:
    s = state.latest
    if s is None:
        return ((("waiting for data…", "dim"),),)
    d_count = state.d_state_count()
    pr = s.cgroup.pressure if s.cgroup is not None and s.cgroup.pressure is not None else s.pressure
    psi: list[Span] = [("PSI io ", "dim")]
    if pr is None or (pr.io_some_avg10 is None and pr.io_full_avg10 is None):
        psi.append((NA, "dim"))
    else:
        psi += [
            ("some ", "dim"),
            (f"{cpct(pr.io_some_avg10, NA, 1)}%", _psi_style(pr.io_some_avg10)),
            (" full ", "dim"),
            (f"{cpct(pr.io_full_avg10, NA, 1)}%", _psi_style(pr.io_full_avg10)),
        ]
    dstate: list[Span] = [
        (
            f"{d_count} in D state"
            if compact
            else f"{d_count} process{'es' if d_count != 1 else ''} in D state",
            "warn" if d_count else "",
        )
    ]
    disks = sorted(s.disks, key=lambda d: -(d.util_percent or 0.0))
    if compact:
        parts: list[list[Span]] = []
        if disks:
            d = disks[0]
            parts.append(
                [
                    (f"{d.name} ", "b"),
                    ("r ", "dim"),
                    (f"{mbps(d.read_bytes_per_s)}MB/s ", ""),
                    (f"{cpct(d.util_percent)}%", _util_disk(d.util_percent)),
                    (f" {_ms(d.r_await_ms)}", ""),
                    (f" q{_q(d.queue_depth)}", ""),
                ]
            )
            if len(disks) > 1:
                parts.append([(f"+{len(disks) - 1} disks", "dim")])
        else:
            parts.append([("no disks", "dim")])
        parts += [psi, dstate]
        return (fit(parts, width, BAR, lead=[label("IO", 5)]),)
    out: list[Line] = []
    for d in disks:
        out.append(
            fit(
                [
                    [(d.name.ljust(8), "b")],
                    [("read ", "dim"), (f"{mbps(d.read_bytes_per_s, NA)} MB/s", "")],
                    [("write ", "dim"), (f"{mbps(d.write_bytes_per_s, NA)} MB/s", "")],
                    [("util ", "dim"), (f"{cpct(d.util_percent, NA)}%", _util_disk(d.util_percent))],
                    [("await ", "dim"), (_ms(d.r_await_ms), "")],
                    [("queue ", "dim"), (_q(d.queue_depth), "")],
                ],
                width,
                (" ", ""),
            )
        )
    out = list(
        collapse(
            out,
            rows,
            [
                [(f"{d.name} ", "b"), (f"{cpct(u, NA)}%", _util_disk(u))]
                for d, u in ((d, d.util_percent) for d in disks)
            ],
            width,
        )
    )
    if not disks:
        out.append((("no whole disks found", "dim"),))
    out.append(fit([psi, dstate], width, SEP))
    return tuple(out)


def _ms(v: float | None) -> str:
    return DASH if v is None else f"{v:.1f}ms"


def _q(v: float | None) -> str:
    return DASH if v is None else f"{v:.2f}"


def _psi_style(v: float | None) -> str:
    return "" if v is None else "crit" if v > 20 else "warn" if v > 5 else ""


def _util_disk(v: float | None) -> str:
    return "" if v is None else "warn" if v > 80 else ""


# ---- throughput -----------------------------------------------------------------------------
def throughput_lines(state: DashboardState, width: int, compact: bool, rows: int | None = None) -> Lines:
    s = state.latest
    if s is None:
        return ((("waiting for data…", "dim"),),)
    lead = [label("DATA", 5)] if compact else []
    if not s.loaders:
        if not compact:
            return wrap(s.agent_note or AGENT_HINT, width, "warn" if s.agent_note else "dim")
        return (fit([[(s.agent_note or AGENT_HINT_SHORT, "dim")]], width, lead=lead),)
    out: list[Line] = []
    loaders = list(s.loaders) if not compact else list(s.loaders[:1])
    rest: list[LoaderSample] = []
    if rows is not None and len(loaders) > rows:  # the busiest in full, the others summed up
        loaders.sort(key=lambda x: -(x.batches_per_s or 0.0))
        loaders, rest = loaders[: max(0, rows - 1)], loaders[max(0, rows - 1) :]
    groups = by_process(s.loaders)
    for ld in loaders:
        wait = None if ld.data_wait_fraction is None else ld.data_wait_fraction * 100
        wait_part: list[Span] = [("data wait ", "dim"), (f"{cpct(wait, NA)}%", _wait_style(wait))]
        if len(groups.get(ld.pid, ())) > 1 and ld.wall_wait_fraction is not None:
            # several loaders: its own share beside what it costs the job (a validation burst)
            wall = ld.wall_wait_fraction * 100
            wait_part += [(" of its own time, ", "dim"), (f"{cpct(wall, NA)}%", _wait_style(wall))]
            wait_part.append((" of the job's", "dim"))
        parts: list[list[Span]] = [
            [(_rate(ld.batches_per_s), "b"), (" batch/s", "dim")],
            [(_rate(ld.samples_per_s), ""), (" samples/s", "dim")],
            wait_part,
        ]
        startup = startup_of(s, ld)
        if startup is not None and startup.seconds_per_epoch is not None:
            share = "" if startup.share is None else f" ({startup.share:.0%})"
            parts.append(
                [
                    ("start-up " if compact else "worker start-up ", "dim"),
                    (f"{startup.seconds_per_epoch:.1f} s/epoch{share}", "warn" if startup.large else ""),
                ]
            )
        if not compact:
            cfg = [f"{ld.num_workers if ld.num_workers is not None else '?'} workers"]
            if ld.batch_size is not None:
                cfg.append(f"bs {ld.batch_size}")
            if ld.pin_memory:
                cfg.append("pinned")
            if ld.persistent_workers:
                cfg.append("persistent")
            if ld.framework is not None:
                cfg.append(ld.framework)
            name = f"{ld.role} · {clip(ld.label, 28)}" if ld.role else clip(ld.label, 28)
            parts.insert(0, [(name, "b")])
            parts.append([(" ".join(cfg), "dim")])
        else:
            parts.append([(f"{ld.role} · {clip(ld.label, 24)}" if ld.role else clip(ld.label, 24), "dim")])
            if len(s.loaders) > 1:
                parts.append([(f"+{len(s.loaders) - 1} loaders", "dim")])
        out.append(fit(parts, width, BAR if compact else SEP, lead=lead))
    if not compact and (rows is None or len(out) + len(groups) + (1 if rest else 0) <= rows):
        for pid, mine in sorted(groups.items()):
            job = job_wall_wait(mine) if len(mine) > 1 else None
            if job is None:
                continue
            pct = job * 100
            who = f"pid {pid} " if len(groups) > 1 else ""
            out.append(
                fit(
                    [[(f"job {who}data wait ", "dim"), (f"{cpct(pct, NA)}%", _wait_style(pct))],
                     [("of wall time, over its loaders", "dim")]],
                    width,
                    SEP,
                )
            )  # fmt: skip
    if rest:
        total = sum(x.batches_per_s or 0.0 for x in rest)
        waits = [x.data_wait_fraction * 100 for x in rest if x.data_wait_fraction is not None]
        worst = max(waits) if waits else None
        out.append(
            fit(
                [
                    [(f"{_rate(total)}", "b"), (" batch/s in all", "dim")],
                    [("data wait up to ", "dim"), (f"{cpct(worst, NA)}%", _wait_style(worst))],
                    [("5 shows each", "dim")],
                ],
                width,
                SEP,
                lead=[(f"+{len(rest)} more loaders: ", "key")],
            )
        )
    return tuple(out)


def _rate(v: float | None) -> str:
    if v is None:
        return NA
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _wait_style(v: float | None) -> str:
    return "" if v is None else "crit" if v > 50 else "warn" if v > 20 else "ok"


# ---- alerts ---------------------------------------------------------------------------------
def sorted_alerts(alerts: Sequence[Alert]) -> list[Alert]:
    return sorted(alerts, key=lambda a: (_SEVERITY_ORDER.get(a.severity, 3), a.since))


def alert_lines(state: DashboardState, width: int, compact: bool, panel_key: str = "6") -> Lines:
    s = state.latest
    alerts = sorted_alerts(s.alerts) if s is not None else []
    if compact:
        lead = [label("ALERT", 6)]
        if not alerts:
            n = state.analysis_errors
            note: Line = ((f" · analysis failed {n} times [{panel_key}]", "dim"),) if n else ()
            return (truncate((*lead, ("none", "dim"), *note), width),)
        counts: dict[str, int] = {}
        for a in alerts:
            counts[a.severity] = counts.get(a.severity, 0) + 1
        first = alerts[0]
        summary = ", ".join(f"{n} {sev}" for sev, n in sorted(counts.items(), key=lambda kv: _rank(kv[0])))
        head = fit(
            [[(summary, _SEVERITY_STYLE.get(first.severity, ""))], [(f"{first.kind}: {first.subject}", "b")]],
            width - 6,
            BAR,
            lead=lead,
        )
        rest = width - 6 - width_of(head) - 3
        if rest > 8:
            head = (*head, BAR, (clip(first.message, rest), ""))
        return ((*head, (f" [{panel_key}]", "key")),)
    failed = analysis_failed_lines(state, width)
    if not alerts:
        return ((("no alerts", "dim"),), *failed)
    assert s is not None
    out: list[Line] = []
    verdict = exit_verdict(s, None) if not s.target.alive else None
    if verdict is not None:  # the final frame says how it ended, until the user quits
        for chunk in textwrap.wrap(verdict, max(10, width)):
            out.append(((chunk, "crit"),))
    for a in alerts:
        sev = _SEVERITY_WORD.get(a.severity, a.severity.upper()[:4])
        since = duration(s.time - a.since)
        title: Line = (
            (sev.ljust(5), _SEVERITY_STYLE.get(a.severity, "")),
            (f"{a.kind} ", "b"),
            (f"{a.subject}", ""),
            (f" (for {since})", "dim"),
        )
        out.append(truncate(title, width))
        for chunk in textwrap.wrap(a.message, max(10, width - 5)):
            out.append(((" " * 5, ""), (chunk, "")))
        for k, chunk in enumerate(textwrap.wrap(a.advice, max(10, width - 7))):
            out.append(((" " * 5, ""), ("→ " if k == 0 else "  ", "key"), (chunk, "dim")))
    return (*out, *failed)


def analysis_failed_lines(state: DashboardState, width: int) -> Lines:
    """``analysis failed 3 times (last: ValueError: ...)``: a detector that raised adds nothing
    that tick, so its alerts may be missing; said dimly under the alerts, never hidden."""
    n = state.analysis_errors
    if n <= 0:
        return ()
    times = "once" if n == 1 else f"{n} times"
    last = f" (last: {state.analysis_error})" if state.analysis_error else ""
    text = f"analysis failed {times}{last}; alerts from the failing detector may be missing"
    return wrap(text, width, "dim")


def _rank(severity: str) -> int:
    return _SEVERITY_ORDER.get(severity, 3)


# ---- workers table --------------------------------------------------------------------------
def table_columns(width: int, *, batches: bool, gpu: bool) -> tuple[Column, ...]:
    shown = {None: True, "batches": batches, "gpu": gpu}
    cols = [c for c in COLUMNS if shown[c.needs]]
    while cols and sum(c.width for c in cols) + len(cols) - 1 > width:
        cols.remove(min(cols, key=lambda c: c.priority))
    return tuple(cols)


def table_cells(row: ProcessRow, cols: Sequence[Column], interval: float | None) -> Line:
    row_style = "dim" if row.gone else ""
    spans: list[Span] = []
    for i, c in enumerate(cols):
        cell = c.cell(row, interval)
        text, style = (cell, row_style) if isinstance(cell, str) else cell
        text = text[: c.width]
        if i:
            spans.append((" ", row_style))
        spans.append((text.rjust(c.width) if c.right else text.ljust(c.width), style))
    return tuple(spans)


def table_header(cols: Sequence[Column], sort: str, reverse: bool) -> Line:
    spans: list[Span] = []
    for i, c in enumerate(cols):
        title = c.title
        style = "head"
        if c.sort is not None and c.key == sort:
            title += "▴" if reverse else "▾"
            style = "sorted"
        title = title[: c.width] if len(title) > c.width else title
        if i:
            spans.append((" ", "head"))
        spans.append((title.rjust(c.width) if c.right else title.ljust(c.width), style))
    return tuple(spans)


def sort_caption(sort: str, reverse: bool, count: int) -> str:
    how = SORTS.get(sort)
    natural = how is not None and how.value is None
    order = "ascending" if reverse else ("natural order" if natural else "descending")
    return f"{count} processes · sorted by {how.name if how is not None else sort} ({order})"


def rank_line(group: RankGroup, expanded: bool, width: int) -> Line:
    """``  ▾ rank 3 (local 1) · 8 workers · PSS 9.08G with its workers · 8.5 batch/s · data wait 25%``
    under a rank (its number when the agent read it from the launcher's environment)."""
    wait = None if group.data_wait_fraction is None else group.data_wait_fraction * 100
    n = len(group.workers)
    owner = group.owner.process
    which = [] if owner.rank is None else [(RankInfo(owner.rank, owner.local_rank).label() + " · ", "b")]
    return fit(
        [
            [("▾ " if expanded else "▸ ", "key"), *which, (f"{n} worker" + ("" if n == 1 else "s"), "b")],
            [("PSS ", "dim"), (cbytes(group.pss_bytes, NA), "b"), (" with its workers", "dim")],
            [(_rate(group.batches_per_s), ""), (" batch/s", "dim")],
            [("data wait ", "dim"), (f"{cpct(wait, NA)}%", _wait_style(wait))],
        ],
        width,
        SEP,
        lead=[("  ", "")],
    )


def stall_of(row: ProcessRow, alerts: Sequence[Alert]) -> Alert | None:
    """The stall alert that names this row's process as the stuck one."""
    for a in alerts:
        if a.kind == "stall" and a.evidence.get("pid") == row.process.pid and not row.gone:
            return a
    return None


def stuck_line(row: ProcessRow, alerts: Sequence[Alert], width: int) -> Line | None:
    """``  └ stuck in hang_here (jobs.py:88) for 2.2 min`` under a stuck worker's row."""
    a = stall_of(row, alerts)
    if a is None:
        return None
    where = a.evidence.get("stuck_in")
    secs = a.evidence.get("stalled_s")
    text = f"  └ stuck in {where}" if where else "  └ stuck"
    if isinstance(secs, (int, float)):
        text += f" for {duration(float(secs))}"
    return ((clip(text, width), "crit"),)


# ---- worker detail --------------------------------------------------------------------------
def detail_lines(row: ProcessRow, snapshot: Snapshot | None, width: int) -> Lines:
    p = row.process
    interval = snapshot.interval_s if snapshot is not None else None
    st, st_style = row_state(row)
    age = p.pss_age_s
    lines: list[Line] = [
        fit(
            [
                [("role ", "dim"), (p.role, "b")],
                [("worker id ", "dim"), (str(p.worker_id) if p.worker_id is not None else NA, "")],
                [("pid ", "dim"), (str(p.pid), "b")],
                [("ppid ", "dim"), (str(p.ppid) if p.ppid is not None else NA, "")],
                [("comm ", "dim"), (p.comm, "")],
                [("state ", "dim"), (st, st_style)],
            ],
            width,
        ),
        fit(
            [
                [("pids under this row ", "dim"), (str(row.pids_seen), "")],
                [("seen for ", "dim"), (duration(row.last_seen - row.first_seen), "")],
                [("loader ", "dim"), (row.loader_id or NA, "")],
                [("batch share ", "dim"), (f"{row.batch_share * 100:.0f}%" if row.batch_share else NA, "")],
                [("start_time ", "dim"), (f"{p.start_time} ticks after boot", "")],
            ],
            width,
        ),
        (),
        fit(
            [
                [("RSS ", "dim"), (human_bytes(p.rss_bytes), "b")],
                [("anon ", "dim"), (human_bytes(p.rss_anon_bytes), "")],
                [("file ", "dim"), (human_bytes(p.rss_file_bytes), "")],
                [("shmem ", "dim"), (human_bytes(p.shmem_bytes), "")],
            ],
            width,
        ),
        fit(
            [
                [("PSS ", "dim"), (human_bytes(p.pss_bytes), "b")],
                [("USS ", "dim"), (human_bytes(p.uss_bytes), "b")],
                [("PSS shmem ", "dim"), (human_bytes(p.pss_shmem_bytes), "")],
                [("swap ", "dim"), (human_bytes(p.swap_bytes), "")],
                [
                    ("read ", "dim"),
                    (
                        (f"{duration(age)} ago" + (", nothing moved since" if p.pss_still else ""))
                        if age is not None
                        else NA,
                        "stale" if pss_stale(p, interval) else "",
                    ),
                ],
            ],
            width,
        ),
        fit(
            [
                [("locked ", "dim"), (human_bytes(p.locked_bytes), "")],
                [("pinned ", "dim"), (human_bytes(p.pinned_bytes), "")],
                [("GPU ", "dim"), (human_bytes(p.gpu_memory_bytes), "")],
            ],
            width,
        ),
        fit(
            [
                [("CPU ", "dim"), (f"{cpct(p.cpu_percent, NA, 1)}%", "b")],
                [("threads ", "dim"), (str(p.num_threads) if p.num_threads is not None else NA, "")],
                [("fds ", "dim"), (str(p.num_fds) if p.num_fds is not None else NA, "")],
                [("invol. switches ", "dim"), (_per_s(p.nonvoluntary_ctxt_switches_per_s), "")],
            ],
            width,
        ),
        fit(
            [
                [("read ", "dim"), (f"{mbps(p.read_bytes_per_s, NA)} MB/s", "b")],
                [("write ", "dim"), (f"{mbps(p.write_bytes_per_s, NA)} MB/s", "")],
                [("read total ", "dim"), (human_bytes(p.read_bytes), "")],
                [("written ", "dim"), (human_bytes(p.write_bytes), "")],
            ],
            width,
        ),
    ]
    if p.unavailable:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(p.unavailable.items()))
        lines.append(((clip("unavailable: " + reasons, width), "warn"),))
    if row.death is not None:
        d = row.death
        how = f"signal {d.signal}" if d.signal is not None else f"exit code {d.exit_code}"
        lines.append(((f"died: {how} at {time.strftime('%H:%M:%S', time.localtime(d.time))}", "crit"),))
    lines.extend(stack_lines(row, snapshot, width))
    return tuple(lines)


def stack_lines(row: ProcessRow, snapshot: Snapshot | None, width: int) -> Lines:
    """Where this process is stuck or crashed: the whole stack behind its stall / death alert."""
    alerts = snapshot.alerts if snapshot is not None else ()
    for a in alerts:
        if a.evidence.get("pid") != row.process.pid or a.kind not in ("stall", "worker_died", "trainer_died"):
            continue
        stack = a.evidence.get("stack")
        if not isinstance(stack, str) or not stack:
            continue
        head = "stuck" if a.kind == "stall" else "died"
        extra = [f"{k} {a.evidence[k]}" for k in ("state", "wchan", "reading") if a.evidence.get(k)]
        title = f"{head}: " + "  ".join(extra) if extra else head + ":"
        out: list[Line] = [(), ((clip(title, width), "crit"),)]
        out.extend(((clip("  " + ln, width), ""),) for ln in stack.splitlines())
        return tuple(out)
    return ()


def _per_s(v: float | None) -> str:
    return NA if v is None else f"{v:.0f}/s"
