"""The memory panel: the machine, the job (PSS, RSS, USS), its trend and shared memory."""

from __future__ import annotations

from dataclasses import dataclass

from dlmon.analysis.growth_reading import GROWING, NO_GROWTH, WARMING_UP, GrowthReading, growth_reading
from dlmon.model import MemorySummary
from dlmon.model.format import fd_limit_note, rotation_note
from dlmon.ui.fmt import NA, cbytes, duration, human_bytes, ratio
from dlmon.ui.state import DashboardState
from dlmon.ui.text import BAR, SEP, Lines, Span, fit
from dlmon.ui.views.common import label, used_of


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
    pinned_in_use = s.pinned.in_use_bytes if s.pinned is not None else None
    f = cbytes if compact else human_bytes

    system: list[list[Span]] = [
        [("used ", "dim"), (used_of(m.used_bytes, m.total_bytes, compact), "")],
        [("avail ", "dim"), (f(m.available_bytes, NA), avail_style)],
    ]
    cache = m.cgroup_cache_bytes
    cache_part: list[Span] = (
        [("cache ", "dim"), (f(cache), ""), ("" if compact else " (reclaimable)", "dim")] if cache else []
    )
    if m.cgroup_limit_bytes is not None:
        cg = used_of(cg_used, m.cgroup_limit_bytes, compact)
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
            (used_of(shm.used_bytes, shm.total_bytes, compact) if shm is not None else NA, ""),
        ],
        [
            ("pinned " if compact else "pinned pool ", "dim"),
            (f(pinned, NA), ""),
            (f" ({f(pinned_in_use)} in use)" if pinned_in_use is not None else "", "dim"),
        ],
        [("swap ", "dim"), (used_of(swap, m.swap_total_bytes, compact), "warn" if swap else "")],
    ]
    if pinned:  # cudaHostAlloc'd pages are shared memory: the trainer's shm counts them
        note = "shm counts the pinned pool" if compact else "the trainer's shm includes its pinned pool"
        shared.append([(note, "dim")])
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
