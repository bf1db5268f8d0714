"""The recent window's incremental index (dlmon/analysis/recent.py) against the scans it replaces.

The detectors read the fd trend, the loaders' pace and the newest stacks from the Analyzer's
``RecentIndex`` instead of rescanning the whole window every tick (issue 22). Without an index
(``Analyzer(incremental=False)``, or a context built from a list) they scan as before: that path
is the reference, and the two must give the same alerts tick by tick, and the same figures.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from dlmon.analysis import Analyzer
from dlmon.analysis.detectors import Context
from dlmon.analysis.detectors.fds import _trend
from dlmon.analysis.detectors.processes import latest_stack
from dlmon.analysis.detectors.stall import StallState, pace
from dlmon.analysis.digest import Digest
from dlmon.analysis.recent import RecentIndex
from dlmon.model import Snapshot
from dlmon.model.snapshot import ProcessStack, StackFrame
from support.snapshots import (
    MAIN_PID,
    MIB,
    copy_on_read_history,
    disk,
    loader,
    memory_history,
    proc,
    respawning_history,
    snap,
)

_STUCK = (
    StackFrame("/usr/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py", 300, "_worker_loop"),
    StackFrame("/home/u/train.py", 88, "__getitem__"),
)
_IDLE = (
    StackFrame("/usr/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py", 300, "_worker_loop"),
    StackFrame("/usr/lib/python3.11/multiprocessing/queues.py", 100, "get"),
)


def _walk(rng: random.Random, ticks: int) -> list[Snapshot]:
    """A job whose loader delivers, stalls and resumes (one worker now and then stuck alone),
    whose processes' fds rise, fall and leak towards their limit, with stacks taken now and then,
    workers replaced, a second loader coming and going, and a clock that jitters, repeats a time
    and steps back less than the Analyzer's restart threshold."""
    t = 0.0
    batches = 0
    per_worker = [0, 0, 0]
    pids = [1001, 1002, 1003]
    fds = {pid: rng.randint(8, 40) for pid in (MAIN_PID, *range(1001, 1010))}
    leak = {pid: rng.choice([0, 0, 0, 1, 3, 20]) for pid in fds}
    stalled_for = 0.0
    lone = -1
    wait: float | None = 0.01
    out: list[Snapshot] = []
    for _ in range(ticks):
        step = rng.choice([0.1, 0.1, 0.1, 0.25, 1.0, 1.0, 0.0, 5.0, -0.4])
        t = max(0.0, t + step)
        if rng.random() < 0.01:
            pids[rng.randrange(3)] = rng.randint(1004, 1009)  # a worker replaced
        if stalled_for > 0.0:
            stalled_for += max(0.0, step)
            if rng.random() < 0.02:
                stalled_for = 0.0
        elif rng.random() < 0.01:
            stalled_for = 0.01
        if rng.random() < 0.01:
            lone = rng.choice([-1, 0, 1, 2])
        if rng.random() < 0.01:
            wait = rng.choice([0.01, 0.25, 0.6, None])  # input-bound for a while, or not
        moving = stalled_for == 0.0 and rng.random() < 0.8
        if moving:
            batches += 1
            for w in range(3):
                if w != lone:
                    per_worker[w] += 1
        procs = []
        for pid in (MAIN_PID, *pids):
            fds[pid] = max(3, fds[pid] + leak[pid] * (rng.random() < 0.7) + rng.choice([0, 0, 1, -1, -5]))
            if rng.random() < 0.004:
                fds[pid] = 10  # it closed them
            p = proc(
                pid,
                "main" if pid == MAIN_PID else "worker",
                uss=200 * MIB,
                pss=210 * MIB,
                cpu=rng.choice([0.5, 2.0, 60.0]),
                state=rng.choice("SSSSDR"),
                worker_id=None if pid == MAIN_PID else pids.index(pid),
            )
            limit = rng.choice([256, 256, 1024, None]) if rng.random() < 0.05 else 256
            known = rng.random() > 0.03
            procs.append(dataclasses.replace(p, num_fds=fds[pid] if known else None, fd_limit=limit))
        stacks = []
        if rng.random() < 0.1:
            for pid in rng.sample([MAIN_PID, *pids], rng.randint(1, 3)):
                frames = rng.choice([_STUCK, _IDLE, ()])
                stacks.append(
                    ProcessStack(pid, "worker", None, t, None, frames, state=rng.choice(["S", "D"]))
                )
        rate = rng.choice([None, 0.0, float("nan"), 2.0, 5.0, 5.0, 10.0, float("inf")]) if moving else 0.0
        main = dataclasses.replace(
            loader(id="L1", num_workers=3, worker_pids=pids),
            batches_total=None if rng.random() < 0.05 else batches,
            batches_per_s=rate,
            batches_per_worker=tuple(per_worker),
            in_call_s=stalled_for if stalled_for else rng.choice([0.0, 0.0, 0.01, 1.5]),
            in_startup=rng.random() < 0.02,
            data_wait_fraction=None if wait is None else min(1.0, wait * rng.uniform(0.7, 1.3)),
            wall_wait_fraction=None if wait is None or rng.random() < 0.1 else wait * 0.9,
            alive=rng.random() > 0.01,
        )
        loaders = [main]
        if rng.random() < 0.3:
            loaders.append(
                dataclasses.replace(
                    loader(id=f"V{int(t) // 20}", name="val.py:9", num_workers=0),
                    batches_total=rng.choice([None, int(t)]),
                    batches_per_s=rng.choice([None, 1.0]),
                )
            )
        out.append(
            dataclasses.replace(
                snap(t, procs, disks=[disk(util=rng.uniform(0, 100))], loaders=loaders),
                stacks=tuple(stacks),
            )
        )
    return out


def _same_alerts(history: list[Snapshot], **kwargs: object) -> int:
    """Feed ``history`` to an Analyzer with the index and one without; return the alerts seen."""
    fast = Analyzer(cores=2, strict=True, **kwargs)  # type: ignore[arg-type]
    slow = Analyzer(cores=2, strict=True, incremental=False, **kwargs)  # type: ignore[arg-type]
    seen = 0
    for i, s in enumerate(history):
        a, b = fast(s), slow(s)
        assert a.alerts == b.alerts, f"tick {i} at {s.time}"
        seen += len(a.alerts)
    assert fast.states.of(StallState).loaders == slow.states.of(StallState).loaders
    return seen


@pytest.mark.parametrize("seed", range(8))
def test_the_index_gives_the_alerts_of_the_scans_on_random_walks(seed: int) -> None:
    rng = random.Random(seed)
    history = _walk(rng, 1500)
    kinds = {"recent_s": rng.choice([120.0, 20.0, 5.0]), "max_recent": rng.choice([1200, 150, 7])}
    _same_alerts(history, **kinds)


def test_the_walks_raise_what_the_index_serves() -> None:
    """The comparison above means something: the walks raise fd and stall alerts."""
    wanted = {"fd_exhaustion", "stall", "input_bound"}
    kinds: set[str] = set()
    for seed in range(8):
        a = Analyzer(cores=2, strict=True)
        for s in _walk(random.Random(seed), 1500):
            kinds.update(x.kind for x in a(s).alerts)
        if wanted <= kinds:
            break
    assert wanted <= kinds


@pytest.mark.parametrize("seed", range(4))
def test_the_index_gives_the_figures_of_the_scans_tick_by_tick(seed: int) -> None:
    rng = random.Random(100 + seed)
    index = RecentIndex(rng.choice([120.0, 30.0]), rng.choice([1200, 64]))
    for s in _walk(rng, 800):
        index.add(s)
        recent = index.snapshots()
        fast = Context(recent, Digest(), 2, index=index)
        slow = Context(recent, Digest(), 2)
        for seconds in (0.0, 3.0, 10.0, 60.0, 1e9):
            assert fast.window(seconds) == slow.window(seconds)
        for p in s.processes:
            assert _trend(fast, p.pid, p.start_time) == _trend(slow, p.pid, p.start_time)
        for pid in (MAIN_PID, *range(1001, 1010)):
            assert latest_stack(fast, pid) == latest_stack(slow, pid)
        for ls in s.loaders:
            assert pace(fast, ls.id) == pace(slow, ls.id)
        assert len(index.fds) == len(
            {(p.pid, p.start_time) for x in recent for p in x.processes if p.num_fds is not None}
        )


def test_the_index_gives_the_alerts_of_the_scans_on_the_scenario_histories() -> None:
    def growth(i: int, t: float) -> float:
        return 100 * MIB + t * 0.05 * MIB

    _same_alerts(memory_history(900, growth, workers=4))
    _same_alerts(memory_history(300, growth, workers=8, interval=0.1))
    _same_alerts(copy_on_read_history(400, workers=4, cgroup_room=3e9))
    _same_alerts(copy_on_read_history(300, workers=2, generations_s=30.0))
    _same_alerts(respawning_history(300, epoch_s=4.0, workers=2))
