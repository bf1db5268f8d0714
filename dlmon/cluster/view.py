"""The cluster as rows: one per node, its ranks under it, the cluster's straggler on top; pure
functions of the nodes' readings (no I/O), sorted worst first.

Every figure is what the node's own dlmon measured and exported; a figure a node does not export
(an older dlmon, no GPU, no cgroup limit) is None, shown as "n/a", never a guess."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from dlmon.analysis.detectors import straggler as local
from dlmon.analysis.detectors._base import duration
from dlmon.analysis.detectors.loader import LoaderNumbers
from dlmon.cluster.exposition import Series
from dlmon.cluster.readings import NodeReading
from dlmon.cluster.trend import Points, Slots, Trend
from dlmon.model.format import human_bytes

SEVERITY = {"critical": 3, "warning": 2, "info": 1}
CLOCK_TOLERANCE_S = 5.0  # beyond a few sample intervals: the node's clock is not this machine's
SWAP_BYTES = local.SWAP_BYTES
CPU_GAP_CORES = local.CPU_GAP_PERCENT / 100  # per worker, as the local detector compares them
BUSY_WORKER_CORES = LoaderNumbers().busy_cpu_percent / 100
IO_BUSY = 0.5  # a node's busiest disk (or io pressure) this far up ...
IO_GAP = 0.25  # ... and this much above every other node's


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: str
    severity: str  # info | warning | critical
    rank: int | None
    cause: str | None
    reason: str  # one line


@dataclass(frozen=True, slots=True)
class RankRow:
    rank: int
    local_rank: int | None
    node_rank: int | None
    site: str | None  # where its loader was built, file.py:LINE
    role: str | None
    batches_per_s: float | None
    data_wait: float | None  # share of wall time the rank waited for data
    loader_wait: float | None  # its loader's wait within its own iteration (what stragglers compare)
    workers: int | None
    worker_cpu: float | None  # cores its workers use
    worker_cpu_each: float | None  # cores each of its workers uses, on average
    swap_bytes: float | None
    verdict: Verdict | None


@dataclass(frozen=True, slots=True)
class NodeRow:
    address: str
    host: str
    answered: bool
    problem: str | None  # one line when the node's row cannot hold figures (no answer, not dlmon)
    notes: tuple[str, ...]  # what is n/a and why: an older dlmon, a clock that disagrees
    version: str | None
    training_up: bool | None
    batches_per_s: float | None
    data_wait: float | None
    headroom_bytes: float | None
    headroom_of: str | None  # "cgroup" | "machine"
    time_to_oom_s: float | None
    gpu_memory_used_bytes: float | None
    gpu_memory_total_bytes: float | None
    gpu_idle: float | None
    disk_busy: float | None
    clock_offset_s: float | None  # its snapshot time minus the reading time; None: n/a
    verdict: Verdict | None
    ranks: tuple[RankRow, ...]
    # the last --trend seconds in slots, oldest first (a slot with nothing measured: None);
    # None: no range data for this node ("n/a")
    batches_per_s_trend: Points | None = None
    data_wait_trend: Points | None = None

    @property
    def severity(self) -> int:
        if not self.answered or self.problem is not None:
            return SEVERITY["critical"]
        return SEVERITY.get(self.verdict.severity, 0) if self.verdict else 0


@dataclass(frozen=True, slots=True)
class Straggler:
    host: str
    address: str
    rank: int
    site: str | None
    data_wait: float  # its loader's wait within its own iteration
    others_max_wait: float
    batches_per_s: float | None
    cause: str  # fewer_workers | cpu | swap | io | a node verdict's cause | not_measured
    severity: str
    line: str  # "rank 3 on node-b sets the pace: ..., why: ..."
    # True: the cross-node rule named it; False: only dlmon on its node (its own straggler verdict),
    # which the rule does not hold at its lower thresholds (the node clears its own verdict)
    by_rule: bool = True


@dataclass(frozen=True, slots=True)
class ClusterView:
    time: float
    source: str
    nodes: tuple[NodeRow, ...]
    straggler: Straggler | None
    straggler_note: str  # the straggler's line, or why there is none
    trend_step_s: float | None = None  # each trend slot's length; None: no trends read
    trend_note: str | None = None  # why no node has a trend (the range queries failed)


# --- one node ------------------------------------------------------------------------------------


ByName = Mapping[str, list[Series]]


def _by_name(series: Iterable[Series]) -> ByName:
    """The series by name, each (name, labels) once: the first reading of a series read twice
    (two scrape jobs of one target merged by instance) so that no sum counts it twice."""
    out: dict[str, list[Series]] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for s in series:
        if (s.name, s.labels) not in seen:
            seen.add((s.name, s.labels))
            out.setdefault(s.name, []).append(s)
    return out


def _of(series: ByName, name: str) -> list[Series]:
    return series.get(name, [])


def _first(series: ByName, name: str) -> float | None:
    found = _of(series, name)
    return found[0].value if found else None


def _total(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) if values else None


def _int(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() else None  # "²".isdigit(), int("²") fails


_PHRASES = {
    "input_bound": "waits for its data",
    "straggler": "slower than the other ranks on its node",
    "memory_growth": "memory keeps growing",
    "stall": "no batch for a long time",
    "worker_died": "a DataLoader worker died",
    "trainer_died": "the training died",
    "shm_exhaustion": "/dev/shm nearly full",
    "vram_pressure": "GPU memory nearly full",
    "oversubscription": "more busy threads than cores",
    "io_saturation": "a disk is saturated",
    "swap_activity": "swapping",
}


def _reason(
    kind: str, rank: int | None, cause: str | None, rank_row: RankRow | None, eta: float | None
) -> str:
    where = f" on rank {rank}" if rank is not None else ""
    what = _PHRASES.get(kind, kind.replace("_", " "))
    if kind == "input_bound" and rank_row is not None and rank_row.data_wait is not None:
        what = f"waits for data {rank_row.data_wait:.0%} of the time"
    if kind == "memory_growth" and eta is not None:
        what += f", headroom gone in about {duration(eta)}"
    because = f" (cause: {cause.replace('_', ' ')})" if cause else ""
    return f"{kind}{where}: {what}{because}"


def _verdicts(series: ByName, ranks: dict[int, RankRow], eta: float | None) -> tuple[Verdict, ...]:
    out: list[Verdict] = []
    placed = _of(series, "dlmon_alert")
    for s in placed:
        if s.value != 1:
            continue
        rank = _int(s.label("rank"))
        cause = s.label("cause") or None
        out.append(
            Verdict(
                s.label("kind"),
                s.label("severity"),
                rank,
                cause,
                _reason(s.label("kind"), rank, cause, ranks.get(rank) if rank is not None else None, eta),
            )
        )
    if not placed:  # an older dlmon: its alerts by subject only
        for s in _of(series, "dlmon_alert_active"):
            if s.value == 1:
                kind = s.label("kind")
                out.append(Verdict(kind, s.label("severity"), None, None, f"{kind}: {s.label('subject')}"))
    return tuple(sorted(out, key=lambda v: (-SEVERITY.get(v.severity, 0), v.kind, v.rank or 0)))


def _sums_by_rank(found: Iterable[Series], role: str | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in found:
        labels = dict(s.labels)
        if role is None or labels.get("role") == role:
            rank = labels.get("rank", "")
            out[rank] = out.get(rank, 0.0) + s.value
    return out


def _rank_rows(series: ByName) -> dict[int, RankRow]:
    loaders: dict[int, list[Series]] = {}
    for s in _of(series, "dlmon_loader_batches_total"):
        rank = _int(s.label("rank"))
        if rank is not None:
            loaders.setdefault(rank, []).append(s)
    by_loader = {
        name: {s.label("loader"): s.value for s in _of(series, name)}
        for name in (
            "dlmon_loader_workers",
            "dlmon_loader_batches_per_second",
            "dlmon_loader_data_wait_wall_ratio",
            "dlmon_loader_data_wait_ratio",
        )
    }
    job_wait: dict[str, float] = {}
    for s in _of(series, "dlmon_job_data_wait_wall_ratio"):
        job_wait[s.label("rank")] = max(s.value, job_wait.get(s.label("rank"), 0.0))
    worker_cpu = _sums_by_rank(_of(series, "dlmon_process_cpu_ratio"), role="worker")
    worker_count = _sums_by_rank(
        (replace(s, value=1.0) for s in _of(series, "dlmon_process_cpu_ratio")), role="worker"
    )
    swap = _sums_by_rank(_of(series, "dlmon_process_swap_bytes"))
    rows: dict[int, RankRow] = {}
    for rank, found in loaders.items():
        # its training loader: the one the framework or the pattern named train, else the busiest
        chosen = max(found, key=lambda s: (s.label("role") == "train", s.value))
        loader = chosen.label("loader")
        workers = by_loader["dlmon_loader_workers"].get(loader)
        wall = job_wait.get(str(rank), by_loader["dlmon_loader_data_wait_wall_ratio"].get(loader))
        rows[rank] = RankRow(
            rank=rank,
            local_rank=_int(chosen.label("local_rank")),
            node_rank=_int(chosen.label("node_rank")),
            site=chosen.label("site") or None,
            role=chosen.label("role") or None,
            batches_per_s=by_loader["dlmon_loader_batches_per_second"].get(loader),
            data_wait=wall,
            loader_wait=by_loader["dlmon_loader_data_wait_ratio"].get(loader),
            workers=None if workers is None else int(workers),
            worker_cpu=worker_cpu.get(str(rank)),
            worker_cpu_each=(
                worker_cpu[str(rank)] / worker_count[str(rank)] if str(rank) in worker_cpu else None
            ),
            swap_bytes=swap.get(str(rank)),
            verdict=None,
        )
    return rows


def _host(reading: NodeReading) -> str:
    named = [s for s in reading.series if s.name == "dlmon_host_info"]
    if named and named[0].label("host"):
        return named[0].label("host")
    host, _, _ = reading.address.rpartition(":")
    return (host or reading.address).strip("[]")


def _unanswered(reading: NodeReading, problem: str) -> NodeRow:
    return NodeRow(
        reading.address, reading.address, False, problem, (), None, None, None, None, None, None, None, None,
        None, None, None, None, None, (),
    )  # fmt: skip


def node_row(reading: NodeReading) -> NodeRow:
    if reading.error is not None:
        return _unanswered(reading, reading.error)
    if not any(s.name.startswith("dlmon_") for s in reading.series):
        return _unanswered(reading, "answered, but with no dlmon series (not a dlmon exporter?)")
    series = _by_name(reading.series)
    notes: list[str] = []
    build = _of(series, "dlmon_build_info")
    version = build[0].label("version") or None if build else None
    if not _of(series, "dlmon_host_info"):
        notes.append("older dlmon: no host name, no verdicts by rank (host from its address)")
    interval = _first(series, "dlmon_sample_interval_seconds") or 1.0
    stamp = _first(series, "dlmon_snapshot_timestamp_seconds")
    offset = None if stamp is None or reading.read_at <= 0 else stamp - reading.read_at
    if offset is not None and abs(offset) > max(CLOCK_TOLERANCE_S, 3 * interval):
        side = "ahead of" if offset > 0 else "behind"
        notes.append(
            f"its clock is {abs(offset):.0f} s {side} this one's (or its sampling stopped): ages n/a"
        )
        offset = None
    rows = _rank_rows(series)
    eta = _first(series, "dlmon_memory_growth_eta_seconds")
    verdicts = _verdicts(series, rows, eta)
    ranks = tuple(
        _with_verdict(row, next((v for v in verdicts if v.rank == rank), None))
        for rank, row in sorted(rows.items())
    )
    limit = _first(series, "dlmon_cgroup_memory_limit_bytes")
    used = _first(series, "dlmon_cgroup_memory_working_set_bytes") or _first(
        series, "dlmon_cgroup_memory_usage_bytes"
    )
    available = _first(series, "dlmon_memory_available_bytes")
    headroom, headroom_of = (
        (limit - used, "cgroup")
        if limit is not None and used is not None
        else (available, "machine" if available is not None else None)
    )
    if limit is not None and used is not None and available is not None and available < limit - used:
        headroom, headroom_of = available, "machine"
    gpu_used = _total(s.value for s in _of(series, "dlmon_gpu_memory_used_bytes"))
    gpu_total = _total(s.value for s in _of(series, "dlmon_gpu_memory_total_bytes"))
    utils = [s.value for s in _of(series, "dlmon_gpu_utilization_ratio")]
    disks = [s.value for s in _of(series, "dlmon_disk_utilization_ratio")]
    io = _first(series, "dlmon_pressure_io_some_ratio")
    busy = max([*disks, *([io] if io is not None else [])], default=None)
    waits = [s.value for s in _of(series, "dlmon_job_data_wait_wall_ratio")]
    if ranks:
        rates = [r.batches_per_s for r in ranks if r.batches_per_s is not None]
    else:
        rates = [
            s.value
            for s in _of(series, "dlmon_loader_batches_per_second")
            if s.label("role") in ("train", "")
        ]
    up = _first(series, "dlmon_target_up")
    if up == 0:
        notes.append("its training is not running (dlmon_target_up 0)")
    return NodeRow(
        address=reading.address,
        host=_host(reading),
        answered=True,
        problem=None,
        notes=tuple(notes),
        version=version,
        training_up=None if up is None else up == 1,
        batches_per_s=sum(rates) if rates else None,
        data_wait=max(waits) if waits else None,
        headroom_bytes=headroom,
        headroom_of=headroom_of,
        time_to_oom_s=eta,
        gpu_memory_used_bytes=gpu_used,
        gpu_memory_total_bytes=gpu_total,
        gpu_idle=1 - sum(utils) / len(utils) if utils else None,
        disk_busy=busy,
        clock_offset_s=offset,
        verdict=verdicts[0] if verdicts else None,
        ranks=ranks,
    )


def _with_verdict(row: RankRow, verdict: Verdict | None) -> RankRow:
    return replace(row, verdict=verdict)


# --- the cluster ---------------------------------------------------------------------------------


def _measured_cause(
    slow: RankRow, node: NodeRow, others: Sequence[tuple[RankRow, NodeRow]]
) -> tuple[str, str] | None:
    """(cause, why) from a figure in which the slow rank differs from every other, else None."""
    other_workers = [r.workers for r, _ in others if r.workers is not None]
    if slow.workers is not None and other_workers and slow.workers < min(other_workers):
        return (
            local.FEWER_WORKERS,
            f"it has {slow.workers} DataLoader workers, the other ranks {min(other_workers)} or more",
        )
    # each worker's CPU, as the local detector: a rank with more workers uses more cores in all
    # without any of them being busier
    each = slow.worker_cpu_each
    other_cpu = [r.worker_cpu_each for r, _ in others if r.worker_cpu_each is not None]
    busy = each is not None and each >= BUSY_WORKER_CORES
    if each is not None and busy and other_cpu and each >= max(other_cpu) + CPU_GAP_CORES:
        return (
            local.CPU,
            f"its workers are CPU-bound at {each:.0%} of a core each, the other ranks' at most "
            f"{max(other_cpu):.0%}",
        )
    other_swap = [r.swap_bytes for r, _ in others if r.swap_bytes is not None]
    if (
        slow.swap_bytes is not None
        and slow.swap_bytes >= SWAP_BYTES
        and (not other_swap or max(other_swap) < SWAP_BYTES)
    ):
        return (
            local.SWAP,
            f"its processes have {human_bytes(slow.swap_bytes)} swapped out, the other ranks' little",
        )
    # one disk serves every rank of its node: it tells the slow rank apart only when no rank it is
    # compared with shares that node, and the other nodes' disks are measured and less busy
    shares_node = any(n is node for _, n in others)
    other_nodes = [n.disk_busy for _, n in others if n is not node and n.disk_busy is not None]
    if (
        not shares_node
        and other_nodes
        and node.disk_busy is not None
        and node.disk_busy >= IO_BUSY
        and node.disk_busy >= max(other_nodes) + IO_GAP
    ):
        return (
            local.IO,
            f"its node's disk is busy {node.disk_busy:.0%} of the time, the other nodes' at most "
            f"{max(other_nodes):.0%}",
        )
    return None


def _node_says(slow: RankRow) -> tuple[str, str] | None:
    v = slow.verdict
    if v is None or v.cause is None:
        return None
    return v.cause, f"dlmon on its node finds {v.kind.replace('_', ' ')}, cause {v.cause.replace('_', ' ')}"


def _held(held: Straggler | None, node: NodeRow, slow: RankRow) -> bool:
    return (
        held is not None
        and held.by_rule
        and (held.address, held.rank, held.site) == (node.address, slow.rank, slow.site)
    )


def find_straggler(nodes: Sequence[NodeRow], held: Straggler | None = None) -> tuple[Straggler | None, str]:
    """The rank whose loader wait sets everyone's pace, across nodes: the local detector's rule
    (dlmon.analysis.detectors.straggler) over every node's ranks at the same loader site; ``held``,
    the straggler the rule named at the last refresh, is kept at the rule's hold thresholds while
    it stays the slowest rank of its site."""
    everyone = [
        (r, n) for n in nodes if n.answered for r in n.ranks if r.loader_wait is not None and r.batches_per_s
    ]
    sites: dict[str | None, list[tuple[RankRow, NodeRow]]] = {}
    for pair in everyone:
        sites.setdefault(pair[0].site, []).append(pair)
    best: Straggler | None = None
    mixed: list[str] = []  # sites whose ranks belong to more than one job
    for site, pairs in sites.items():
        if len(pairs) < 2:
            continue
        ranks = [p[0].rank for p in pairs]
        if len(set(ranks)) < len(ranks):
            # a rank twice: two jobs of one script (a sweep, a fleet in one scrape job), which do
            # not wait on each other; comparing them would name a straggler that is none
            mixed.append(f"{site or '?'} (rank {next(r for r in ranks if ranks.count(r) > 1)} twice)")
            continue
        slow, node = max(pairs, key=lambda p: p[0].loader_wait or 0.0)
        others = [p for p in pairs if p[0] is not slow]
        wait = slow.loader_wait or 0.0
        most = max(p[0].loader_wait or 0.0 for p in others)
        rates = [p[0].batches_per_s or 0.0 for p in pairs]
        if not local.paces_the_job(wait, most, rates, _held(held, node, slow)):
            continue
        measured = _measured_cause(slow, node, others)
        said = _node_says(slow)
        cause, why = (
            measured or said or (local.NOT_MEASURED, "nothing dlmon exports differs from the other ranks")
        )
        # as the local detector: without a measured difference from the other ranks, a possibility
        # (every rank's loader may be as slow, the slowest by a hair pacing the job), info
        severity = local.severity_of(wait, measured=measured is not None)
        named = sorted(p[0].rank for p in others)
        who = (
            f"rank{'s' if len(named) > 1 else ''} {', '.join(map(str, named))}"
            if len(named) <= 4
            else (f"the other {len(named)} ranks")
        )
        line = (
            f"rank {slow.rank} on {node.host} sets the pace: its loader {site or '?'} waits for data "
            f"{wait:.0%} of the time, {who} at most {most:.0%}, all at {slow.batches_per_s:.1f} batches/s; "
            f"why: {why}"
        )
        found = Straggler(
            node.host, node.address, slow.rank, site, wait, most, slow.batches_per_s, cause, severity, line
        )
        if best is None or found.data_wait > best.data_wait:
            best = found
    if best is not None:
        return best, best.line
    local_ones = [
        (n, r) for n in nodes for r in n.ranks if r.verdict is not None and r.verdict.kind == "straggler"
    ]
    if local_ones:
        node, rank = max(
            local_ones, key=lambda p: SEVERITY.get(p[1].verdict.severity, 0) if p[1].verdict else 0
        )
        verdict = rank.verdict
        assert verdict is not None
        cause = verdict.cause or local.NOT_MEASURED
        line = (
            f"rank {rank.rank} on {node.host} sets its node's pace "
            f"(dlmon there: straggler, cause {cause.replace('_', ' ')})"
        )
        return Straggler(
            node.host,
            node.address,
            rank.rank,
            rank.site,
            rank.loader_wait or 0.0,
            0.0,
            rank.batches_per_s,
            cause,
            verdict.severity,
            line,
            by_rule=False,
        ), line
    if len(everyone) < 2:
        return None, "no straggler: fewer than two ranks report their loaders"
    if mixed:
        return None, (
            f"no straggler: the ranks at {', '.join(mixed)} belong to more than one job; "
            "read one job's nodes (--job, --match, or its hosts)"
        )
    return None, "no straggler: no rank waits for its data far longer than the others"


def with_trends(
    view: ClusterView, where: Slots | None, trends: Mapping[str, Trend], note: str | None = None
) -> ClusterView:
    """The view with each node's trend (a node ``trends`` lacks: n/a)."""
    nodes = tuple(
        replace(n, batches_per_s_trend=t.batches_per_s, data_wait_trend=t.data_wait)
        if (t := trends.get(n.address)) is not None
        else n
        for n in view.nodes
    )
    return replace(view, nodes=nodes, trend_step_s=None if where is None else where.step_s, trend_note=note)


def cluster_view(
    readings: Sequence[NodeReading], source: str, now: float, held: Straggler | None = None
) -> ClusterView:
    """``held``: the straggler of the last refresh (see find_straggler)."""
    rows = [node_row(r) for r in readings]
    straggler, note = find_straggler(rows, held)

    def badness(node: NodeRow) -> tuple[int, int, float, str]:
        severity = node.severity
        if straggler is not None and node.address == straggler.address:
            # at its own severity: an unproven straggler is info, not above a node's warning
            severity = max(severity, SEVERITY.get(straggler.severity, 0))
        return (
            -severity,
            -int(straggler is not None and node.address == straggler.address),
            -(node.data_wait or 0.0),
            node.host,
        )

    return ClusterView(now, source, tuple(sorted(rows, key=badness)), straggler, note)
