"""Second reading of issue 9's verdict side: causes and stalls that must not be claimed.

Synthetic histories (tests/support/snapshots.py) through the real Analyzer; each test failed on the
code as merged at 808609c.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dlmon.analysis import Analyzer
from dlmon.analysis.detectors.memory import MemoryState
from dlmon.model import Alert, CgroupMemory, LoaderSample, ProcessSample, Snapshot, WorkerDeath
from dlmon.model.snapshot import KernelEvent, ProcessStack, StackFrame
from support.snapshots import MAIN_PID, MIB, T0, loader, proc, snap


def analyze(history: Sequence[Snapshot]) -> list[Snapshot]:
    a = Analyzer(cores=2, strict=True)
    return [a(s) for s in history]


def of_kind(s: Snapshot, kind: str) -> list[Alert]:
    return [a for a in s.alerts if a.kind == kind]


# -- stall: a trainer busy with another of its loaders is not stuck outside the loader --------


def test_a_val_loader_left_alive_is_no_trainer_stall_while_training_waits_on_the_train_loader() -> None:
    """An input-bound training (the trainer sleeps inside the train loader's __next__) with the
    validation DataLoader object alive between validations: the val loader delivers nothing for
    the whole epoch, yet the trainer is not 'asleep outside the loader'."""
    workers = [proc(MAIN_PID + 1 + i, worker_id=i, cpu=90.0) for i in range(2)]
    history = []
    train_total, val_total = 0, 0
    for k in range(240):
        validating = k < 30
        val_total += 5 if validating else 0
        train_total += 0 if validating else 2
        train = dataclasses.replace(
            loader(id="T", name="train.py:40", worker_pids=[p.pid for p in workers]),
            batches_total=train_total,
            batches_per_s=0.0 if validating else 2.0,
            in_call_s=0.0 if validating else 0.3,  # input-bound: mostly waiting for the next batch
            batches_per_worker=(train_total // 2, train_total - train_total // 2),
        )
        val = dataclasses.replace(
            loader(id="V", name="train.py:41", persistent_workers=False, num_workers=0),
            batches_total=val_total,
            batches_per_s=5.0 if validating else 0.0,
            in_call_s=0.0,
        )
        main = proc(MAIN_PID, "main", uss=300 * MIB, pss=350 * MIB, cpu=1.0)  # asleep in train's __next__
        history.append(snap(k, [main, *workers], loaders=[train, val]))
    outs = analyze(history)
    stalls = [a.message for s in outs for a in of_kind(s, "stall")]
    assert not stalls, stalls[0]


def test_a_trainer_asleep_outside_every_loader_is_still_a_stall() -> None:
    """The guard above must not hide the real thing: no loader moves, none is in a call."""
    history = []
    total = 0
    for k in range(200):
        moving = k < 30
        total += 2 if moving else 0
        train = dataclasses.replace(
            loader(id="T"),
            batches_total=total,
            batches_per_s=2.0 if moving else 0.0,
            in_call_s=0.0,
        )
        main = proc(MAIN_PID, "main", uss=300 * MIB, pss=350 * MIB, cpu=50.0 if moving else 0.5)
        history.append(snap(k, [main], loaders=[train]))
    outs = analyze(history)
    assert of_kind(outs[-1], "stall"), "a trainer asleep outside its loader for minutes must be a stall"


def test_a_long_trainer_stall_counts_from_the_last_batch_and_turns_critical() -> None:
    """The stall's age came from the recent window only: it stopped at "about 2 min" however long
    the trainer hung, and never reached critical (5 min)."""
    history = []
    total = 0
    for k in range(450):
        moving = k < 30
        total += 2 if moving else 0
        train = dataclasses.replace(
            loader(id="T"),
            batches_total=total,
            batches_per_s=2.0 if moving else 0.0,
            in_call_s=0.0,
        )
        main = proc(MAIN_PID, "main", uss=300 * MIB, pss=350 * MIB, cpu=50.0 if moving else 0.5)
        history.append(snap(k, [main], loaders=[train]))
    outs = analyze(history)
    [stall] = of_kind(outs[-1], "stall")
    assert stall.severity == "critical", stall.message
    stalled = stall.evidence["stalled_s"]
    assert isinstance(stalled, float) and 415 <= stalled <= 425, stall.message  # 449 - 29 s
    assert "for 7.0 min (usually one every 0.5 s)" in stall.message, stall.message


def _hung_trainer(k: int, total: int, moving: bool) -> tuple[ProcessSample, LoaderSample]:
    train = dataclasses.replace(
        loader(id="T"), batches_total=total, batches_per_s=2.0 if moving else 0.0, in_call_s=0.0
    )
    return proc(MAIN_PID, "main", uss=300 * MIB, pss=350 * MIB, cpu=50.0 if moving else 0.5), train


def test_a_trainer_stall_outlives_the_analysis_cache() -> None:
    """A trainer whose memory grew for 10 min (32 workers, a memory_growth alert: its attribution
    fills the digest's cache within minutes), then hung asleep for 7 min. The loader's usual pace
    was kept in that cache: when it was cleared mid-stall the pace was gone, and with it the stall
    (seen at 743 s: no alert for the rest of the hang)."""
    n, run = 32, 600
    pids = [MAIN_PID + 1 + i for i in range(n)]
    history = []
    total = 0
    for k in range(run + 450):
        moving = k < run
        total += 2 if moving else 0
        grown = 200 * MIB * min(k, run) / 60
        main = proc(
            MAIN_PID,
            "main",
            uss=300 * MIB + grown,
            pss=350 * MIB + grown,
            rss=400 * MIB + grown,
            cpu=50.0 if moving else 0.5,
        )
        per_worker = 40 * MIB * min(k, run) / 60
        workers = [
            proc(
                pid,
                worker_id=i,
                uss=100 * MIB + per_worker,
                pss=150 * MIB + per_worker,
                cpu=20.0 if moving else 0.0,
            )
            for i, pid in enumerate(pids)
        ]
        train = dataclasses.replace(
            loader(id="T", num_workers=n, worker_pids=pids),
            batches_total=total,
            batches_per_s=2.0 if moving else 0.0,
            in_call_s=0.0,
        )
        history.append(snap(k, [main, *workers], loaders=[train]))
    analyzer = Analyzer(cores=2, strict=True)
    outs, cached = [], []
    for s in history:
        outs.append(analyzer(s))
        cached.append(len(analyzer.states.of(MemoryState)))
    cleared = [k for k in range(run + 60, len(cached)) if cached[k] < cached[k - 1]]
    assert cleared, "the premise: the cache is cleared during the hang (after the stall is raised)"
    ticks = [k for k, s in enumerate(outs) if of_kind(s, "stall")]
    assert ticks and ticks[-1] == len(outs) - 1, "the stall must last as long as the hang"
    assert ticks == list(range(ticks[0], len(outs))), "the stall must not drop out mid-hang"
    [stall] = of_kind(outs[-1], "stall")
    assert stall.severity == "critical" and "(usually one every 0.5 s)" in stall.message, stall.message


def test_new_loaders_elsewhere_in_the_job_do_not_restart_a_long_stall() -> None:
    """The trainer hung for 7 min while another process of the job (an evaluator) builds a new
    DataLoader every 5 s. The progress of loaders was cleared at 64 loaders: the hang's age fell
    back to the recent window ("2.0 min") and critical back to warning."""
    other = MAIN_PID + 500
    history = []
    total = 0
    for k in range(450):
        moving = k < 30
        total += 2 if moving else 0
        main, train = _hung_trainer(k, total, moving)
        evaluator = proc(other, "child", uss=200 * MIB, pss=200 * MIB, cpu=80.0)
        eval_loader = dataclasses.replace(
            loader(id=f"{other}:{k // 5}", pid=other, num_workers=0), batches_total=k % 5 + 1, in_call_s=0.0
        )
        history.append(snap(k, [main, evaluator], loaders=[train, eval_loader]))
    outs = analyze(history)
    [stall] = of_kind(outs[-1], "stall")
    stalled = stall.evidence["stalled_s"]
    assert isinstance(stalled, float) and 415 <= stalled <= 425, stall.message  # 449 - 29 s
    assert stall.severity == "critical", stall.message


def test_a_stuck_worker_keeps_its_age_when_the_analysis_cache_is_cleared() -> None:
    """Worker 1 finished nothing for 7 min while worker 0 delivered (out-of-order delivery),
    asleep in a lock. Its last batch time was kept in the digest's cache, which is cleared when
    full (any tick, in a big job): each clear restarted its age, so it never turned critical and
    the alert dropped out for 30 s at each clear. Here the cache is emptied every 100 s."""
    pids = [MAIN_PID + 1, MAIN_PID + 2]
    hang = ProcessStack(
        pid=pids[1],
        role="worker",
        worker_id=1,
        time=T0,
        thread=None,
        frames=(
            StackFrame("torch/utils/data/_utils/worker.py", 300, "_worker_loop"),
            StackFrame("/job/dataset.py", 88, "__getitem__"),
            StackFrame("/usr/lib/python3/threading.py", 320, "acquire"),
        ),
        state="S",
    )
    analyzer = Analyzer(cores=2, strict=True)
    delivered = 0
    for k in range(480):
        delivered += 2
        workers = [
            proc(pids[0], worker_id=0, cpu=90.0),
            proc(pids[1], worker_id=1, cpu=0.0 if k >= 30 else 90.0),
        ]
        train = dataclasses.replace(
            loader(id="T", num_workers=2, worker_pids=pids),
            batches_total=delivered,
            batches_per_s=2.0,
            in_call_s=0.1,
            batches_per_worker=(delivered - min(k, 30), min(k, 30)),
        )
        s = snap(k, [proc(MAIN_PID, "main", cpu=50.0), *workers], loaders=[train])
        if k >= 60:
            s = dataclasses.replace(s, stacks=(dataclasses.replace(hang, time=T0 + k),))
        if k % 100 == 99:
            analyzer.states.of(MemoryState).clear()  # what a full cache does
        out = analyzer(s)
    [stall] = of_kind(out, "stall")
    assert stall.evidence["where"] == "worker", stall.message
    stalled = stall.evidence["stalled_s"]
    assert isinstance(stalled, float) and stalled >= 440, stall.message  # since ~30 s
    assert stall.severity == "critical" and stall.since <= T0 + 90, stall.message


# -- fd_exhaustion: a step up then flat is not a leak -----------------------------------------


def test_fds_that_step_up_once_then_stay_flat_are_no_exhaustion() -> None:
    """Workers starting (pipes, queues, shared-tensor fds) add ~100 fds to the trainer in a few
    seconds; then the count stays flat. That is no 'out of them in about 2 min'."""
    history = []
    for k in range(120):
        fds = 40 if k < 5 else 160
        main = dataclasses.replace(
            proc(MAIN_PID, "main", uss=300 * MIB, pss=350 * MIB), num_fds=fds, fd_limit=1024
        )
        history.append(snap(k, [main]))
    outs = analyze(history)
    assert not any(of_kind(s, "fd_exhaustion") for s in outs), next(
        a.message for s in outs for a in of_kind(s, "fd_exhaustion")
    )


def test_fds_that_keep_rising_are_still_named() -> None:
    history = []
    for k in range(120):
        main = dataclasses.replace(
            proc(MAIN_PID, "main", uss=300 * MIB, pss=350 * MIB), num_fds=40 + 3 * k, fd_limit=1024
        )
        history.append(snap(k, [main]))
    outs = analyze(history)
    assert of_kind(outs[-1], "fd_exhaustion")


# -- worker_died: an OOM count rise is one kill, for one process ------------------------------


def _two_sigkills(*, kernel: bool, cgroup_oom_after: int, machine_oom_after: int) -> Snapshot:
    """Workers 0 and 1 SIGKILLed 2 s apart at t=20/22; the counters rise once in between."""
    w0, w1 = MAIN_PID + 1, MAIN_PID + 2
    history = []
    for k in range(40):
        dead0, dead1 = k >= 20, k >= 22
        procs = [proc(MAIN_PID + 3, worker_id=2)]
        if not dead0:
            procs.append(proc(w0, worker_id=0))
        if not dead1:
            procs.append(proc(w1, worker_id=1))
        deaths = []
        if dead0:
            deaths.append(WorkerDeath(w0, 0, "T", 9, None, T0 + 20, "SIGKILL", MAIN_PID, source="agent"))
        if dead1:
            deaths.append(WorkerDeath(w1, 1, "T", 9, None, T0 + 22, "SIGKILL", MAIN_PID, source="agent"))
        s = snap(
            k,
            procs,
            deaths=deaths,
            cgroup_limit=4096 * MIB,
            cgroup_current=2048 * MIB,
            cgroup_oom=cgroup_oom_after if k >= 21 else 0,
            oom=machine_oom_after if k >= 21 else 0,
        )
        assert s.cgroup is not None
        s = dataclasses.replace(s, cgroup=dataclasses.replace(s.cgroup, usage_path=s.cgroup.path))
        if kernel and k >= 21:
            event = KernelEvent("oom_kill", w1, "python", T0 + 21.5, "cgroup", line="Killed process")
            s = dataclasses.replace(s, kernel_events=(event,))
        history.append(s)
    return analyze(history)[-1]


def _cause_of(s: Snapshot, pid: int) -> str | None:
    for a in of_kind(s, "worker_died"):
        if a.evidence.get("pid") == pid:
            cause = a.evidence.get("cause")
            return str(cause) if cause is not None else None
    return None


def test_the_kernel_log_gives_the_one_oom_kill_to_the_other_worker() -> None:
    last = _two_sigkills(kernel=True, cgroup_oom_after=1, machine_oom_after=1)
    assert _cause_of(last, MAIN_PID + 2) == "oom_killer"
    assert _cause_of(last, MAIN_PID + 1) == "sigkill"  # the user's kill -9, not the OOM killer


def test_one_oom_kill_for_two_sigkills_is_not_given_to_both() -> None:
    last = _two_sigkills(kernel=False, cgroup_oom_after=1, machine_oom_after=1)
    causes = {_cause_of(last, MAIN_PID + 1), _cause_of(last, MAIN_PID + 2)}
    assert causes == {"sigkill_unknown"}, causes
    message = next(a.message for a in of_kind(last, "worker_died") if a.evidence.get("pid") == MAIN_PID + 1)
    assert "rose by 1" in message and "2" in message


def test_an_oom_kill_elsewhere_on_the_machine_is_not_the_jobs() -> None:
    """The job's own memory cgroup counts every OOM kill of its processes (v1 oom_control, v2
    memory.events: any kind of OOM killer); when it did not move, a machine-wide count that did
    was some other process's kill."""
    last = _two_sigkills(kernel=False, cgroup_oom_after=0, machine_oom_after=1)
    assert _cause_of(last, MAIN_PID + 1) == "sigkill"
    assert _cause_of(last, MAIN_PID + 2) == "sigkill"


def test_a_machine_count_is_still_used_when_the_cgroup_counter_is_not_the_jobs_own() -> None:
    """v1 counts a kill only in the victim's own memcg: an ancestor's counter (the one holding the
    limit) does not move, so the machine counter is the witness there."""
    w0 = MAIN_PID + 1
    history = []
    for k in range(30):
        procs = [proc(w0, worker_id=0)] if k < 20 else []
        deaths = [WorkerDeath(w0, 0, "T", 9, None, T0 + 20, "SIGKILL", MAIN_PID)] if k >= 20 else []
        s = snap(k, procs, deaths=deaths, cgroup_limit=4096 * MIB, cgroup_current=2048 * MIB, cgroup_oom=0)
        s = dataclasses.replace(
            s,
            cgroup=CgroupMemory(1, "/job/a", 4096 * MIB, 2048 * MIB, 0, usage_path="/job"),
            memory=dataclasses.replace(s.memory, oom_kill_count=1 if k >= 21 else 0),
        )
        history.append(s)
    assert _cause_of(analyze(history)[-1], w0) == "oom_killer"


# -- the exit verdict keeps what the job was doing when it ended ------------------------------


def _ended(s: Snapshot, code: int) -> Snapshot:
    return dataclasses.replace(
        s, target=dataclasses.replace(s.target, alive=False, exit_code=code), processes=(), loaders=()
    )


def _trainer_asleep_after_30_s() -> list[Snapshot]:
    """200 s of a trainer that delivered 2 batches/s for 30 s, then sleeps outside its loader."""
    history = []
    total = 0
    for k in range(200):
        moving = k < 30
        total += 2 if moving else 0
        train = dataclasses.replace(
            loader(id="T"), batches_total=total, batches_per_s=2.0 if moving else 0.0, in_call_s=0.0
        )
        main = proc(MAIN_PID, "main", uss=300 * MIB, pss=350 * MIB, cpu=50.0 if moving else 0.5)
        history.append(snap(k, [main], loaders=[train]))
    return history


def test_a_stall_the_user_ended_with_ctrl_c_is_in_the_exit_verdict() -> None:
    from dlmon.analysis.verdict import exit_verdict

    history = _trainer_asleep_after_30_s()
    history.append(_ended(snap(200), 130))
    last = analyze(history)[-1]
    assert of_kind(last, "stall")
    verdict = exit_verdict(last, 130)
    assert verdict is not None and "asleep outside the loader" in verdict, verdict


def test_fds_run_out_is_in_the_exit_verdict() -> None:
    from dlmon.analysis.verdict import exit_verdict

    history = []
    for k in range(120):
        main = dataclasses.replace(
            proc(MAIN_PID, "main", uss=300 * MIB, pss=350 * MIB), num_fds=40 + 8 * k, fd_limit=1024
        )
        history.append(snap(k, [main]))
    history.append(_ended(snap(120), 1))
    verdict = exit_verdict(analyze(history)[-1], 1)
    assert verdict is not None and "file descriptors" in verdict, verdict


def test_a_stall_still_in_the_verdict_when_the_interrupted_training_takes_seconds_to_exit() -> None:
    """Ctrl-C on a hung job: the trainer leaves the loader at once (the stall's condition is gone)
    but takes seconds to exit (torch waits 5 s for a hung worker; more under load). With a 3 s
    clear hold the stall was forgotten before the exit and the verdict said only 'ended by
    SIGINT' (a real run of tests/integration/deaths/test_real_trainings.py, on a loaded machine)."""
    from dlmon.analysis.verdict import exit_verdict

    history = _trainer_asleep_after_30_s()
    for k in range(200, 208):  # shutting down: the loader is gone, the trainer not yet
        history.append(snap(k, [proc(MAIN_PID, "main", uss=300 * MIB, pss=350 * MIB, cpu=20.0)]))
    history.append(_ended(snap(208), 130))
    analyzed = analyze(history)
    assert of_kind(analyzed[199], "stall")
    verdict = exit_verdict(analyzed[-1], 130)
    assert verdict is not None and "asleep outside the loader" in verdict, verdict


def test_a_stall_that_resolved_is_not_the_verdict_of_a_clean_exit_seconds_later() -> None:
    """A 30 s hang (an NFS hiccup), then batches flow again and the job ends cleanly 10 s later.
    With STALL's 15 s clear hold (kept for a hang cut short by Ctrl-C) the resolved stall stayed on
    screen ("no batch for 30 s" while batches flowed) and 'training exited 0' blamed it."""
    from dlmon.analysis.verdict import exit_verdict

    history = []
    total = 0
    for k in range(70):
        moving = k < 30 or k >= 60
        total += 2 if moving else 0
        train = dataclasses.replace(
            loader(id="T"),
            batches_total=total,
            batches_per_s=2.0 if moving else 0.0,
            in_call_s=0.0 if moving else float(k - 29),
        )
        main = proc(MAIN_PID, "main", uss=300 * MIB, pss=350 * MIB, cpu=50.0)
        history.append(snap(k, [main], loaders=[train]))
    history.append(_ended(snap(70), 0))
    analyzed = analyze(history)
    assert of_kind(analyzed[55], "stall"), "the premise: the hang is a stall"
    assert not of_kind(analyzed[66], "stall"), "batches flow again: the stall is over"
    assert exit_verdict(analyzed[-1], 0) is None


def test_the_exception_leads_the_verdict_and_fd_exhaustion_follows_it() -> None:
    """Both at the end: the exception is what the training died of and the line the user finds in
    the log (it carries the fd figures itself); fd_exhaustion, the condition before it, comes second."""
    from dlmon.analysis.verdict import exit_verdict
    from dlmon.model import Alert

    fds = Alert(
        "fd_exhaustion", "critical", "trainer", "The trainer has 1020 of 1024 file descriptors open.", "", T0
    )
    died = Alert(
        "exception_death",
        "critical",
        "trainer",
        "The trainer (pid 1) raised OSError: [Errno 24] Too many open files — the trainer had 1023 "
        "files open.",
        "",
        T0 + 5,
        {"time": T0 + 5},
    )
    last = dataclasses.replace(_ended(snap(120), 1), alerts=(fds, died))
    verdict = exit_verdict(last, 1)
    lead = "training exited 1: the trainer (pid 1) raised OSError"
    assert verdict is not None and verdict.startswith(lead), verdict
    assert "Also: the trainer has 1020 of 1024 file descriptors open." in verdict, verdict
