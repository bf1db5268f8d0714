"""Data wait on wall time: what each loader, and all of a process's loaders, cost the job.

A loader's ``data_wait_fraction`` is its share within its own iteration (wait / (wait + compute)
while it is iterated); ``wall_wait_fraction`` is its share of the whole interval. A validation
loader that runs 5 batches every 100 training batches can wait 65% of its own time and cost the
job 3%: the job is judged on the second, summed over its loaders.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dlmon.model import LoaderSample, Snapshot


def wall_wait(loader: LoaderSample) -> float | None:
    """The loader's share of wall time; a record made before the field: its own share stands in
    (for the bare one-loader loop of those records the two are the same)."""
    if loader.wall_wait_fraction is not None:
        return loader.wall_wait_fraction
    return loader.data_wait_fraction


def job_wall_wait(loaders: Iterable[LoaderSample]) -> float | None:
    """The share of wall time the trainer waited on any of these loaders (one process's): the
    sum, since one thread waits on one loader at a time. None when no loader has a figure."""
    live = [x for x in loaders if x.alive]
    if any(x.wall_wait_fraction is None and x.data_wait_fraction is not None for x in live):
        # a record from before wall_wait_fraction: judged as then, on the worst loader's own share
        own = [x.data_wait_fraction for x in live if x.data_wait_fraction is not None]
        return max(own) if own else None
    values = [x.wall_wait_fraction for x in live if x.wall_wait_fraction is not None]
    return min(1.0, sum(values)) if values else None


def by_process(loaders: Iterable[LoaderSample]) -> dict[int, list[LoaderSample]]:
    out: dict[int, list[LoaderSample]] = {}
    for x in loaders:
        out.setdefault(x.pid, []).append(x)
    return out


Shares = tuple[float | None, tuple[tuple[str, float], ...]]


def snapshot_shares(snap: Snapshot, pid: int) -> Shares:
    """(the job's share of wall time waiting in this snapshot, (loader id, its share) of each of
    its loaders with a figure) for process ``pid``; (None, ()) when the snapshot has no figure."""
    mine = [x for x in snap.loaders if x.pid == pid and x.alive]
    job = job_wall_wait(mine)
    if job is None:
        return None, ()
    return job, tuple((x.id, w) for x in mine if (w := wall_wait(x)) is not None)


def window_shares(window: Sequence[Snapshot], pid: int) -> tuple[float | None, dict[str, float], int]:
    """(the job's mean share of wall time over the window, each loader's mean share, ticks with a
    figure) for process ``pid``. A loader absent or idle in a tick counts 0 for that tick."""
    return combine_shares([snapshot_shares(snap, pid) for snap in window])


def combine_shares(ticks: Iterable[Shares]) -> tuple[float | None, dict[str, float], int]:
    """``window_shares`` from each tick's :func:`snapshot_shares`, oldest first."""
    totals: list[float] = []
    per: dict[str, float] = {}
    for job, loaders in ticks:
        if job is None:
            continue
        totals.append(job)
        for loader_id, w in loaders:
            per[loader_id] = per.get(loader_id, 0.0) + w
    if not totals:
        return None, {}, 0
    n = len(totals)
    return sum(totals) / n, {k: v / n for k, v in per.items()}, n


def own_share(window: Sequence[Snapshot], loader_id: str) -> float | None:
    """The loader's mean share within its own iteration over the window (ticks it was iterated)."""
    values = [
        x.data_wait_fraction
        for snap in window
        for x in snap.loaders
        if x.id == loader_id and x.data_wait_fraction is not None
    ]
    return sum(values) / len(values) if values else None


def loader_title(loader: LoaderSample) -> str:
    """E.g. "validation loader · Lightning · train.py:72"; just the site when nothing more is known."""
    parts = []
    if loader.role is not None:
        parts.append(f"{loader.role} loader")
    if loader.framework is not None:
        parts.append(loader.framework)
    parts.append(loader.name)
    return " · ".join(parts)
