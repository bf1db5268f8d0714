"""stall: a job that stopped moving, and where it is stuck.

- A loader that stopped delivering: the trainer has been inside ``__next__`` for much longer than
  the loader's usual batch interval (``LoaderSample.in_call_s``). The stuck worker is the one
  whose stack is not idle in its index queue (when dlmon took stacks), else the one that has
  delivered the fewest batches (with in-order delivery the trainer waits for the laggard).
- A trainer stuck outside the loader (a collective that never returns, a lock): no batch for
  long, the trainer not inside ``__next__`` and sleeping (no CPU).

A hang is not "too few workers": :func:`quiet_input_bound` tells the analyzer which loaders'
input_bound candidates to drop while a call lasts far beyond the usual interval.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dlmon.analysis.detectors._base import Candidate, Context, Evidence, States, duration
from dlmon.analysis.detectors.processes import describe_frames, format_stack, latest_stack
from dlmon.analysis.severity import CRITICAL, WARNING
from dlmon.analysis.stats import median
from dlmon.model import LoaderSample, ProcessSample
from dlmon.model.format import DEAD_STATES, STACK_TAKEN
from dlmon.model.snapshot import ProcessStack
from dlmon.model.stall_rule import STALL_RULE, StallRule, pace_reading

STALL = "stall"


@dataclass(frozen=True, slots=True)
class StallNumbers:
    """stall's numbers. The rule is shared with the stack probe (dlmon.collect.stacks), which must
    get the same."""

    stall_rule: StallRule = STALL_RULE
    stall_outside_min_s: float = 60.0  # the trainer outside the loader: no batch for this long, and asleep
    # a call this long and 5 intervals: no input_bound verdict (a hang, or one)
    stall_suspect_min_s: float = 2.0
    stall_suspect_intervals: float = 5.0
    stall_critical_s: float = 300.0
    stall_sleeping_cpu_percent: float = 5.0


MAX_LOADERS = 256  # loaders whose progress is kept (the agent reports <= 256)


@dataclass(slots=True)
class LoaderProgress:
    """What the stall detector must remember of a loader through a stall of any length: what a
    stall forgets cannot be computed again from the stalled ticks."""

    batches: int  # its batch count as last seen
    moved_at: float  # when the count last moved (or when the loader was first seen)
    usual_interval_s: float | None = None  # median seconds per batch while it delivered
    # (worker id, pid) -> (the worker's batch count, when that last moved)
    workers: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)


@dataclass(slots=True)
class StallState:
    """stall's memory past the recent window: each loader's progress (``KindSpec(state=)``)."""

    loaders: dict[str, LoaderProgress] = field(default_factory=dict)

    def note(self, loader_id: str, progress: LoaderProgress, current: Callable[[], set[str]]) -> None:
        """Keep ``progress`` for ``loader_id``. When full, the loaders that ``current()`` (the ids
        in the recent snapshots) no longer lists are forgotten first: a job that builds a new
        DataLoader every epoch must not make a long stall of another loader start over."""
        if loader_id not in self.loaders and len(self.loaders) >= MAX_LOADERS:
            keep = current()
            self.loaders = {k: v for k, v in self.loaders.items() if k in keep}
            if len(self.loaders) >= MAX_LOADERS:
                self.loaders.clear()
        self.loaders[loader_id] = progress


@dataclass(frozen=True, slots=True)
class LoaderPace:
    usual_interval_s: float | None  # median seconds per batch while it delivered (remembered)
    last_progress: float | None  # when its batch count last moved (remembered past the recent window)


def pace(ctx: Context, loader_id: str) -> LoaderPace:
    """The loader's usual pace from the recent snapshots; remembered in ``StallState`` across a long stall."""
    usual: float | None
    last_total: int | None = None
    last_progress: float | None = None
    trail = ctx.index.loaders.get(loader_id) if ctx.index is not None else None
    if trail is not None:  # kept up to date as the window moves: the same figures without a scan
        usual = trail.median_rate()
        last_total, last_progress = trail.progress()
    elif ctx.index is not None:
        usual = None  # not in the window
    else:
        rates: list[float] = []
        for snap in ctx.recent:
            for ls in snap.loaders:
                if ls.id != loader_id:
                    continue
                rate = pace_reading(ls)
                if rate is not None:
                    rates.append(rate)
                if ls.batches_total is not None and ls.batches_total != last_total:
                    last_total = ls.batches_total
                    last_progress = snap.time
        usual = median(rates) if rates else None
    # The recent window forgets a batch older than itself: a loader quiet for longer would seem
    # quiet only since the window's start ("about 2 min" forever, never critical), and its usual
    # pace with it. The state keeps when each loader's count last moved, and its pace.
    state = ctx.state(StallState)
    memory = state.loaders.get(loader_id)
    if last_total is not None and last_progress is not None:
        if memory is None:
            memory = LoaderProgress(last_total, last_progress)
            state.note(loader_id, memory, lambda: _loader_ids(ctx))
        elif memory.batches == last_total:
            last_progress = min(last_progress, memory.moved_at)
        else:
            memory.batches, memory.moved_at = last_total, last_progress
    interval = 1.0 / usual if usual is not None else None
    if memory is not None:
        if interval is not None:
            memory.usual_interval_s = interval
        else:
            interval = memory.usual_interval_s
    return LoaderPace(interval, last_progress)


def stall_resumed(states: States, evidence: Evidence, absent_since: float) -> bool:
    """Whether the stalled loader (or, for one stuck worker, that worker) has delivered a batch
    since the stall was last seen at ``absent_since``."""
    memory = states.of(StallState).loaders.get(str(evidence.get("loader_id")))
    if memory is None:
        return False
    if evidence.get("where") == "worker":
        wid, pid = evidence.get("worker_id"), evidence.get("pid")
        seen = memory.workers.get((wid, pid)) if isinstance(wid, int) and isinstance(pid, int) else None
        return seen is not None and seen[1] >= absent_since
    return memory.moved_at >= absent_since


def _loader_ids(ctx: Context) -> set[str]:
    return {ls.id for snap in ctx.recent for ls in snap.loaders}


def quiet_input_bound(ctx: Context) -> frozenset[str]:
    """input_bound keys (``loader:ID``) to drop: the loader's current call is far beyond its pace."""
    return ctx.cached("stall_quiet", lambda: _quiet(ctx))


def _quiet(ctx: Context) -> frozenset[str]:
    cfg = ctx.numbers(StallNumbers)
    out: set[str] = set()
    for ls in ctx.latest.loaders:
        call = ls.in_call_s or 0.0
        if call < cfg.stall_suspect_min_s:
            continue
        interval = pace(ctx, ls.id).usual_interval_s
        if interval is None or call >= cfg.stall_suspect_intervals * interval:
            out.add(f"loader:{ls.id}")
    return frozenset(out)


def _is_idle(stack: ProcessStack) -> bool:
    """A worker waiting for work: the call right under ``_worker_loop`` is its index queue's ``get``."""
    frames = stack.frames
    loops = [i for i, f in enumerate(frames) if f.function == "_worker_loop"]
    if not loops or loops[-1] + 1 >= len(frames):
        return False
    below = frames[loops[-1] + 1]
    return below.function == "get" and below.file.endswith("queues.py")


def _stuck_worker(
    ctx: Context, ls: LoaderSample, by_pid: dict[int, ProcessSample]
) -> tuple[int | None, int | None, ProcessStack | None]:
    """(worker id, pid, its stack) of the worker the trainer waits for; Nones when unknown."""
    alive = [(wid, pid) for wid, pid in enumerate(ls.worker_pids) if pid in by_pid]
    stacks = {pid: latest_stack(ctx, pid) for _, pid in alive}
    # a stack without frames ("none": no way to read it) tells nothing
    read = {pid: st for pid, st in stacks.items() if st is not None and st.frames}
    busy = [(wid, pid) for wid, pid in alive if pid in read and not _is_idle(read[pid])]
    if busy:
        wid, pid = busy[0]
        return wid, pid, stacks[pid]
    counts = ls.batches_per_worker
    if alive and len(counts) >= len(ls.worker_pids):
        wid, pid = min(alive, key=lambda x: counts[x[0]])
        return wid, pid, stacks.get(pid)
    return None, None, None


def _where(stack: ProcessStack | None, proc: ProcessSample | None) -> tuple[str, dict[str, str | None]]:
    parts: list[str] = []
    ev: dict[str, str | None] = {}
    if stack is not None and stack.frames:
        parts.append(f"in {describe_frames(stack.frames)}")
        ev["stack"] = format_stack(stack.frames)
        ev["stuck_in"] = describe_frames(stack.frames)
    taken = STACK_TAKEN.get(stack.source) if stack is not None else None
    if taken:
        ev["stack_taken"] = taken
    state = stack.state if stack is not None and stack.state else (proc.state if proc is not None else None)
    extra = []
    if state:
        extra.append(f"state {state}")
    if stack is not None and stack.wchan:
        extra.append(f"wchan {stack.wchan}")
    if stack is not None and stack.reading:
        extra.append(f"file {stack.reading}")
    if extra:
        parts.append("(" + ", ".join(extra) + ")")
    if taken:
        parts.append(f"[{taken}]")
    ev.update(
        state=state,
        wchan=stack.wchan if stack is not None else None,
        reading=stack.reading if stack is not None else None,
    )
    return " ".join(parts), ev


def detect_stall(ctx: Context) -> list[Candidate]:
    s = ctx.latest
    if not s.loaders or not s.target.alive:
        return []
    cfg = ctx.numbers(StallNumbers)
    by_pid = {p.pid: p for p in s.processes if p.state not in DEAD_STATES}
    out: list[Candidate] = []
    paces = {ls.id: pace(ctx, ls.id) for ls in s.loaders if ls.alive}
    # a trainer inside, or lately fed by, any of its loaders is not stuck outside them (a
    # validation DataLoader kept alive through a training epoch delivers nothing for minutes)
    in_a_loader = {ls.pid for ls in s.loaders if ls.alive and (ls.in_call_s or 0.0) > 0.0}
    fed: dict[int, float] = {}
    for ls in s.loaders:
        last = paces[ls.id].last_progress if ls.id in paces else None
        if last is not None:
            fed[ls.pid] = max(fed.get(ls.pid, last), last)
    for ls in s.loaders:
        if not ls.alive:
            continue
        p = paces[ls.id]
        limit = cfg.stall_rule.threshold_s(None if ls.in_startup else p.usual_interval_s)  # start-up: 60 s
        call = ls.in_call_s or 0.0
        usual = (
            f"usually one every {duration(p.usual_interval_s)}"
            if p.usual_interval_s
            else "none delivered yet"
        )
        trainer = by_pid.get(ls.pid)
        main_stack = latest_stack(ctx, ls.pid)
        if call >= limit:
            out.append(_loader_stall(ctx, ls, call, usual, by_pid, main_stack))
            continue
        out.extend(_lone_workers(ctx, ls, p, by_pid))
        quiet_for = s.time - fed[ls.pid] if p.last_progress is not None else None
        if (
            call == 0.0
            and ls.pid not in in_a_loader
            and quiet_for is not None
            and p.usual_interval_s is not None
            and quiet_for >= max(cfg.stall_outside_min_s, limit)
            and trainer is not None
            and trainer.cpu_percent is not None
            and trainer.cpu_percent < cfg.stall_sleeping_cpu_percent
        ):
            out.append(_trainer_stall(ctx, ls, quiet_for, usual, trainer, main_stack))
    return out


def _loader_stall(
    ctx: Context,
    ls: LoaderSample,
    call: float,
    usual: str,
    by_pid: dict[int, ProcessSample],
    main_stack: ProcessStack | None,
) -> Candidate:
    wid, pid, stack = _stuck_worker(ctx, ls, by_pid)
    evidence: dict[str, float | int | str | None] = {
        "loader": ls.name,
        "loader_id": ls.id,
        "stalled_s": round(call, 1),
        "where": "loader",
        "trainer_pid": ls.pid,
    }
    if pid is not None:
        where, ev = _where(stack, by_pid.get(pid))
        who = f"worker {wid} (pid {pid})"
        stuck = f"{who} is stuck {where}".rstrip() if where else f"{who} has delivered the fewest batches"
        evidence.update(ev, worker_id=wid, pid=pid)
        subject = f"worker {wid} (pid {pid})"
    else:
        stuck = "no worker could be singled out"
        subject = f"loader {ls.label}"
    if main_stack is not None and main_stack.frames:
        evidence["trainer_stack"] = format_stack(main_stack.frames)
    message = (
        f"DataLoader {ls.label} has delivered no batch for {duration(call)} ({usual}) while the trainer "
        f"(pid {ls.pid}) waits in __next__: {stuck}."
    )
    advice = (
        "A hang, not a slow loader: more workers will not help. Look at the stuck worker's stack (Enter on "
        "it in the Workers table); set DataLoader(timeout=...) to turn a hang into an error."
    )
    return Candidate(
        STALL,
        f"stall:{ls.id}",
        CRITICAL if call >= ctx.numbers(StallNumbers).stall_critical_s else WARNING,
        subject,
        message,
        advice,
        evidence,
    )


def _lone_workers(
    ctx: Context, ls: LoaderSample, p: LoaderPace, by_pid: dict[int, ProcessSample]
) -> list[Candidate]:
    """Workers that finished no batch for long while the loader went on (out-of-order delivery, or
    the others covering for it), asleep: stuck."""
    s = ctx.latest
    cfg = ctx.numbers(StallNumbers)
    out: list[Candidate] = []
    limit = cfg.stall_rule.lone_threshold_s(p.usual_interval_s, len(ls.worker_pids))
    loader_moving = p.last_progress is not None and s.time - p.last_progress < limit
    memory = ctx.state(StallState).loaders.get(ls.id)
    if memory is None:  # no batch count known: no worker's progress either
        return out
    workers = memory.workers
    for wid, pid in enumerate(ls.worker_pids):
        if wid >= len(ls.batches_per_worker):
            break
        n = ls.batches_per_worker[wid]
        seen = workers.get((wid, pid))
        if seen is None or seen[0] != n:
            if seen is None:  # a new worker (a restart): the ones gone are forgotten
                for key in [k for k in workers if k[1] not in ls.worker_pids]:
                    del workers[key]
            workers[(wid, pid)] = (n, s.time)
            continue
        idle_for = s.time - seen[1]
        proc = by_pid.get(pid)
        asleep = (
            proc is not None
            and proc.state in ("S", "D")
            and (proc.cpu_percent or 0.0) < cfg.stall_sleeping_cpu_percent
        )
        if idle_for < limit or not loader_moving or not asleep:
            continue
        stack = latest_stack(ctx, pid)
        if stack is None or not stack.frames or _is_idle(stack):
            continue  # no stack (or none readable), or waiting for work (a shard ran out): not provably stuck
        where, ev = _where(stack, proc)
        stuck = f" It is stuck {where}." if where else ""
        evidence: dict[str, float | int | str | None] = {
            "loader": ls.name,
            "loader_id": ls.id,
            "stalled_s": round(idle_for, 1),
            "where": "worker",
            "worker_id": wid,
            "pid": pid,
            "trainer_pid": ls.pid,
            **ev,
        }
        out.append(
            Candidate(
                STALL,
                f"stall:{ls.id}:w{wid}",
                CRITICAL if idle_for >= cfg.stall_critical_s else WARNING,
                f"worker {wid} (pid {pid})",
                f"DataLoader {ls.label}'s worker {wid} (pid {pid}) has finished no batch for "
                f"{duration(idle_for)} while the other workers delivered, and it is asleep.{stuck}",
                "One worker is stuck (a lock, a network read, a deadlock in a library): the loader goes on "
                "without it for now. Read its stack (Enter on it in the Workers table).",
                evidence,
            )
        )
    return out


def _trainer_stall(
    ctx: Context,
    ls: LoaderSample,
    quiet_for: float,
    usual: str,
    trainer: ProcessSample,
    main_stack: ProcessStack | None,
) -> Candidate:
    where, ev = _where(main_stack, trainer)
    evidence: dict[str, float | int | str | None] = {
        "loader": ls.name,
        "loader_id": ls.id,
        "stalled_s": round(quiet_for, 1),
        "where": "trainer",
        "pid": trainer.pid,
        "trainer_pid": trainer.pid,
        **ev,
    }
    stuck = f" It is stuck {where}." if where else ""
    return Candidate(
        STALL,
        f"stall:{ls.id}",
        CRITICAL if quiet_for >= ctx.numbers(StallNumbers).stall_critical_s else WARNING,
        f"main (pid {trainer.pid})",
        f"The trainer (pid {trainer.pid}) has asked DataLoader {ls.label} for no batch for "
        f"{duration(quiet_for)} ({usual}) and is asleep outside the loader.{stuck}",
        "The loader is not the problem: the training loop waits on something else (a collective, a "
        "lock, a queue, a subprocess). Read the stack; for distributed jobs check the other ranks.",
        evidence,
    )


def stuck_summary(stacks: Sequence[ProcessStack]) -> str | None:
    """``hang_here (jobs.py:88)`` for the innermost frame of the first non-empty stack."""
    for st in stacks:
        if st.frames:
            return describe_frames(st.frames)
    return None
