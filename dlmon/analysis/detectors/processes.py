"""The workers' lives: zombie_worker, orphan_worker, worker_died, leaked_workers."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from dlmon.analysis.detectors._base import (
    MIB,
    Candidate,
    Context,
    Headroom,
    describe_headroom,
    duration,
    headroom,
    pid_list,
    size,
    sum_known,
)
from dlmon.analysis.digest import process_label
from dlmon.analysis.severity import CRITICAL, INFO, WARNING
from dlmon.model import ProcessSample, Snapshot, WorkerDeath
from dlmon.model.format import DEAD_STATES, SIGKILL, signal_name
from dlmon.model.snapshot import KernelEvent, ProcessStack, StackFrame

ZOMBIE_WORKER = "zombie_worker"
ORPHAN_WORKER = "orphan_worker"
WORKER_DIED = "worker_died"
LEAKED_WORKERS = "leaked_workers"
TRAINER_DIED = "trainer_died"


@dataclass(frozen=True, slots=True)
class ProcessNumbers:
    """The numbers of the kinds about the job's processes: zombies, orphans, deaths, leaked workers."""

    death_window_s: float = 900.0  # a worker death stays an alert this long
    oom_slack_s: float = 10.0  # OOM counters are compared this far either side of a death
    vanished_s: float = 3.0  # a listed worker pid missing this long has vanished
    leak_generations: int = 3  # worker generations alive at once (without the agent)
    generation_gap_s: float = 2.0  # workers started further apart are different generations
    clock_ticks_per_s: int = 100  # start_time unit (USER_HZ; 100 on every Linux we know)


K = TypeVar("K")
V = TypeVar("V")
REMEMBERED_DEATHS = 256  # deaths whose black box (and a trainer's orphans) are kept


@dataclass(slots=True)
class ProcessState:
    """What the death detectors saw when a death was first seen, which later ticks cannot see
    again (the dead process leaves the recent window; a dead trainer's workers exit within
    seconds): each death's black box, and the workers a dead trainer left alive."""

    black_boxes: dict[tuple[int, int], dict[str, float | int | str | None]] = field(default_factory=dict)
    trainer_orphans: dict[tuple[int, int | None], list[int]] = field(default_factory=dict)

    def keep_box(self, key: tuple[int, int], box: dict[str, float | int | str | None]) -> None:
        _keep(self.black_boxes, key, box)

    def keep_orphans(self, key: tuple[int, int | None], pids: list[int]) -> None:
        _keep(self.trainer_orphans, key, pids)


def _keep(memory: dict[K, V], key: K, value: V) -> None:
    """Bounded: the oldest is forgotten first (long past its alert's ``death_window_s``)."""
    memory[key] = value
    while len(memory) > REMEMBERED_DEATHS:
        del memory[next(iter(memory))]


SIGBUS = 7
SIGSEGV = 11
SIGABRT = 6


def _label(p: ProcessSample) -> str:
    return process_label(p.role, p.pid, p.worker_id)


# -- zombie_worker ---------------------------------------------------------------------------


def detect_zombie_worker(ctx: Context) -> list[Candidate]:
    out: list[Candidate] = []
    by_pid = {p.pid: p for p in ctx.latest.processes}
    for z in ctx.tree().zombies:
        parent = by_pid.get(z.ppid) if z.ppid is not None else None
        parent_text = f"its parent (pid {z.ppid})" if z.ppid is not None else "its parent"
        if parent is not None and parent.role == "main":
            parent_text = f"the trainer (pid {parent.pid})"
        worker = z.role == "worker"
        out.append(
            Candidate(
                ZOMBIE_WORKER,
                f"pid:{z.pid}:{z.start_time}",
                WARNING if worker else INFO,
                _label(z),
                f"{'DataLoader worker' if worker else 'Child process'} pid {z.pid} is a zombie: it has "
                f"exited but {parent_text} has not reaped it.",
                (
                    "A worker that died stays a zombie while its DataLoader iterator lives; the "
                    "trainer gets 'DataLoader worker (pid N) is killed by signal' on its next batch. "
                    "Check the log and dmesg (OOM killer), and do not keep a failed iterator alive: "
                    "delete it or recreate the DataLoader."
                    if worker
                    else "Its parent does not wait() for it; if zombies pile up, fix the parent's "
                    "subprocess handling (wait/communicate)."
                ),
                {
                    "pid": z.pid,
                    "ppid": z.ppid,
                    "worker_id": z.worker_id,
                    "role": z.role,
                    "parent_state": None if parent is None else parent.state,
                },
            )
        )
    return out


# -- orphan_worker ---------------------------------------------------------------------------


def detect_orphan_worker(ctx: Context) -> list[Candidate]:
    tree = ctx.tree()
    if not tree.orphans:
        return []
    s = ctx.latest
    orphans = sorted(tree.orphans, key=lambda p: p.pid)
    pids = [p.pid for p in orphans]
    rss = sum_known(p.rss_bytes for p in orphans)
    pss = sum_known(p.pss_bytes for p in orphans)
    gpu = sum_known(p.gpu_memory_bytes for p in orphans)
    workers = sum(1 for p in orphans if p.role == "worker")
    trainer = (
        f"their trainer (pid {s.target.pid}) exited"
        if not s.target.alive
        else f"they are no longer under the trainer (pid {s.target.pid})"
    )
    holds = f"{size(rss)} RSS"
    if pss is not None:
        holds += f" ({size(pss)} PSS)"
    if gpu:
        holds += f" and {size(gpu)} of GPU memory"
    noun = "DataLoader worker" if workers == 1 else "DataLoader workers"
    return [
        Candidate(
            ORPHAN_WORKER,
            "job",
            CRITICAL if gpu else WARNING,
            f"orphans of pid {s.target.pid}",
            f"{workers} {noun} (pids {pid_list(pids)}) are still alive although {trainer}, holding {holds}.",
            "Workers poll their parent and normally exit within about 5-10 s of its death; if they "
            f"linger, end them (kill {' '.join(str(p) for p in pids[:16])}). Let the trainer exit "
            "cleanly (no kill -9; delete iterators) so it shuts its workers down itself.",
            {
                "count": len(orphans),
                "workers": workers,
                "pids": ",".join(str(p) for p in pids),
                "rss_bytes": rss,
                "pss_bytes": pss,
                "gpu_memory_bytes": gpu,
                "target_alive": str(s.target.alive).lower(),
                "ppids": ",".join(sorted({str(p.ppid) for p in orphans})),
            },
        )
    ]


# -- worker_died -----------------------------------------------------------------------------


def death_time(ctx: Context, death: WorkerDeath) -> float:
    """When it died: the agent's time, else when a snapshot first listed it."""
    if death.time is not None:
        return death.time
    return ctx.digest.deaths_seen.get((death.pid, None), ctx.now)


def _oom_increase(ctx: Context, when: float) -> tuple[int | None, str | None]:
    """(kills counted around the death, which counter) or (None, None) when unknown."""
    slack = ctx.numbers(ProcessNumbers).oom_slack_s
    digest = ctx.digest
    if not digest.oom or digest.oom[0].time > when:
        return None, None  # we were not watching before it died
    before = digest.oom_at(when - slack) or digest.oom[0]
    after = digest.oom_at(when + slack)
    if after is None:
        return None, None
    if before.cgroup is not None and after.cgroup is not None and after.cgroup > before.cgroup:
        return after.cgroup - before.cgroup, "cgroup"
    cg = ctx.latest.cgroup
    if (
        before.cgroup is not None
        and after.cgroup is not None
        and cg is not None
        and cg.usage_path is not None
        and cg.usage_path == cg.path
    ):
        # the job's own memory cgroup counts every OOM kill of its processes, the machine's as
        # well (v1 oom_control, v2 memory.events): it did not move, so the machine count that
        # did was another process's kill
        return 0, "cgroup"
    if before.machine is not None and after.machine is not None:
        if after.machine > before.machine:
            return after.machine - before.machine, "machine"
        return 0, "machine"
    if before.cgroup is not None and after.cgroup is not None:
        return 0, "cgroup"
    return None, None


def _other_sigkills(ctx: Context, pid: int, when: float) -> tuple[list[int], list[int]]:
    """(other workers SIGKILLed within the OOM slack of ``when`` that the kernel log does not name,
    the job's pids the kernel log names as OOM victims then): who shares an OOM count's rise."""
    s = ctx.latest
    slack = ctx.numbers(ProcessNumbers).oom_slack_s
    named = sorted(
        {
            e.pid
            for e in s.kernel_events
            if e.kind == "oom_kill" and e.pid != pid and e.time is not None and abs(e.time - when) <= slack
        }
    )
    others = sorted(
        {
            d.pid
            for d in s.worker_deaths
            if d.pid != pid
            and d.pid not in named
            and d.signal == SIGKILL
            and abs(death_time(ctx, d) - when) <= slack
        }
    )
    return others, named


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def kernel_event(s: Snapshot, pid: int, kind: str) -> KernelEvent | None:
    """The kernel's last line of ``kind`` about ``pid`` in the snapshot, if it logged one."""
    found = None
    for e in s.kernel_events:
        if e.pid == pid and e.kind == kind:
            found = e
    return found


def _snapshot_at(ctx: Context, when: float) -> Snapshot:
    """The last snapshot taken before ``when`` (the job as it stood just before the death)."""
    best = ctx.recent[0]
    for snap in ctx.recent:
        if snap.time > when:
            break
        best = snap
    return best


def _oom_figures(
    ctx: Context, event: KernelEvent | None, when: float
) -> tuple[str, dict[str, float | int | str | None]]:
    """ "cgroup limit 512 MiB, job at 505 MiB; its RSS at the kill 480 MiB anon" and the numbers."""
    before = _snapshot_at(ctx, when)
    ev: dict[str, float | int | str | None] = {}
    parts: list[str] = []
    scope = event.constraint if event is not None else None
    cg = before.cgroup
    if scope == "cgroup" or (scope is None and cg is not None and cg.limit_bytes is not None):
        limit = event.memcg_limit_bytes if event is not None and event.memcg_limit_bytes else None
        limit = limit if limit is not None else (cg.limit_bytes if cg is not None else None)
        peak = event.memcg_peak_bytes if event is not None else None
        current = cg.current_bytes if cg is not None else None
        text = f"cgroup limit {size(limit)}"
        if peak is not None:
            text += f", cgroup peak {size(peak)}"
        else:
            text += f", cgroup at {size(current)} just before"
        parts.append(text)
        ev.update(limit="cgroup", limit_bytes=limit, cgroup_peak_bytes=peak, memory_before_bytes=current)
    else:
        m = before.memory
        parts.append(f"machine memory {size(m.total_bytes)}, {size(m.available_bytes)} available just before")
        ev.update(limit="machine", limit_bytes=m.total_bytes, available_before_bytes=m.available_bytes)
    job = before.memory.pss_sum_bytes
    if job is not None:
        parts.append(f"job PSS {size(job)}")
        ev["job_pss_before_bytes"] = job
    if event is not None:
        rss = sum_known((event.anon_rss_bytes, event.file_rss_bytes, event.shmem_rss_bytes))
        parts.append(
            f"its RSS at the kill {size(rss)} (anon {size(event.anon_rss_bytes)}, "
            f"shmem {size(event.shmem_rss_bytes)})"
        )
        ev.update(
            kernel_anon_rss_bytes=event.anon_rss_bytes,
            kernel_file_rss_bytes=event.file_rss_bytes,
            kernel_shmem_rss_bytes=event.shmem_rss_bytes,
            kernel_memcg=event.memcg,
            kernel_line=event.line,
        )
    return "; ".join(parts), ev


TRAIL_POINTS = 12
VANISHED_BEFORE_EXIT_S = 5.0  # without the agent: workers gone this long before the trainer's error exit
MAX_STACK_TEXT = 4000


def latest_stack(ctx: Context, pid: int) -> ProcessStack | None:
    """The newest stack dlmon took of ``pid`` in the recent snapshots."""
    if ctx.index is not None:
        return ctx.index.latest_stack(pid)
    for snap in reversed(ctx.recent):
        for st in snap.stacks:
            if st.pid == pid:
                return st
    return None


def _short(f: StackFrame) -> str:
    return f"{f.function} ({f.file.rsplit('/', 1)[-1]}:{f.line if f.line is not None else '?'})"


def describe_frames(frames: Sequence[StackFrame]) -> str:
    """``hang_here (jobs.py:88)``, with the caller outside the standard library and torch when
    the innermost frame is inside them: ``string_at (__init__.py:519) from __getitem__ (deaths.py:77)``."""
    inner = frames[-1]
    text = _short(inner)

    def library(f: StackFrame) -> bool:
        return "/lib/python" in f.file or "/site-packages/" in f.file or f.file.startswith("<")

    if library(inner):
        user = next((f for f in reversed(frames) if not library(f)), None)
        if user is not None:
            text += f" from {_short(user)}"
    return text


def format_stack(frames: Sequence[StackFrame]) -> str:
    """Outermost first, one frame a line, as a traceback reads; bounded."""
    text = "\n".join(f'File "{f.file}", line {f.line}, in {f.function}' for f in frames)
    return text[-MAX_STACK_TEXT:]


def black_box(ctx: Context, pid: int) -> dict[str, float | int | str | None]:
    """The dead process's last minutes of memory, thinned to TRAIL_POINTS readings (MiB, fds)."""
    points: list[ProcessSample] = []
    times: list[float] = []
    for snap in ctx.recent:
        for p in snap.processes:
            if p.pid == pid and p.state not in DEAD_STATES:
                points.append(p)
                times.append(snap.time)
    if not points:
        return {}
    step = max(1, -(-len(points) // TRAIL_POINTS))
    idx = list(range(len(points) - 1, -1, -step))[::-1]

    def series(get: Callable[[ProcessSample], int | None], scale: float) -> str:
        return ",".join("" if (v := get(points[i])) is None else f"{v / scale:.0f}" for i in idx)

    mib = float(MIB)
    return {
        "trail_t": ",".join(f"{times[i] - times[-1]:.0f}" for i in idx),  # seconds before its last reading
        "trail_pss_mib": series(lambda p: p.pss_bytes, mib),
        "trail_uss_mib": series(lambda p: p.uss_bytes, mib),
        "trail_rss_anon_mib": series(lambda p: p.rss_anon_bytes, mib),
        "trail_shm_mib": series(lambda p: p.shmem_bytes, mib),
        "trail_fds": series(lambda p: p.num_fds, 1.0),
    }


def describe_trail(ev: Mapping[str, float | int | str | None]) -> str | None:
    """ "USS 120 -> 480 MiB over its last 110 s" from a black box, when it says anything."""
    t = ev.get("trail_t")
    for key, name in (("trail_uss_mib", "USS"), ("trail_pss_mib", "PSS"), ("trail_rss_anon_mib", "anon RSS")):
        vals = [v for v in str(ev.get(key) or "").split(",") if v]
        if len(vals) >= 2 and isinstance(t, str):
            span = -float(t.split(",")[0] or 0)
            return f"{name} {vals[0]} -> {vals[-1]} MiB over its last {duration(span)}"
    return None


def _death_candidate(
    ctx: Context, death: WorkerDeath, when: float, room: Headroom | None
) -> Candidate | None:
    s = ctx.latest
    label = process_label("worker", death.pid, death.worker_id)
    sig = death.signal
    name = death.signal_name or (signal_name(sig) if sig is not None else None)
    evidence: dict[str, float | int | str | None] = {
        "pid": death.pid,
        "worker_id": death.worker_id,
        "loader_id": death.loader_id,
        "loader": death.loader_name,
        "signal": sig,
        "exit_code": death.exit_code,
        "time": when,
        "source": death.source,
    }
    at = f" at {_clock(when)}"
    of = next((lo.label for lo in s.loaders if lo.id == death.loader_id), death.loader_name)  # with its rank
    who = f"DataLoader {label}" + (f" of {of}" if of else "")
    memory_advice = "Lower num_workers or batch_size, or fix the growth (see memory_growth)"
    if room is not None:
        memory_advice += f"; now {describe_headroom(room)}"
    oom = kernel_event(s, death.pid, "oom_kill")
    if sig == SIGKILL or (sig is None and oom is not None):
        kills, counter = _oom_increase(ctx, when)
        evidence["oom_kills"] = kills
        evidence["oom_counter"] = counter
        others, named = _other_sigkills(ctx, death.pid, when)
        shared = kills is not None and kills > 0 and oom is None and (named or others)
        if shared:
            assert kills is not None
            kills = max(0, kills - len(named))  # the kernel log gave those kills to other processes
        if shared and kills and kills <= len(others):
            # fewer kills than SIGKILLed workers around then: which ones the OOM killer took is unknown
            cause, severity = "sigkill_unknown", CRITICAL
            message = (
                f"{who} was killed by SIGKILL{at}; the {counter} OOM-kill count rose by {kills} for "
                f"{len(others) + 1} workers killed around then (pids {pid_list([death.pid, *others])}): "
                "which of them the OOM killer took is unknown."
            )
            advice = "Check dmesg for 'Out of memory: Killed process'. " + memory_advice + "."
        elif shared and not kills:
            cause, severity = "sigkill", WARNING
            message = (
                f"{who} was killed by SIGKILL{at}, not by the OOM killer (the kernel log gives the "
                f"{counter}'s OOM kill around then to pid {pid_list(named)}, not to this worker)."
            )
            advice = "Something sent kill -9: a supervisor, a timeout, a user; check who."
        elif oom is not None or kills:
            cause, severity = "oom_killer", CRITICAL
            figures, more = _oom_figures(ctx, oom, when)
            evidence.update(more)
            witness = (
                "the kernel log names it"
                if oom is not None
                else f"the {counter} OOM-kill count rose by {kills}"
            )
            message = f"{who} was killed by the kernel OOM killer{at} ({figures}; {witness})."
            advice = memory_advice + "; copy-on-read of a Python-object Dataset is the usual cause."
        elif kills == 0:
            cause, severity = "sigkill", WARNING
            message = (
                f"{who} was killed by SIGKILL{at}, not by the OOM killer (no OOM kill was "
                f"counted by the {counter}, none in the kernel log)."
            )
            advice = "Something sent kill -9: a supervisor, a timeout, a user; check who."
        else:
            cause, severity = "sigkill_unknown", CRITICAL
            message = (
                f"{who} was killed by SIGKILL{at}, most often the OOM killer "
                "(the OOM counters before its death are unknown)."
            )
            advice = "Check dmesg for 'Out of memory: Killed process'. " + memory_advice + "."
    elif sig == SIGBUS:
        cause, severity = "shm_exhausted", CRITICAL
        shm = _snapshot_at(ctx, when).shm or s.shm
        free = (
            ""
            if shm is None
            else f" ({size(shm.used_bytes)} used of {size(shm.total_bytes)}, "
            f"{size(shm.available_bytes)} free)"
        )
        message = f"{who} died of SIGBUS (Bus error){at}: shared memory /dev/shm ran out{free}."
        advice = (
            "Give /dev/shm more room (docker run --shm-size=8g, or a bigger tmpfs), or lower "
            "num_workers, prefetch_factor or the batch size; or pass tensors through files with "
            "torch.multiprocessing.set_sharing_strategy('file_system')."
        )
        if shm is not None and shm.job_segments:
            message = message[:-1] + (
                f"; the job's own torch segments there: {shm.job_segments}, {size(shm.job_bytes)}."
            )
        if shm is not None:
            evidence["shm_job_segments"] = shm.job_segments
            evidence["shm_job_bytes"] = shm.job_bytes
            evidence["shm_available_bytes"] = shm.available_bytes
            evidence["shm_used_bytes"] = shm.used_bytes
            evidence["shm_total_bytes"] = shm.total_bytes
    elif sig in (SIGSEGV, SIGABRT):
        cause, severity = "crash", CRITICAL
        seg = kernel_event(s, death.pid, "segfault")
        where = f"; kernel: {seg.line}" if seg is not None else ""
        stack = latest_stack(ctx, death.pid)
        if stack is not None and stack.frames:
            where = f" in {describe_frames(stack.frames)}{where}"
            evidence["stack"] = format_stack(stack.frames)
        message = f"{who} crashed ({name}){at}: a native library failed inside the worker{where}."
        advice = (
            "Usual suspects are image/video libraries with their own threads (OpenCV: "
            "cv2.setNumThreads(0) in worker_init_fn) or a library not safe after fork; try "
            "multiprocessing_context='spawn' or 'forkserver'."
        )
        if seg is not None:
            evidence["kernel_line"] = seg.line
    elif sig is not None:
        cause, severity = "signal", WARNING
        message = f"{who} was ended by {name}{at}."
        advice = "Something signalled the worker; check the job's supervisor and the log."
    elif death.exit_code not in (None, 0):
        cause, severity = "exit_code", WARNING
        message = f"{who} exited with code {death.exit_code}{at}."
        advice = "Read the worker's traceback in the training log: the Dataset raised."
    else:
        return None
    evidence["cause"] = cause
    state = ctx.state(ProcessState)
    box_key = (death.pid, round(when))
    box = state.black_boxes.get(box_key)
    if box is None:
        box = black_box(ctx, death.pid)
        state.keep_box(box_key, box)
    evidence.update(box)
    trail = describe_trail(box)
    if trail is not None and cause in ("oom_killer", "sigkill_unknown", "shm_exhausted"):
        message = message[:-1] + f"; {trail}."
    return Candidate(
        WORKER_DIED, f"death:{death.pid}:{round(when)}", severity, label, message, advice, evidence
    )


def _vanished(ctx: Context) -> list[Candidate]:
    """Worker pids a loader still lists that left the tree (dead and reaped, or never seen die)."""
    s = ctx.latest
    if not s.loaders:
        return []
    cfg = ctx.numbers(ProcessNumbers)
    present = {p.pid for p in s.processes}
    reported = {d.pid for d in s.worker_deaths}
    suspects = {
        (loader.id, pid)
        for loader in s.loaders
        if loader.alive
        for pid in loader.worker_pids
        if pid not in present and pid not in reported
    }
    if not suspects:
        return []
    known = {t.pid for t in ctx.digest.processes.values()}
    suspects = {(lid, pid) for lid, pid in suspects if pid in known}  # it was in the tree once
    window = ctx.window(cfg.vanished_s)
    if not suspects or s.time - window[0].time < cfg.vanished_s:
        return []
    for snap in window:
        pids = {p.pid for p in snap.processes}
        listed = {(loader.id, pid) for loader in snap.loaders for pid in loader.worker_pids}
        suspects = {x for x in suspects if x in listed and x[1] not in pids}
        if not suspects:
            return []
    names = {loader.id: loader.label for loader in s.loaders}
    return [
        Candidate(
            WORKER_DIED,
            f"vanished:{pid}",
            WARNING,
            process_label("worker", pid),
            f"DataLoader worker pid {pid} vanished from the process tree while its loader "
            f"({names.get(lid, lid)}) still lists it: it died and was reaped.",
            "The trainer will fail on its next batch from this worker; look in the log and in dmesg "
            "for the cause (OOM killer, a signal), and check memory headroom.",
            {"pid": pid, "loader_id": lid, "cause": "vanished"},
        )
        for lid, pid in sorted(suspects)
    ]


def _role_of(ctx: Context, pid: int) -> tuple[str, int | None] | None:
    for snap in reversed(ctx.recent):
        for p in snap.processes:
            if p.pid == pid:
                return p.role, p.worker_id
    return None


def _killed_without_agent(ctx: Context, reported: set[int]) -> list[Candidate]:
    """Workers the kernel log says it OOM-killed, that no agent reported (kept like any death)."""
    s = ctx.latest
    out: list[Candidate] = []
    for e in s.kernel_events:
        if e.kind != "oom_kill" or e.pid in reported or e.pid == s.target.pid:
            continue
        role = _role_of(ctx, e.pid)
        if role is not None and role[0] != "worker":
            continue
        when = e.time if e.time is not None else s.time
        if when < s.time - ctx.numbers(ProcessNumbers).death_window_s:
            continue
        death = WorkerDeath(e.pid, role[1] if role else None, None, 9, None, when, source="kernel")
        c = _death_candidate(ctx, death, when, headroom(s))
        if c is not None:
            out.append(c)
    return out


def _vanished_without_agent(ctx: Context, reported: set[int]) -> list[Candidate]:
    """No loader lists the workers (no agent): workers that left the tree just before the trainer
    exited with an error. Which of them died first, and how, cannot be known; say what is."""
    s = ctx.latest
    code = s.target.exit_code
    if len(ctx.recent) < 2 or s.target.alive or code is None or code == 0 or code > 128:
        return []  # killed by a signal: trainer_died says it, its workers' ends follow from it
    if any(snap.loaders for snap in ctx.recent):
        return []  # the agent was there: it reports deaths itself
    present = {p.pid for p in s.processes if p.state not in DEAD_STATES}
    window = ctx.window(VANISHED_BEFORE_EXIT_S)[:-1] or ctx.recent[-2:-1]
    last_alive: dict[int, tuple[float, ProcessSample]] = {}
    for snap in window:
        for p in snap.processes:
            if p.role == "worker" and p.state not in DEAD_STATES:
                last_alive[p.pid] = (snap.time, p)
    gone = [w for _, w in last_alive.values() if w.pid not in present and w.pid not in reported]
    prev_time = min((t for t, w in last_alive.values() if w in gone), default=s.time)
    gone = [w for w in gone if kernel_event(s, w.pid, "oom_kill") is None]
    if not gone:
        return []
    gone.sort(key=lambda w: w.pid)
    labels = ", ".join(
        f"{w.worker_id} (pid {w.pid})" if w.worker_id is not None else f"pid {w.pid}" for w in gone[:8]
    )
    noun = "worker" if len(gone) == 1 else "workers"
    return [
        Candidate(
            WORKER_DIED,
            "vanished:job",
            WARNING,
            labels,
            f"DataLoader {noun} {labels} vanished between {_clock(prev_time)} and {_clock(s.time)}, as the "
            f"trainer exited with code {s.target.exit_code}; how is unknown (no dlmon agent in the trainer "
            "to see a worker die, nothing in the kernel log).",
            "Run the training under 'dlmon run' (or call dlmon.agent.start() in it) to see which worker "
            "died and how; the training log has torch's own line.",
            {
                "pids": ",".join(str(w.pid) for w in gone),
                "pid": gone[0].pid,
                "cause": "vanished",
                "time": s.time,
            },
        )
    ]


def detect_trainer_died(ctx: Context) -> list[Candidate]:
    """The trainer itself was killed (exit 128+N under dlmon run, or the kernel log names it)."""
    s = ctx.latest
    t = s.target
    if t.alive:
        return []
    oom = kernel_event(s, t.pid, "oom_kill")
    code = t.exit_code
    sig = code - 128 if code is not None and code > 128 else None
    if oom is None and sig is None:
        return []
    when = oom.time if oom is not None and oom.time is not None else s.time
    label = process_label("main", t.pid)
    evidence: dict[str, float | int | str | None] = {
        "pid": t.pid,
        "exit_code": code,
        "signal": sig,
        "time": when,
    }
    kills, counter = _oom_increase(ctx, when) if sig in (None, SIGKILL) else (None, None)
    if oom is not None or (sig == SIGKILL and kills):
        figures, more = _oom_figures(ctx, oom, when)
        evidence.update(more, cause="oom_killer")
        message = (
            f"The trainer (pid {t.pid}) was killed by the kernel OOM killer at {_clock(when)} ({figures})"
        )
        severity = CRITICAL
    elif sig == SIGKILL and kills == 0:
        evidence["cause"] = "sigkill"
        message = (
            f"The trainer (pid {t.pid}) was killed by SIGKILL at about {_clock(when)}, not by the OOM "
            f"killer (no OOM kill counted by the {counter}, none in the kernel log)"
        )
        severity = WARNING
    else:
        name = f"signal {sig}" if sig is None else signal_name(sig)
        evidence["cause"] = "crash" if sig in (SIGSEGV, SIGABRT, SIGBUS) else "signal"
        message = f"The trainer (pid {t.pid}) was ended by {name} at about {_clock(when)}"
        severity = CRITICAL if sig in (SIGSEGV, SIGABRT, SIGBUS) else WARNING
    box = black_box(ctx, t.pid)
    evidence.update(box)
    trail = describe_trail(box)
    # the workers it left alive at its death: remembered, they exit within seconds of it
    state = ctx.state(ProcessState)
    orphans = state.trainer_orphans.get((t.pid, t.start_time))
    if orphans is None:
        orphans = sorted(
            p.pid for p in s.processes if p.pid != t.pid and p.state not in DEAD_STATES and p.role == "worker"
        )
        state.keep_orphans((t.pid, t.start_time), orphans)
    if trail is not None:
        message += f"; {trail}"
    if orphans:
        n = len(orphans)
        message += (
            f"; its worker (pid {orphans[0]}) was orphaned"
            if n == 1
            else f"; its {n} workers (pids {pid_list(orphans)}) were orphaned"
        )
        evidence["orphans"] = ",".join(str(p) for p in orphans)
    return [
        Candidate(
            TRAINER_DIED,
            f"trainer:{t.pid}",
            severity,
            label,
            message + ".",
            "Lower the job's memory (batch size, num_workers, cached data) or raise the limit."
            if evidence.get("cause") == "oom_killer"
            else "Find who sent the signal (a supervisor, a timeout, a user) and read the log.",
            evidence,
        )
    ]


def detect_worker_died(ctx: Context) -> list[Candidate]:
    s = ctx.latest
    out: list[Candidate] = []
    recent = [(d, death_time(ctx, d)) for d in s.worker_deaths]
    recent = [(d, when) for d, when in recent if when >= s.time - ctx.numbers(ProcessNumbers).death_window_s]
    if recent:
        room = headroom(s)
        for death, when in recent:
            candidate = _death_candidate(ctx, death, when, room)
            if candidate is not None:
                out.append(candidate)
    out.extend(_vanished(ctx))
    reported = {d.pid for d in s.worker_deaths}
    out.extend(_killed_without_agent(ctx, reported))
    out.extend(_vanished_without_agent(ctx, reported))
    return out


# -- leaked_workers --------------------------------------------------------------------------


def _generations(workers: list[ProcessSample], gap_ticks: float) -> list[list[ProcessSample]]:
    gens: list[list[ProcessSample]] = []
    for w in sorted(workers, key=lambda p: p.start_time):
        if gens and w.start_time - gens[-1][-1].start_time <= gap_ticks:
            gens[-1].append(w)
        else:
            gens.append([w])
    return gens


def detect_leaked_workers(ctx: Context) -> list[Candidate]:
    cfg = ctx.numbers(ProcessNumbers)
    s = ctx.latest
    workers = ctx.tree().workers()
    if len(workers) < 2:
        return []
    listed = {pid for loader in s.loaders if loader.alive for pid in loader.worker_pids}
    gens = _generations(workers, cfg.generation_gap_s * cfg.clock_ticks_per_s)
    if listed:
        stray = [w for w in workers if w.pid not in listed]
        if not stray:
            return []
        how = f"{len(stray)} of them are in no DataLoader's worker list"
    else:
        if len(gens) < cfg.leak_generations:
            return []
        stray = [w for g in gens[:-1] for w in g]
        how = "only the newest generation should be running"
    newest = max(w.start_time for w in workers)
    ages = [
        (newest - g[0].start_time) / cfg.clock_ticks_per_s for g in gens
    ]  # seconds before the newest start
    rss = sum_known(w.rss_bytes for w in stray)
    uss = sum_known(w.uss_bytes for w in stray)
    return [
        Candidate(
            LEAKED_WORKERS,
            "job",
            WARNING,
            f"workers of pid {s.target.pid}",
            f"{len(workers)} DataLoader workers from {len(gens)} generations are alive (started "
            f"{', '.join(duration(a) for a in ages)} before the newest), {how}; the extra ones hold "
            f"{size(rss)} RSS.",
            "Old workers exit when their iterator is deleted: something keeps old iterators alive "
            "(a stored iter(loader), an exception's traceback, a generator left open); break the "
            "reference, or use persistent_workers=True so each epoch reuses the same workers.",
            {
                "workers": len(workers),
                "generations": len(gens),
                "stray": len(stray),
                "stray_pids": ",".join(str(w.pid) for w in stray[:32]),
                "stray_rss_bytes": rss,
                "stray_uss_bytes": uss,
                "listed_by_agent": len(listed),
            },
        )
    ]


def live_workers(s: Snapshot) -> list[ProcessSample]:
    return [p for p in s.processes if p.role == "worker" and p.state not in DEAD_STATES]
