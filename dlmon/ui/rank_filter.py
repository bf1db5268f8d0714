"""``--rank N``: the dashboard of one rank of a distributed job (pure; no UI imports).

The snapshot keeps what belongs to rank N and what belongs to no rank (the launcher, the machine):
the other ranks' trainers, workers and loaders go, and so do the alerts that name another rank.
"""

from __future__ import annotations

import re
from dataclasses import replace

from dlmon.model import Alert, Snapshot

_RANK_IN_SUBJECT = re.compile(r"\brank (\d+)\b")


def only_rank(s: Snapshot, rank: int) -> Snapshot:
    other_pids = {p.pid for p in s.processes if p.rank is not None and p.rank != rank}
    other_pids |= {lo.pid for lo in s.loaders if lo.rank is not None and lo.rank != rank}
    other_loaders = {lo.id for lo in s.loaders if lo.rank is not None and lo.rank != rank}
    for lo in s.loaders:
        if lo.id in other_loaders:
            other_pids.update(lo.worker_pids)
    processes = tuple(
        p for p in s.processes if p.pid not in other_pids and (p.ppid not in other_pids or p.role != "worker")
    )
    loaders = tuple(lo for lo in s.loaders if lo.id not in other_loaders)
    alerts = tuple(a for a in s.alerts if not _names_another(a, rank, other_pids, other_loaders))
    return replace(s, processes=processes, loaders=loaders, alerts=alerts)


def _names_another(a: Alert, rank: int, pids: set[int], loader_ids: set[str]) -> bool:
    named = a.evidence.get("rank")
    if isinstance(named, int) and not isinstance(named, bool):
        return named != rank
    found = _RANK_IN_SUBJECT.search(a.subject)
    if found is not None:
        return int(found.group(1)) != rank
    for key in ("pid", "trainer_pid"):
        value = a.evidence.get(key)
        if isinstance(value, int) and value in pids:
            return True
    return a.evidence.get("loader_id") in loader_ids
