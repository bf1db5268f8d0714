"""Where a stuck job is stuck: Python stacks of the trainer and of its DataLoader workers.

Taken only when a loader looks stalled (the trainer inside ``__next__`` for much longer than
the loader's usual batch interval, or no batch at all for long while it is not waiting), and then
at most every ``RETAKE_S`` per loader. A healthy job never pays for any of it.

- The trainer's main thread: the agent's ``{"get": "stacks"}`` (``sys._current_frames()`` in
  its serving thread).
- A worker: dlmon sends it ``STACK_SIGNAL``; the ``faulthandler`` handler the agent registered at
  worker start appends all its threads' stacks to ``<pid>.stack`` in the agent's private directory.
  The signal is sent only to a process of the tree whose stack file's header names that very
  process (pid and start time): the signal's default action would kill one without the handler.
- A worker forked before the agent was loaded into the running job has no handler: its stack is
  read from outside (:mod:`dlmon.collect.outside_stacks`, py-spy or gdb), never signalled, and
  off the sampling thread: such a stack comes with a later tick.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dlmon.agent._journal import STACK_HEADER, STACK_SIGNAL, STACK_SUFFIX
from dlmon.collect.agent_client import AgentClient, AgentReading
from dlmon.collect.outside_stacks import BackgroundReads, read_stack
from dlmon.model.format import DEAD_STATES
from dlmon.model.snapshot import LoaderSample, ProcessSample, ProcessStack, StackFrame
from dlmon.model.stall_rule import STALL_RULE, StallRule, pace_reading

RETAKE_S = 30.0
# stacks are taken a little before the rule's threshold, so they are there when the detector raises
EARLY = 0.8
DUMP_WAIT_S = 0.3
MAX_WORKERS = 16
MAX_FRAMES = 40
MAX_DUMP_BYTES = 64 * 1024
# A worker's stack file takes a dump every RETAKE_S while it stays stuck (days, perhaps, and in a
# tmpfs: memory): past this size it is cut back to its header before the next request.
MAX_STACK_FILE = 256 * 1024
MAX_FDS = 512

CRASH_SIGNALS = frozenset({4, 6, 7, 8, 11})  # SIGILL, SIGABRT, SIGBUS, SIGFPE, SIGSEGV

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<func>.*)$')


@dataclass(slots=True)
class _LoaderWatch:
    # batches/s, smoothed over the readings that tell the pace: the probe sees one reading a tick
    # and keeps no history (the detector takes the median over its recent snapshots)
    rate: float | None = None
    batches: int | None = None
    last_progress: float = 0.0  # monotonic time the batch count last moved
    last_taken: float = -1e9
    workers: dict[int, tuple[int, float]] = field(default_factory=dict)  # id -> (batches, since)
    worker_taken: dict[int, float] = field(default_factory=dict)


def _interval(rate: float | None) -> float | None:
    return 1.0 / rate if rate else None


def parse_faulthandler(text: str) -> list[tuple[str | None, list[StackFrame]]]:
    """faulthandler's dump: [(thread header, frames outermost first)] in the order written."""
    threads: list[tuple[str | None, list[StackFrame]]] = []
    for line in text.splitlines():
        if line.startswith(("Thread ", "Current thread ", "Stack (most recent")):
            threads.append((line.split(" (most recent")[0], []))
            continue
        m = _FRAME.match(line)
        if m is not None and threads:
            ln = m.group("line")
            threads[-1][1].insert(
                0, StackFrame(m.group("file"), int(ln) if ln.isdigit() else None, m.group("func"))
            )
    return threads


def _read(path: str, limit: int = 4096) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def proc_state(pid: int) -> tuple[str | None, str | None, str | None]:
    """(state letter, wchan, a regular file it has open) of a process; None where unreadable."""
    stat = _read(f"/proc/{pid}/stat")
    state = stat[stat.rindex(")") + 2] if stat and ")" in stat else None
    wchan = _read(f"/proc/{pid}/wchan")
    wchan = wchan.strip() if wchan and wchan.strip() not in ("", "0") else None
    reading: str | None = None
    with contextlib.suppress(OSError):
        fds = sorted((int(n) for n in os.listdir(f"/proc/{pid}/fd") if n.isdigit()), reverse=True)
        for fd in fds[:MAX_FDS]:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/") and not target.startswith(("/dev/", "/proc/", "/sys/")):
                if ".so" in os.path.basename(target) or target.endswith((STACK_SUFFIX, ".jsonl")):
                    continue
                reading = target
                break
    return state, wchan, reading


def _start_time(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    try:
        return int(stat[stat.rindex(")") + 2 :].split()[19]) if stat else None
    except (ValueError, IndexError):
        return None


def _cut_to_header(fd: int, head: str, size: int) -> int:
    """Truncate a stack file (open for writing: ``fd``) to its header line (the worker appends
    with O_APPEND: safe); the file's size after it (``size`` unchanged where it could not be cut)."""
    keep = len(head.split("\n", 1)[0].encode("utf-8")) + 1
    try:
        os.ftruncate(fd, keep)
    except OSError:
        return size
    return keep


def _outside_stack(wid: int, pid: int, start: int | None) -> ProcessStack | None:
    """A worker's stack read from outside (on :class:`BackgroundReads`' thread); None when the pid
    is no longer the process it was asked for (the read may come long after the ask)."""
    if start is None or _start_time(pid) != start:
        return None
    got = read_stack(pid)
    state, wchan, reading = proc_state(pid)
    return ProcessStack(
        pid=pid,
        role="worker",
        worker_id=wid,
        time=time.time(),
        thread=got.thread,
        frames=got.frames[-MAX_FRAMES:],
        state=state,
        wchan=wchan,
        reading=reading,
        source=got.source,
    )


class StallProbe:
    """Decides when a loader is stalled and then collects stacks; keeps a little state per loader."""

    def __init__(self, agent: AgentClient, rule: StallRule = STALL_RULE) -> None:
        self._agent = agent
        self._rule = rule  # the stall detector's (StallNumbers.stall_rule)
        self._watch: dict[str, _LoaderWatch] = {}
        self._crash_read: set[int] = set()
        # py-spy / gdb reads of workers forked before the agent: never on the sampling thread
        self._outside: BackgroundReads[ProcessStack] = BackgroundReads(_outside_stack)
        self.error: str | None = None  # the last failure, swallowed

    def probe(
        self, reading: AgentReading | None, processes: Sequence[ProcessSample]
    ) -> tuple[ProcessStack, ...]:
        """Stacks worth recording this tick (usually none). Never raises: a sample is worth more."""
        try:
            stacks = self._crash_stacks() + self._stall_stacks(reading, processes)
            return stacks + tuple(self._outside.take())  # read from outside since the last tick
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return ()

    def _crash_stacks(self) -> tuple[ProcessStack, ...]:
        """The stacks a worker's faulthandler wrote as it crashed (SIGSEGV, SIGBUS, SIGABRT...)."""
        out: list[ProcessStack] = []
        for d in self._agent.known_deaths():
            if d.pid in self._crash_read or d.signal not in CRASH_SIGNALS or d.reported_by is None:
                continue
            self._crash_read.add(d.pid)
            name = self._agent.agent_pid_of(d.reported_by, d.pid)  # a container's name for it
            text = self._new_text(d.reported_by, f"{name}{STACK_SUFFIX}", 0)
            if text is None or "Fatal Python error" not in text:
                continue
            text = text[text.rindex("Fatal Python error") :]
            out.append(self._worker_stack(d.worker_id, d.pid, text, live=False))
        return tuple(out)

    def _stall_stacks(
        self, reading: AgentReading | None, processes: Sequence[ProcessSample]
    ) -> tuple[ProcessStack, ...]:
        if reading is None:
            return ()
        now = time.monotonic()
        stuck: list[LoaderSample] = []
        lone: list[tuple[int, int, int]] = []
        for ls in reading.loaders:
            w = self._watch.setdefault(ls.id, _LoaderWatch(last_progress=now))
            if ls.batches_total != w.batches:
                w.batches = ls.batches_total
                w.last_progress = now
                rate = pace_reading(ls)
                if rate is not None:
                    w.rate = rate if w.rate is None else 0.8 * w.rate + 0.2 * rate
            if not ls.alive:
                continue
            waited = max(ls.in_call_s or 0.0, now - w.last_progress)
            limit = self._rule.threshold_s(None if ls.in_startup else _interval(w.rate))
            if waited >= EARLY * limit and now - w.last_taken >= RETAKE_S:
                w.last_taken = now
                stuck.append(ls)
            lone.extend((ls.pid, wid, ls.worker_pids[wid]) for wid in self._lone_workers(ls, w, now))
        for gone in set(self._watch) - {ls.id for ls in reading.loaders}:
            del self._watch[gone]
        if not stuck and not lone:
            return ()
        by_pid = {p.pid: p for p in processes}
        out: list[ProcessStack] = []
        trainers = dict.fromkeys(ls.pid for ls in stuck)
        for pid in trainers:
            out.extend(self._trainer_stack(pid))
        workers = [
            (ls.pid, wid, wpid)
            for ls in stuck
            if (ls.in_call_s or 0.0) > 0
            for wid, wpid in enumerate(ls.worker_pids)
            if wpid in by_pid and by_pid[wpid].state not in DEAD_STATES
        ]
        lone = [x for x in lone if x[2] in by_pid and x not in workers]
        out.extend(self._worker_stacks((workers + lone)[:MAX_WORKERS]))
        return tuple(out)

    def _lone_workers(self, ls: LoaderSample, w: _LoaderWatch, now: float) -> list[int]:
        """Worker ids that finished no batch for long while the loader as a whole went on."""
        out: list[int] = []
        limit = EARLY * self._rule.lone_threshold_s(_interval(w.rate), len(ls.worker_pids))
        for wid, n in enumerate(ls.batches_per_worker[: len(ls.worker_pids)]):
            before = w.workers.get(wid)
            if before is None or before[0] != n:
                w.workers[wid] = (n, now)
                continue
            stuck_long = now - before[1] >= limit and now - w.last_progress < limit
            if stuck_long and now - w.worker_taken.get(wid, -1e9) >= RETAKE_S:
                w.worker_taken[wid] = now
                out.append(wid)
        return out

    def _trainer_stack(self, pid: int) -> list[ProcessStack]:
        got = self._agent.main_thread_stack(pid)
        state, wchan, reading = proc_state(pid)
        if got is None:
            return []
        name, frames = got
        return [
            ProcessStack(
                pid=pid,
                role="main",
                worker_id=None,
                time=time.time(),
                thread=name,
                frames=tuple(StackFrame(f, ln, fn) for f, ln, fn in frames[-MAX_FRAMES:]),
                state=state,
                wchan=wchan,
                reading=reading,
                source="agent",
            )
        ]

    def _worker_stacks(self, workers: Iterable[tuple[int, int, int]]) -> list[ProcessStack]:
        if STACK_SIGNAL is None:
            return []
        sent: list[tuple[int, int, int, str, int]] = []  # (worker id, pid, trainer, file, size before)
        for trainer, wid, pid in workers:
            name = self._agent.agent_pid_of(trainer, pid)  # the worker's own pid: a container's
            file = f"{name}{STACK_SUFFIX}"
            try:
                fd = self._agent.open_agent_file(trainer, file)
            except FileNotFoundError:
                if self._agent.stack_dir(trainer) is not None:  # forked before the agent: no handler
                    self._outside.ask(wid, pid, _start_time(pid))
                continue
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                head = os.pread(fd, 256, 0).decode("utf-8", "replace")
            except OSError:
                continue
            finally:
                os.close(fd)
            fields = dict(kv.split("=", 1) for kv in head.split("\n", 1)[0].split()[1:] if "=" in kv)
            if not head.startswith(STACK_HEADER) or fields.get("pid") != str(name):
                continue
            if fields.get("start") != str(_start_time(pid)):
                continue  # another process now has that pid
            if size > MAX_STACK_FILE:
                with contextlib.suppress(OSError):
                    fd = self._agent.open_agent_file(trainer, file, os.O_WRONLY)
                    try:
                        size = _cut_to_header(fd, head, size)
                    finally:
                        os.close(fd)
            try:
                os.kill(pid, STACK_SIGNAL)
            except OSError:
                continue
            sent.append((wid, pid, trainer, file, size))
        if not sent:
            return []
        deadline = time.monotonic() + DUMP_WAIT_S
        out: list[ProcessStack] = []
        pending = list(sent)
        while pending and time.monotonic() < deadline:
            time.sleep(0.02)
            still: list[tuple[int, int, int, str, int]] = []
            for wid, pid, trainer, file, size in pending:
                text = self._new_text(trainer, file, size)
                if text is None or "File " not in text:
                    still.append((wid, pid, trainer, file, size))
                    continue
                out.append(self._worker_stack(wid, pid, text))
            pending = still
        return out

    def _new_text(self, trainer: int, file: str, size: int) -> str | None:
        """What a stack file in the directory of trainer's agent holds from ``size`` on."""
        try:
            fd = self._agent.open_agent_file(trainer, file)
        except OSError:
            return None
        try:
            data = os.pread(fd, MAX_DUMP_BYTES, size)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data.decode("utf-8", "replace") if data else None

    @staticmethod
    def _worker_stack(wid: int | None, pid: int, text: str, live: bool = True) -> ProcessStack:
        threads = parse_faulthandler(text)
        chosen = next((t for t in threads if t[0] and t[0].startswith("Current thread")), None)
        if live or chosen is None:
            chosen = next((t for t in threads if any(f.function == "_worker_loop" for f in t[1])), chosen)
        if chosen is None and threads:
            chosen = threads[0]
        state, wchan, reading = proc_state(pid) if live else (None, None, None)
        return ProcessStack(
            pid=pid,
            role="worker",
            worker_id=wid,
            time=time.time(),
            thread=chosen[0] if chosen else None,
            frames=tuple(chosen[1][-MAX_FRAMES:]) if chosen else (),
            state=state,
            wchan=wchan,
            reading=reading,
            source="faulthandler" if live else "crash",
        )
