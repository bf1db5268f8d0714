"""fd_exhaustion: a process running out of file descriptors (RLIMIT_NOFILE).

torch's default ``file_descriptor`` sharing strategy keeps one fd per shared tensor in flight,
and a training that opens a file per sample and keeps it leaks one per sample: both end in
"Too many open files" (pytorch#973, #11201). Raised when a process holds most of its limit, or
when its count has grown steadily and would reach the limit soon.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from dlmon.analysis.detectors._base import Candidate, Context, duration
from dlmon.analysis.digest import process_label
from dlmon.analysis.severity import CRITICAL, WARNING
from dlmon.model.format import DEAD_STATES

FD_EXHAUSTION = "fd_exhaustion"


@dataclass(frozen=True, slots=True)
class FdNumbers:
    """fd_exhaustion's numbers (docs/detectors.md)."""

    fd_trend_window_s: float = 60.0
    fd_min_trend_span_s: float = 10.0
    fd_min_trend_points: int = 4
    fd_high_fraction: float = 0.8
    fd_hold_fraction: float = 0.7
    fd_critical_fraction: float = 0.95
    fd_eta_s: float = 600.0  # growing steadily and out within 10 min
    fd_critical_eta_s: float = 60.0
    fd_late_share: float = 0.25  # a leak at a steady rate rises by half its window's rise in the later half
    fd_min_growth: int = 32  # a rise smaller than this over the window is noise (sockets, pipes come and go)


def _trend(ctx: Context, pid: int, start_time: int) -> tuple[float | None, int, float]:
    """(fds per second over the window, readings, seconds covered); None when not a steady rise."""
    cfg = ctx.numbers(FdNumbers)
    index = ctx.index
    if index is None:
        pts = [
            (s.time, p.num_fds)
            for s in ctx.window(cfg.fd_trend_window_s)
            for p in s.processes
            if p.pid == pid and p.start_time == start_time and p.num_fds is not None
        ]
        return _judge(cfg, pts)
    # the same readings from the window's index: the trend without a scan of the window
    trail = index.fds.get((pid, start_time))
    if trail is None:
        return _judge(cfg, [])
    first = trail.start(index.seq_at(ctx.window_start(cfg.fd_trend_window_s)))
    last = len(trail.seqs) - 1
    n = last - first + 1
    if n < cfg.fd_min_trend_points:
        return None, max(0, n), 0.0
    times, fds = trail.times, trail.fds
    span = times[last] - times[first]
    rise = fds[last] - fds[first]
    falls = trail.falls[last] - trail.falls[first]
    if span < cfg.fd_min_trend_span_s or rise < cfg.fd_min_growth or falls > n // 4:
        return None, n, span
    middle = times[first] + span / 2
    if index.ordered:
        late = fds[bisect.bisect_left(times, middle, first, last + 1)]
    else:  # times out of order: the scan's own search
        late = next(v for t, v in zip(times[first:], fds[first:], strict=True) if t >= middle)
    if fds[last] - late < rise * cfg.fd_late_share:
        return None, n, span
    return rise / span, n, span


def _judge(cfg: FdNumbers, pts: list[tuple[float, int]]) -> tuple[float | None, int, float]:
    if len(pts) < cfg.fd_min_trend_points:
        return None, len(pts), 0.0
    span = pts[-1][0] - pts[0][0]
    rise = pts[-1][1] - pts[0][1]
    falls = sum(1 for a, b in itertools.pairwise(pts) if b[1] < a[1])
    if span < cfg.fd_min_trend_span_s or rise < cfg.fd_min_growth or falls > len(pts) // 4:
        return None, len(pts), span
    # steady: the later half of the window rises too (workers starting add a step of fds at once,
    # then the count stays flat: first-to-last alone reads that step as a fast leak)
    middle = pts[0][0] + span / 2
    late = next(n for t, n in pts if t >= middle)
    if pts[-1][1] - late < rise * cfg.fd_late_share:
        return None, len(pts), span
    return rise / span, len(pts), span


def detect_fd_exhaustion(ctx: Context) -> list[Candidate]:
    cfg = ctx.numbers(FdNumbers)
    out: list[Candidate] = []
    for p in ctx.latest.processes:
        if p.state in DEAD_STATES or p.num_fds is None or not p.fd_limit:
            continue
        key = f"fds:{p.pid}:{p.start_time}"
        held = ctx.is_active(FD_EXHAUSTION, key)
        used = p.num_fds / p.fd_limit
        rate, _n, span = _trend(ctx, p.pid, p.start_time)
        eta = (p.fd_limit - p.num_fds) / rate if rate else None
        high = used >= (cfg.fd_hold_fraction if held else cfg.fd_high_fraction)
        soon = eta is not None and eta <= cfg.fd_eta_s
        if not (high or soon or (held and rate)):
            continue
        label = process_label(p.role, p.pid, p.worker_id)
        trend = f", {rate * 60:.0f} more a minute over the last {duration(span)}" if rate else ""
        out_in = f": out of them in about {duration(eta)}" if eta is not None else ""
        out.append(
            Candidate(
                FD_EXHAUSTION,
                key,
                CRITICAL
                if used >= cfg.fd_critical_fraction or (eta is not None and eta <= cfg.fd_critical_eta_s)
                else WARNING,
                label,
                f"{label.capitalize()} holds {p.num_fds} of its {p.fd_limit} file descriptors "
                f"(RLIMIT_NOFILE){trend}{out_in}; then opens fail with 'Too many open files'.",
                "Close files the Dataset or the loop opens (with-blocks); with many workers or large "
                "prefetch, torch.multiprocessing.set_sharing_strategy('file_system') stops torch from "
                "holding one fd per shared tensor; or raise the limit (ulimit -n).",
                {
                    "pid": p.pid,
                    "fds": p.num_fds,
                    "fd_limit": p.fd_limit,
                    "fds_per_s": rate,
                    "eta_s": eta,
                    "used_fraction": round(used, 3),
                },
            )
        )
    return out
