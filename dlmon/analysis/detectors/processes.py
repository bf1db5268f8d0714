"""The workers' lives: zombie_worker, orphan_worker, worker_died, leaked_workers."""

from __future__ import annotations

from dlmon.analysis.detectors._base import (
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
from dlmon.analysis.digest import DEAD, process_label
from dlmon.analysis.kinds import (
    CRITICAL,
    INFO,
    LEAKED_WORKERS,
    ORPHAN_WORKER,
    WARNING,
    WORKER_DIED,
    ZOMBIE_WORKER,
)
from dlmon.model import ProcessSample, Snapshot, WorkerDeath

SIGNAL_NAMES = {
    1: "SIGHUP",
    2: "SIGINT",
    6: "SIGABRT",
    7: "SIGBUS",
    9: "SIGKILL",
    11: "SIGSEGV",
    13: "SIGPIPE",
    15: "SIGTERM",
}
SIGBUS = 7
SIGKILL = 9
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
    slack = ctx.config.oom_slack_s
    digest = ctx.digest
    if not digest.oom or digest.oom[0].time > when:
        return None, None  # we were not watching before it died
    before = digest.oom_at(when - slack) or digest.oom[0]
    after = digest.oom_at(when + slack)
    if after is None:
        return None, None
    if before.cgroup is not None and after.cgroup is not None and after.cgroup > before.cgroup:
        return after.cgroup - before.cgroup, "cgroup"
    if before.machine is not None and after.machine is not None:
        if after.machine > before.machine:
            return after.machine - before.machine, "machine"
        return 0, "machine"
    if before.cgroup is not None and after.cgroup is not None:
        return 0, "cgroup"
    return None, None


def _death_candidate(
    ctx: Context, death: WorkerDeath, when: float, room: Headroom | None
) -> Candidate | None:
    s = ctx.latest
    label = process_label("worker", death.pid, death.worker_id)
    sig = death.signal
    name = death.signal_name or (SIGNAL_NAMES.get(sig, f"signal {sig}") if sig is not None else None)
    evidence: dict[str, float | int | str | None] = {
        "pid": death.pid,
        "worker_id": death.worker_id,
        "loader_id": death.loader_id,
        "signal": sig,
        "exit_code": death.exit_code,
        "time": when,
    }
    memory_advice = "Lower num_workers or batch_size, or fix the growth (see memory_growth)"
    if room is not None:
        memory_advice += f"; now {describe_headroom(room)}"
    if sig == SIGKILL:
        kills, counter = _oom_increase(ctx, when)
        evidence["oom_kills"] = kills
        evidence["oom_counter"] = counter
        if kills:
            cause, severity = "oom_killer", CRITICAL
            message = (
                f"DataLoader {label} was killed by the OOM killer (SIGKILL, and the {counter} "
                f"OOM-kill count rose by {kills})."
            )
            advice = memory_advice + "; copy-on-read of a Python-object Dataset is the usual cause."
        elif kills == 0:
            cause, severity = "sigkill", WARNING
            message = (
                f"DataLoader {label} was killed by SIGKILL, not by the OOM killer (no OOM kill was "
                f"counted by the {counter})."
            )
            advice = "Something sent kill -9: a supervisor, a timeout, a user; check who."
        else:
            cause, severity = "sigkill_unknown", CRITICAL
            message = (
                f"DataLoader {label} was killed by SIGKILL, most often the OOM killer "
                "(the OOM counters before its death are unknown)."
            )
            advice = "Check dmesg for 'Out of memory: Killed process'. " + memory_advice + "."
    elif sig == SIGBUS:
        cause, severity = "shm_exhausted", CRITICAL
        shm = s.shm
        free = "" if shm is None else f" ({size(shm.available_bytes)} free of {size(shm.total_bytes)} now)"
        message = f"DataLoader {label} died of SIGBUS (Bus error): shared memory /dev/shm ran out{free}."
        advice = (
            "Give /dev/shm more room (docker run --shm-size=8g, or a bigger tmpfs), or lower "
            "num_workers, prefetch_factor or the batch size."
        )
        if shm is not None:
            evidence["shm_available_bytes"] = shm.available_bytes
            evidence["shm_total_bytes"] = shm.total_bytes
    elif sig in (SIGSEGV, SIGABRT):
        cause, severity = "crash", CRITICAL
        message = f"DataLoader {label} crashed ({name}): a native library failed inside the worker."
        advice = (
            "Usual suspects are image/video libraries with their own threads (OpenCV: "
            "cv2.setNumThreads(0) in worker_init_fn) or a library not safe after fork; try "
            "multiprocessing_context='spawn' or 'forkserver'."
        )
    elif sig is not None:
        cause, severity = "signal", WARNING
        message = f"DataLoader {label} was ended by {name}."
        advice = "Something signalled the worker; check the job's supervisor and the log."
    elif death.exit_code not in (None, 0):
        cause, severity = "exit_code", WARNING
        message = f"DataLoader {label} exited with code {death.exit_code}."
        advice = "Read the worker's traceback in the training log: the Dataset raised."
    else:
        return None
    evidence["cause"] = cause
    return Candidate(
        WORKER_DIED, f"death:{death.pid}:{round(when)}", severity, label, message, advice, evidence
    )


def _vanished(ctx: Context) -> list[Candidate]:
    """Worker pids a loader still lists that left the tree (dead and reaped, or never seen die)."""
    s = ctx.latest
    if not s.loaders:
        return []
    cfg = ctx.config
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
    names = {loader.id: loader.name for loader in s.loaders}
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


def detect_worker_died(ctx: Context) -> list[Candidate]:
    s = ctx.latest
    out: list[Candidate] = []
    recent = [(d, death_time(ctx, d)) for d in s.worker_deaths]
    recent = [(d, when) for d, when in recent if when >= s.time - ctx.config.death_window_s]
    if recent:
        room = headroom(s)
        for death, when in recent:
            candidate = _death_candidate(ctx, death, when, room)
            if candidate is not None:
                out.append(candidate)
    out.extend(_vanished(ctx))
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
    cfg = ctx.config
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
    return [p for p in s.processes if p.role == "worker" and p.state not in DEAD]
