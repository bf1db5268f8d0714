"""Second reading of issue 9's verdict side: causes and stalls that must not be claimed.

Synthetic histories (tests/scenarios/synth.py) through the real Analyzer; each test failed on the
code as merged at 808609c.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dlmon.analysis import Analyzer
from dlmon.model import Alert, CgroupMemory, Snapshot, WorkerDeath
from dlmon.model.snapshot import KernelEvent
from tests.scenarios.synth import MAIN_PID, MIB, T0, loader, proc, snap


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


def test_a_stall_the_user_ended_with_ctrl_c_is_in_the_exit_verdict() -> None:
    from dlmon.analysis.verdict import exit_verdict

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
