"""``dlmon cluster``: read the nodes (directly or from Prometheus), build the view, print it as
one JSON object or a table, or hand a refreshing reader to the screen."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dlmon.analysis.detectors._base import duration
from dlmon.cluster.promapi import PrometheusError, read_prometheus, read_trends
from dlmon.cluster.scrape import scrape_nodes
from dlmon.cluster.trend import History, Slots, Trend, slots, sparkline
from dlmon.cluster.view import ClusterView, NodeRow, cluster_view, with_trends
from dlmon.model.format import human_bytes

EXIT_NO_NODE = 1  # --once: not one node answered
EXIT_BAD_SOURCE = 2  # the Prometheus URL cannot be read as one


class ClusterFailed(RuntimeError):
    def __init__(self, message: str, code: int = EXIT_BAD_SOURCE) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    nodes: tuple[str, ...]  # HOST:PORT (or URLs) to scrape directly; empty with ``prometheus``
    prometheus: str | None
    job: str | None
    match: str | None
    timeout_s: float
    window_s: float  # the per-interval figures are averaged over this (several scrapes, avg_over_time)
    trend_s: float = 300.0  # each node's batches/s and data wait over this long, in trend.POINTS slots


Reader = Callable[[], ClusterView]


def reader(options: ClusterOptions) -> Reader:
    """A function reading the cluster once more, averaged over ``window_s``, with each node's
    trend over ``trend_s``: Prometheus's range queries, or (direct) what this reader saw at its
    own refreshes. The straggler it named last is held (see view.find_straggler)."""
    history = History(options.trend_s)
    last: list[ClusterView] = []
    asked: list[tuple[Slots, dict[str, Trend] | None, str | None]] = []  # the range queries' last answer

    def trends_at(url: str, now: float) -> tuple[Slots | None, dict[str, Trend], str | None]:
        """The range queries' answer, asked again once a slot has passed since the last (not at
        every refresh: each reads the whole --trend on Prometheus, a week of every node's samples
        at the longest); a failure too stands for a slot."""
        if not asked or now - asked[0][0].end >= asked[0][0].step_s:
            where = slots(options.trend_s, now)
            try:
                answer = read_trends(url, options.job, options.match, where, options.timeout_s)
            except PrometheusError as exc:  # the figures of now stand; their history is n/a
                asked[:] = [(where, None, f"no trends: {exc}")]
            else:
                asked[:] = [(where, answer, None)]
        where, got, note = asked[0]
        return (where, got, None) if got is not None else (None, {}, note)

    def read() -> ClusterView:
        held = last[-1].straggler if last else None
        if options.prometheus is not None:
            try:
                readings, source = read_prometheus(
                    options.prometheus, options.job, options.match, options.window_s, options.timeout_s
                )
            except PrometheusError as exc:
                raise ClusterFailed(str(exc)) from None
            now = time.time()
            view = with_trends(cluster_view(readings, source, now, held), *trends_at(options.prometheus, now))
        else:
            count = round(options.window_s) + 1  # a scrape a second, both ends included
            readings = scrape_nodes(options.nodes, options.timeout_s, readings=count, every_s=1.0)
            source = f"{len(options.nodes)} dlmon exporter{'s' if len(options.nodes) != 1 else ''}"
            now = time.time()
            view = cluster_view(readings, source, now, held)
            figures = ((n.address, n.batches_per_s, n.data_wait) for n in view.nodes if n.answered)
            view = with_trends(view, *history.record(now, figures))
        last[:] = [view]
        return view

    return read


def as_dict(view: ClusterView) -> dict[str, Any]:
    data = dataclasses.asdict(view)
    for node, row in zip(data["nodes"], view.nodes, strict=True):
        node["severity"] = ("ok", "info", "warning", "critical")[row.severity]
    return data


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def node_cells(node: NodeRow) -> tuple[str, ...]:
    """(host, batches/s, its trend, data wait, its trend, headroom, time to OOM, GPU memory,
    GPU idle, verdict)."""
    if node.problem is not None:
        return (node.host, "", "", "", "", "", "", "", "", node.problem)
    gpu = (
        "n/a"
        if node.gpu_memory_total_bytes is None
        else f"{human_bytes(node.gpu_memory_used_bytes)}/{human_bytes(node.gpu_memory_total_bytes)}"
    )
    oom = "n/a" if node.time_to_oom_s is None else duration(node.time_to_oom_s)
    verdict = node.verdict.reason if node.verdict else "ok"
    if node.notes:
        verdict += " · " + " · ".join(node.notes)
    return (
        node.host,
        _rate(node.batches_per_s),
        sparkline(node.batches_per_s_trend),
        _pct(node.data_wait),
        sparkline(node.data_wait_trend, top=1.0),
        human_bytes(node.headroom_bytes),
        oom,
        gpu,
        _pct(node.gpu_idle),
        verdict,
    )


HEADERS = (
    "node", "batch/s", "batch/s trend", "wait", "wait trend", "headroom", "to OOM", "GPU mem", "GPU idle",
    "verdict",
)  # fmt: skip


def table(view: ClusterView) -> str:
    rows: list[tuple[str, ...]] = [HEADERS]
    for node in view.nodes:
        rows.append(node_cells(node))
        for r in node.ranks:
            why = r.verdict.reason if r.verdict else ""
            rows.append(
                (f"  rank {r.rank}", _rate(r.batches_per_s), "", _pct(r.data_wait), "", "", "", "", "", why)
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS) - 1)]
    lines = [f"straggler: {view.straggler_note}"] + ([view.trend_note] if view.trend_note else [])
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])
    return "\n".join(line.rstrip() for line in lines)


def run_cluster(
    options: ClusterOptions,
    *,
    once: bool,
    as_json: bool,
    interval_s: float,
    screen: Callable[[Reader, float, ClusterView], int] | None,
) -> int:
    read = reader(options)
    if once or screen is None:
        shown = False
        while True:
            try:
                view = read()
            except ClusterFailed as exc:
                if once or not shown:  # the source is wrong: one line and the exit status
                    raise
                # a stream outlives a Prometheus restart, as the screen does: said, and read again
                sys.stderr.write(f"dlmon: refresh failed at {time.strftime('%H:%M:%S')}: {exc.message}\n")
                sys.stderr.flush()
                time.sleep(interval_s)
                continue
            sys.stdout.write((json.dumps(as_dict(view)) if as_json else table(view)) + "\n")
            sys.stdout.flush()
            shown = True
            if once:
                return 0 if any(n.answered for n in view.nodes) else EXIT_NO_NODE
            time.sleep(interval_s)
    first = read()  # a source that cannot be read fails here, before the screen opens, as one line
    return screen(read, interval_s, first)
