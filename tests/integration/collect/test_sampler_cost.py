"""What the sampler reads each tick, and that cutting it loses nothing: real processes throughout
(issue 14: the cost promise; issue 15: PSS order, pid reuse, orphans, swap, the fd limit)."""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Spawn
from dlmon.collect.processes import Cadence, ProcessTracker
from dlmon.collect.procfs import ProcessGone, ProcHandle, StatFields
from dlmon.collect.smaps_budget import BudgetPolicy, SmapsBudget
from dlmon.model import ProcessSample

MiB = 1024 * 1024

TRAINER_WITH_SMALL_CHILDREN = """
    import os, sys, time
    big = bytearray(96 * 1024 * 1024)
    for i in range(0, len(big), 4096):
        big[i] = 1
    for _ in range(3):
        if os.fork() == 0:
            small = bytearray(4 * 1024 * 1024)   # children are small: mostly unshared
            big = None
            time.sleep(120)
            os._exit(0)
    print("READY", flush=True)
    time.sleep(120)
"""


def test_the_trainer_pss_is_read_first_when_the_budget_allows_one_read(spawn: Spawn) -> None:
    """Issue 15: never-read processes were read smallest first, the trainer last."""
    proc = spawn(TRAINER_WITH_SMALL_CHILDREN)
    tracker = ProcessTracker(proc.pid, SmapsBudget(BudgetPolicy(initial_s=1e-9)))
    samples = tracker.sample()
    assert len(samples) == 4
    assert [pid for pid, _ in tracker.smaps_reads_last_tick] == [proc.pid]
    main = samples[0]
    assert main.role == "main" and main.pss_bytes is not None and main.pss_age_s == 0.0


def test_steady_ticks_read_children_only_from_forking_threads_and_skip_fd_listings(
    spawn: Spawn,
) -> None:
    """Issue 14: every thread of every process listed and every fd directory read every tick."""
    proc = spawn(
        """
        import os, sys, time, threading, ctypes
        for _ in range(3):
            threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
        r, w = os.pipe()
        for _ in range(2):
            if os.fork() == 0:
                ctypes.CDLL(None).prctl(15, b"pt_data_worker", 0, 0, 0)
                os.write(w, b"x")
                time.sleep(120); os._exit(0)
        os.read(r, 1); os.read(r, 1)
        print("READY", flush=True)
        sys.stdin.readline()
        held = [os.open("/dev/null", os.O_RDONLY) for _ in range(600)]
        print("OPENED", flush=True)
        time.sleep(120)
        """
    )
    assert proc.stdin is not None and proc.stdout is not None
    tracker = ProcessTracker(proc.pid)
    first = tracker.sample()
    assert [s.role for s in first] == ["main", "worker", "worker"]
    assert {pid for pid, _ in tracker.children_reads_last_tick} == {s.pid for s in first}
    steady = tracker.sample()
    assert [s.pid for s in steady] == [s.pid for s in first]
    assert tracker.children_reads_last_tick == [(proc.pid, [proc.pid])]  # the forking thread only
    assert tracker.fd_counts_last_tick == []
    assert all(s.num_fds is not None for s in steady)  # the last count is still shown
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "OPENED"
    after = tracker.sample()
    assert tracker.fd_counts_last_tick == [proc.pid]  # FDSize grew: recounted at once
    assert after[0].num_fds is not None and after[0].num_fds >= 600


def test_epoch_respawned_dataloader_workers_are_all_found(spawn: Spawn, tmp_path: object) -> None:
    """Non-persistent workers, new ones each epoch, each living ~1.5 s: every one is seen."""
    pytest.importorskip("torch")
    pid_file = f"{tmp_path}/workers"
    proc = spawn(
        f"""
        import os, time, torch
        from torch.utils.data import DataLoader, Dataset

        class Slow(Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                time.sleep(0.3)
                return torch.zeros(4)

        def note(_):
            with open({pid_file!r}, "a") as fh:
                fh.write(f"{{os.getpid()}}\\n")

        print("READY", flush=True)
        loader = DataLoader(Slow(), batch_size=2, num_workers=2, worker_init_fn=note)
        for epoch in range(4):
            for batch in loader:
                pass
            time.sleep(0.3)
        print("DONE", flush=True)
        time.sleep(120)
        """
    )
    assert proc.stdout is not None
    tracker = ProcessTracker(proc.pid)
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    done = False
    while not done and time.monotonic() < deadline:
        seen |= {s.pid for s in tracker.sample()}
        done = "DONE" in _ready_line(proc.stdout)
        time.sleep(0.25)
    with open(pid_file) as fh:
        workers = {int(line) for line in fh}
    assert done and len(workers) == 8
    assert workers <= seen


def _ready_line(stream: object) -> str:
    import select

    ready, _, _ = select.select([stream], [], [], 0)
    return stream.readline() if ready else ""  # type: ignore[attr-defined]


def test_a_dead_handle_never_lists_the_children_or_fds_of_a_process_that_reused_its_pid(
    spawn: Spawn,
) -> None:
    """Issue 15: children() and count_fds() opened by pid path, so a pid reused within a tick
    pulled a stranger's children into the tree."""
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("needs root to steer pid allocation through ns_last_pid")
    proc = spawn(
        """
        import subprocess, sys, time
        victim = subprocess.Popen(["sleep", "120"])
        print("READY", flush=True)
        print(victim.pid, flush=True)
        sys.stdin.readline()
        victim.kill(); victim.wait()
        time.sleep(0.05)  # start times count 10 ms clock ticks: a later tick than the victim's
        for attempt in range(50):
            with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
                fh.write(str(victim.pid - 1))
            new = subprocess.Popen(["sh", "-c", "sleep 120 & sleep 120 & wait"])
            if new.pid == victim.pid:
                break
            new.kill(); new.wait()
        print("REUSED" if new.pid == victim.pid else "MISSED", flush=True)
        sys.stdin.readline()
        """
    )
    assert proc.stdin is not None and proc.stdout is not None
    victim = int(proc.stdout.readline())
    handle = ProcHandle(victim)
    by_path = ProcHandle(victim, hold_fds=False)  # as past the fd cap
    assert handle.children() == [] and by_path.children() == []
    proc.stdin.write("\n")
    proc.stdin.flush()
    if proc.stdout.readline().strip() != "REUSED":
        pytest.skip("another process took the pid first")
    deadline = time.monotonic() + 30
    while len(ProcHandle(victim).children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the stranger's shell forks its two sleeps
    assert len(ProcHandle(victim).children()) == 2  # the stranger really has children
    with pytest.raises(ProcessGone):
        handle.children()
    with pytest.raises(ProcessGone):
        handle.count_fds()
    for read in (by_path.stat, by_path.children, by_path.count_fds, lambda: by_path.read("status")):
        with pytest.raises(ProcessGone):
            read()


def test_an_orphan_survives_a_transient_stat_error(spawn: Spawn, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 15: one transient error reading an orphan's stat dropped it; reparented away from
    the tree, it was never found again."""
    proc = spawn(
        """
        import os, time
        if os.fork() == 0:
            time.sleep(120); os._exit(0)
        print("READY", flush=True)
        time.sleep(120)
        """
    )
    tracker = ProcessTracker(proc.pid, SmapsBudget(unlimited=True))
    child = next(s.pid for s in tracker.sample() if s.pid != proc.pid)
    proc.kill()
    proc.wait()
    real_stat = ProcHandle.stat_unless  # the tracker's every-tick read
    failures = [child]

    def flaky_stat(self: ProcHandle, previous: tuple[bytes, StatFields] | None) -> tuple[bytes, StatFields]:
        if failures and self.pid == failures[0]:
            failures.pop()
            raise OSError(errno.EIO, "transient")
        return real_stat(self, previous)

    monkeypatch.setattr(ProcHandle, "stat_unless", flaky_stat)
    assert child not in {s.pid for s in tracker.sample()}  # no row this tick, but still tracked
    monkeypatch.setattr(ProcHandle, "stat_unless", real_stat)
    after = {s.pid: s for s in tracker.sample()}
    assert child in after and after[child].ppid != proc.pid  # the orphan, reparented


def test_swap_comes_from_status_every_tick_not_from_an_old_smaps_read(spawn: Spawn) -> None:
    """Issue 15: smaps Swap (read on the budget, possibly minutes old) won over fresh VmSwap."""
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(120)')
    tracker = ProcessTracker(proc.pid)  # the default budget: the second tick reads no smaps
    tracker.sample()
    tracked = tracker._tracked[tracker.target_identity]
    assert tracked.smaps is not None
    tracked.smaps = dataclasses.replace(tracked.smaps, swap_bytes=7 * MiB)  # as read minutes ago
    sample = tracker.sample()[0]
    assert tracker.smaps_reads_last_tick == []
    with open(f"/proc/{proc.pid}/status") as fh:
        vm_swap = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSwap:"))
    assert sample.swap_bytes == vm_swap


FD_LIMITED_TREE = textwrap.dedent(
    """
    import ctypes, json, os, resource, signal, sys, time
    from dlmon.collect.sampler import Sampler
    from dlmon.model.serialize import snapshot_to_dict

    r, w = os.pipe()
    kids = []
    for _ in range(48):
        pid = os.fork()
        if pid == 0:  # dies with its parent; never holds the test's output pipes
            libc = ctypes.CDLL(None)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
            libc.prctl(15, b"pt_data_worker", 0, 0, 0)  # PR_SET_NAME
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(r); os.write(w, b"x"); signal.pause(); os._exit(0)
        kids.append(pid)
    try:
        for _ in kids:
            os.read(r, 1)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (120, hard))
        sampler = Sampler(os.getpid(), unlimited_smaps=True)
        for _ in range(3):
            snap = sampler.sample()
            time.sleep(0.2)
        data = snapshot_to_dict(snap)
    finally:
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
    print(json.dumps({
        "processes": len(snap.processes),
        "without_held_fds": data.get("processes_without_held_fds"),
        "missing": [p.pid for p in snap.processes
                    if None in (p.rss_bytes, p.read_bytes, p.num_fds, p.pss_bytes, p.cpu_percent)],
    }))
    """
)


def test_past_the_fd_limit_processes_are_read_by_path_and_counted() -> None:
    """Issue 15: three held fds per process; past RLIMIT_NOFILE rows lost io/fds/PSS silently."""
    out = subprocess.run(
        [sys.executable, "-c", FD_LIMITED_TREE],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ},
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["processes"] == 49
    assert result["missing"] == []
    assert result["without_held_fds"] > 0
    assert result["without_held_fds"] < 49  # the first ones still hold theirs


def test_the_slow_cadences_stretch_once_the_fixed_work_passes_half_the_budget(spawn: Spawn) -> None:
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(120)')
    tracker = ProcessTracker(proc.pid)
    tracker.record_tick_cost(0.001, 1.0)  # 0.1% of a core: far below half the budget
    assert tracker.stretch == 1.0
    for _ in range(20):
        tracker.record_tick_cost(0.0135, 1.0)  # 1.35%: three times half the 0.9% budget
    assert 2.5 < tracker.stretch <= tracker.cadence.max_stretch


def test_field_picker_agrees_with_a_line_by_line_parse_on_real_files() -> None:
    """The find-based picker (cheaper than the regex it replaced) on every readable status, io
    and smaps_rollup file of this machine, against the obvious split of every line."""
    from dlmon.collect.processes import IO_FIELDS, SMAPS_FIELDS, STATUS_FIELDS

    def oracle(raw: bytes, keys: set[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in raw.decode().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if name in keys and name not in out and parts and parts[0].isdigit():
                out[name] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
        return out

    checked = 0
    for picker, name in ((STATUS_FIELDS, "status"), (IO_FIELDS, "io"), (SMAPS_FIELDS, "smaps_rollup")):
        keys = {key for key, _, _ in picker._keys}
        for pid in [p for p in os.listdir("/proc") if p.isdigit()][:150]:
            try:
                with open(f"/proc/{pid}/{name}", "rb") as fh:
                    raw = fh.read()
            except OSError:
                continue
            assert picker(raw) == oracle(raw, keys), (pid, name)
            checked += 1
    assert checked > 30


def test_a_transient_error_on_the_target_stat_does_not_report_the_target_dead(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlmon.collect.sampler import Sampler

    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(120)')
    sampler = Sampler(proc.pid)
    assert sampler.sample().target.alive
    real_stat = ProcHandle.stat_unless  # the tracker's every-tick read
    failures = [proc.pid]

    def flaky_stat(self: ProcHandle, previous: tuple[bytes, StatFields] | None) -> tuple[bytes, StatFields]:
        if failures and self.pid == failures[0]:
            failures.pop()
            raise OSError(errno.EIO, "transient")
        return real_stat(self, previous)

    monkeypatch.setattr(ProcHandle, "stat_unless", flaky_stat)
    assert sampler.sample().target.alive
    monkeypatch.setattr(ProcHandle, "stat_unless", real_stat)
    proc.kill()
    proc.wait()
    assert not sampler.sample().target.alive  # really gone: reported


def test_a_thread_that_forked_before_keeps_being_read_after_a_relist_between_epochs(
    spawn: Spawn,
) -> None:
    """A long-lived thread that iterates non-persistent DataLoaders (Ray Train runs the training
    in a thread) forks new workers each epoch. A periodic thread relist that fell between epochs,
    when that thread had no children, forgot it: the next epoch's workers were only found at the
    next relist (5 s, up to 60 s stretched), short ones never."""
    proc = spawn(
        """
        import os, sys, threading, time
        def epochs():
            for line in sys.stdin:
                if line.strip() == "fork":
                    pid = os.fork()
                    if pid == 0:
                        time.sleep(120); os._exit(0)
                    print(pid, flush=True)
                else:
                    os.kill(pid, 9); os.waitpid(pid, 0)
                    print("REAPED", flush=True)
        threading.Thread(target=epochs).start()
        print("READY", flush=True)
        """
    )
    assert proc.stdin is not None and proc.stdout is not None

    def command(line: str) -> str:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    now = [0.0]
    tracker = ProcessTracker(proc.pid, SmapsBudget(unlimited=True), clock=lambda: now[0])
    first_worker = int(command("fork"))
    assert first_worker in {s.pid for s in tracker.sample()}  # every thread listed at the start
    assert command("kill") == "REAPED"
    now[0] = 10.0  # past thread_list_s: every thread listed again, between epochs
    assert {s.pid for s in tracker.sample()} == {proc.pid}
    second_worker = int(command("fork"))
    now[0] = 11.0
    assert second_worker in {s.pid for s in tracker.sample()}


def test_a_held_handle_never_opens_status_or_io_of_a_process_that_reused_its_pid(
    spawn: Spawn,
) -> None:
    """status and io are opened by path at their first read (for a new process, later in the
    tick that added it) and then held for good: unverified, a pid reused in between bound them
    to a stranger."""
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("needs root to steer pid allocation through ns_last_pid")
    proc = spawn(
        """
        import subprocess, sys, time
        victim = subprocess.Popen(["sleep", "120"])
        print("READY", flush=True)
        print(victim.pid, flush=True)
        sys.stdin.readline()
        victim.kill(); victim.wait()
        time.sleep(0.05)  # start times count 10 ms clock ticks: a later tick than the victim's
        for attempt in range(50):
            with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
                fh.write(str(victim.pid - 1))
            new = subprocess.Popen(["sleep", "120"])
            if new.pid == victim.pid:
                break
            new.kill(); new.wait()
        print("REUSED" if new.pid == victim.pid else "MISSED", flush=True)
        sys.stdin.readline()
        """
    )
    assert proc.stdin is not None and proc.stdout is not None
    victim = int(proc.stdout.readline())
    handle = ProcHandle(victim)  # holds stat only, as _add leaves a new process
    proc.stdin.write("\n")
    proc.stdin.flush()
    if proc.stdout.readline().strip() != "REUSED":
        pytest.skip("another process took the pid first")
    assert ProcHandle(victim).read("status")  # the stranger is there, readable
    for name in ("status", "io"):
        with pytest.raises(ProcessGone):
            handle.read(name)


def test_a_transient_error_on_the_target_stat_at_the_first_tick_does_not_report_it_dead(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tracker read the target's stat when it opened it, but its last state started as None:
    a transient error on the first tick reported a live target dead (and sample_until_done
    stopped watching it)."""
    from dlmon.collect.sampler import Sampler

    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(120)')
    sampler = Sampler(proc.pid)
    real_stat = ProcHandle.stat_unless  # the tracker's every-tick read
    failures = [proc.pid]

    def flaky_stat(self: ProcHandle, previous: tuple[bytes, StatFields] | None) -> tuple[bytes, StatFields]:
        if failures and self.pid == failures[0]:
            failures.pop()
            raise OSError(errno.EIO, "transient")
        return real_stat(self, previous)

    monkeypatch.setattr(ProcHandle, "stat_unless", flaky_stat)
    assert sampler.sample().target.alive
    assert not failures  # the error did happen on that tick


MANY_WORKERS = """
    import ctypes, os, signal, time
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # reap at once: a killed worker vanishes
    r, w = os.pipe()
    for _ in range(40):
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(15, b"pt_data_worker", 0, 0, 0)
            os.write(w, b"x")
            # a worker at work: a page fault every 10 ms moves its stat line (an idle one's row
            # is copied, not built, so reading it costs too little to put anything in rotation)
            import mmap
            m = mmap.mmap(-1, 64 * 4096)
            for i in range(30000):
                m[(i % 64) * 4096] = 1
                if i % 64 == 63:
                    m.madvise(mmap.MADV_DONTNEED)
                time.sleep(0.01)
            os._exit(0)
    for _ in range(40):
        os.read(r, 1)
    print("READY", flush=True)
    time.sleep(300)
"""


def test_a_tree_too_big_for_the_budget_is_read_in_rotation_and_loses_no_row(spawn: Spawn) -> None:
    """Issue 14, step 3 of the degradation order: past the budget, workers are read every N
    ticks (their last row shown in between, said on screen); the trainer every tick; a worker
    killed meanwhile still leaves within N ticks; the rotation unwinds when the cost allows."""
    import signal as signals

    from dlmon.collect.processes import Cadence
    from dlmon.collect.sampler import Sampler
    from dlmon.model.format import one_line

    proc = spawn(MANY_WORKERS)
    # a budget no tree fits in: the every-tick reads alone pass it
    sampler = Sampler(proc.pid, policy=BudgetPolicy(cpu_fraction=0.0002, min_smaps_fraction=0.0001))
    sampler.processes.cadence = Cadence(rotation_settle_ticks=2)
    try:
        snaps, reads = [], []  # reads: the pids whose stat/status/io were read on that tick
        for _ in range(45):  # 10 warm-up ticks, then up to 10 steps 2 ticks apart, then settled
            snaps.append(sampler.sample())
            reads.append(set(sampler.processes.read_last_tick))
            time.sleep(0.03)  # the workers move between ticks
        last = snaps[-1]
        assert last.rotation_ticks >= 4, [s.rotation_ticks for s in snaps]
        # not in the first ticks, whose one-off work (every fd directory, every thread list, new
        # handles) is no steady cost: a 32-worker tree was put in rotation for its first minute
        assert [s.rotation_ticks for s in snaps[:10]] == [1] * 10, [s.rotation_ticks for s in snaps]
        assert all(len(s.processes) == 41 for s in snaps), [len(s.processes) for s in snaps]
        assert "large tree: workers read every" in one_line(last)
        # the trainer is read every tick; every worker at least once per rotation
        k = last.rotation_ticks
        window = snaps[-k:]
        fresh: dict[int, int] = {}
        for s, read in zip(window, reads[-k:], strict=True):
            reused = 0
            for p in s.processes:
                if p.pid not in read:
                    reused += 1
                    assert p.role == "worker", p
                else:
                    fresh[p.pid] = fresh.get(p.pid, 0) + 1
            assert s.processes_in_rotation == reused
        assert fresh.get(proc.pid) == k
        assert set(fresh) == {p.pid for p in last.processes}, "a worker was not read within its rotation"
        # a worker killed while resting: reaped at once (SIGCHLD ignored), its parent stops
        # listing it, so it is read, and gone, on the next tick (not at its turn)
        resting_now = [p.pid for p in last.workers() if p.pid not in reads[-1]]
        victim = resting_now[0] if resting_now else last.workers()[0].pid
        os.kill(victim, signals.SIGKILL)
        time.sleep(0.2)
        gone_after = next(
            (i for i in range(1, 3 * k) if victim not in {p.pid for p in sampler.sample().processes}), None
        )
        assert gone_after == 1, gone_after
        # a cost that fits again (a generous budget: ticks 0.1 s apart): back to every tick
        sampler.processes.budget.policy = BudgetPolicy(cpu_fraction=0.5)
        for _ in range(60):
            time.sleep(0.1)
            if sampler.sample().rotation_ticks == 1:
                break
        unwound = sampler.sample()
        assert unwound.rotation_ticks == 1 and unwound.processes_in_rotation == 0
        assert "large tree" not in one_line(unwound)
    finally:
        sampler.close()


def test_a_row_shown_again_in_rotation_is_not_a_new_pss_reading(spawn: Spawn) -> None:
    """A worker's row shown again between its reads keeps the PSS of its last smaps read, so its
    pss_age_s must keep growing: frozen, the digest (snapshot time - pss_age_s) took every re-show
    for a new reading taken later (139 readings from 41 smaps reads), flattening growth."""
    from dlmon.analysis.digest import Digest
    from dlmon.collect.processes import Cadence
    from dlmon.collect.sampler import Sampler

    proc = spawn(MANY_WORKERS)
    sampler = Sampler(proc.pid, policy=BudgetPolicy(cpu_fraction=0.0002, min_smaps_fraction=0.0001))
    sampler.processes.cadence = Cadence(rotation_settle_ticks=2)
    digest = Digest()
    smaps_reads = 0
    taken: dict[int, set[float]] = {}
    read_at: dict[int, list[float]] = {}
    try:
        for _ in range(30):
            snap = sampler.sample()
            smaps_reads += len(sampler.processes.smaps_reads_last_tick)
            digest.ingest(snap)
            fresh = {pid for pid, _ in sampler.processes.smaps_reads_last_tick}
            for pid in fresh:
                read_at.setdefault(pid, []).append(snap.time)
            for p in snap.workers():
                if p.pss_age_s is not None and p.pid not in fresh:
                    # the same reading: the moment of one of its real reads, whatever tick shows it
                    taken.setdefault(p.pid, set()).add(snap.time - p.pss_age_s)
            time.sleep(0.25)
        assert snap.rotation_ticks > 1 and snap.processes_in_rotation > 0
        assert digest.readings <= smaps_reads, (digest.readings, smaps_reads)
        made_up = {
            pid: sorted(t for t in times if not any(abs(t - r) < 0.5 for r in read_at.get(pid, [])))
            for pid, times in taken.items()
        }
        made_up = {pid: t for pid, t in made_up.items() if t}
        assert not made_up, made_up
    finally:
        sampler.close()


FEW_WORKERS = MANY_WORKERS.replace("range(40)", "range(2)")


def test_a_small_tree_over_the_budget_is_not_put_in_rotation(spawn: Spawn) -> None:
    """Rotation only pays where the workers' reads are the cost (a large tree). On a small tree
    whose fixed work passes the budget (a short --interval, a slow NVML), reading 2 workers every
    10 ticks saved nothing and said "large tree: workers read every 10 ticks" on screen."""
    from dlmon.collect.processes import Cadence
    from dlmon.collect.sampler import Sampler
    from dlmon.model.format import one_line

    proc = spawn(FEW_WORKERS)
    sampler = Sampler(proc.pid, policy=BudgetPolicy(cpu_fraction=0.0002, min_smaps_fraction=0.0001))
    sampler.processes.cadence = Cadence(rotation_settle_ticks=2)
    try:
        snaps = [sampler.sample() for _ in range(30)]
        assert len(snaps[-1].workers()) == 2
        assert [s.rotation_ticks for s in snaps] == [1] * 30
        assert "large tree" not in one_line(snaps[-1])
    finally:
        sampler.close()


def test_the_rotation_note_says_sub_second_staleness_at_a_short_interval() -> None:
    """At --interval 0.1, rotation 3 leaves a row ~0.3 s old: it said "(~0 s)"."""
    from dlmon.model.format import one_line, rotation_note
    from support.ui import make_snapshot

    fast = dataclasses.replace(make_snapshot(), rotation_ticks=3, processes_in_rotation=80, interval_s=0.1)
    assert "every 3 ticks (~0.3 s)" in one_line(fast)
    slow = dataclasses.replace(fast, rotation_ticks=10, interval_s=1.002)
    assert "every 10 ticks (~10 s)" in (rotation_note(slow) or "")


def test_workers_the_agent_stops_listing_are_read_at_once_not_shown_for_a_rotation(spawn: Spawn) -> None:
    """In rotation, a non-persistent loader's workers that end with the epoch kept their last row
    (state S, worker id N) until their turn, up to 10 ticks, beside the next epoch's worker N. The
    agent drops their pids once they are joined: a worker it no longer lists is read next tick."""
    pytest.importorskip("torch")
    from dlmon.collect.processes import Cadence
    from dlmon.collect.sampler import Sampler

    proc = spawn(
        """
        import time, torch
        import dlmon.agent
        dlmon.agent.start()
        from torch.utils.data import DataLoader, Dataset

        class Slow(Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                time.sleep(0.2)
                return torch.zeros(4)

        loader = DataLoader(Slow(), batch_size=1, num_workers=4)
        print("READY", flush=True)
        for epoch in range(4):
            for batch in loader:
                pass
            time.sleep(1.5)
        print("DONE", flush=True)
        time.sleep(120)
        """
    )
    assert proc.stdout is not None
    sampler = Sampler(proc.pid)
    sampler.processes.rotation = 10  # forced: a 5-process tree never needs it
    sampler.processes.cadence = Cadence(rotation_settle_ticks=10**9)
    shown_dead: dict[int, int] = {}  # worker pid -> snapshots that showed it alive after it ended
    workers: set[int] = set()
    deadline = time.monotonic() + 120
    try:
        while "DONE" not in _ready_line(proc.stdout) and time.monotonic() < deadline:
            snap = sampler.sample()
            for p in snap.workers():
                workers.add(p.pid)
                if p.state not in ("Z", "X") and not os.path.exists(f"/proc/{p.pid}"):
                    shown_dead[p.pid] = shown_dead.get(p.pid, 0) + 1
            time.sleep(0.25)
    finally:
        sampler.close()
    assert len(workers) >= 12, workers  # the agent and the epochs worked
    assert max(shown_dead.values(), default=0) <= 3, shown_dead


def test_a_small_tree_at_10_hz_is_not_put_in_rotation_where_it_would_buy_nothing(spawn: Spawn) -> None:
    """At 10 Hz the machine-wide files (meminfo, cgroup, disks, PSI, agent) cost more than the
    rows of a 3-process tree: resting its workers saved nothing and only made their rows stale
    (the controller climbed to 10 ticks on any tree at 10 Hz)."""
    from dlmon.collect.processes import Cadence
    from dlmon.collect.sampler import Sampler

    proc = spawn(
        """
        import os, time
        for _ in range(2):
            if os.fork() == 0:
                time.sleep(120); os._exit(0)
        print("READY", flush=True)
        time.sleep(120)
        """
    )
    sampler = Sampler(proc.pid, policy=BudgetPolicy(cpu_fraction=0.0002, min_smaps_fraction=0.0001))
    sampler.processes.cadence = Cadence(rotation_settle_ticks=2)
    try:
        seen = []
        for _ in range(30):
            seen.append(sampler.sample().rotation_ticks)
            time.sleep(0.1)
        assert set(seen) == {1}, seen
    finally:
        sampler.close()


def test_status_and_io_are_read_again_when_stat_shows_the_process_moved_else_on_a_slow_cadence(
    spawn: Spawn,
) -> None:
    """Issue 14: status and io of every process, every tick, were most of the fixed per-process
    cost, and an idle worker's do not change. A process that moved is read at once (its row shows
    the new memory on that very tick); one that did not, every ``unmoved_refresh_s``."""
    proc = spawn(
        """
        import sys
        held = []
        print("READY", flush=True)
        for line in sys.stdin:
            held.append(b"x" * int(line))  # written, so resident
            print("DONE", flush=True)
        """
    )
    assert proc.stdin is not None and proc.stdout is not None
    clock = [1000.0]
    tracker = ProcessTracker(proc.pid, clock=lambda: clock[0])
    first = tracker.sample()[0]
    assert tracker.status_read_last_tick == [proc.pid] and first.rss_anon_bytes is not None
    for _ in range(5):  # the first tick may catch the end of its start-up
        clock[0] += 1.0
        tracker.sample()
        if not tracker.status_read_last_tick:
            break
    assert tracker.status_read_last_tick == []

    proc.stdin.write(f"{64 * MiB}\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "DONE"
    clock[0] += 1.0
    moved = tracker.sample()[0]
    assert tracker.status_read_last_tick == [proc.pid]
    assert moved.rss_anon_bytes is not None and moved.rss_anon_bytes >= first.rss_anon_bytes + 60 * MiB
    assert moved.rss_bytes is not None and moved.rss_bytes >= moved.rss_anon_bytes

    for _ in range(5):
        clock[0] += 1.0
        tracker.sample()
        if not tracker.status_read_last_tick:
            break
    assert tracker.status_read_last_tick == []
    clock[0] += tracker.cadence.unmoved_refresh_s
    tracker.sample()
    assert tracker.status_read_last_tick == [proc.pid]


def test_a_transient_status_error_is_not_kept_while_the_process_rests(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a resting process keeps must be a whole reading: an empty status from a transient
    error would have stood for five seconds of rows without RSS."""
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(120)')
    tracker = ProcessTracker(proc.pid)
    real_read = ProcHandle.read

    def failing_read(self: ProcHandle, name: str) -> bytes:
        if name == "status":
            raise OSError(errno.EIO, "transient")
        return real_read(self, name)

    monkeypatch.setattr(ProcHandle, "read", failing_read)
    assert tracker.sample()[0].rss_anon_bytes is None
    monkeypatch.setattr(ProcHandle, "read", real_read)
    assert tracker.sample()[0].rss_anon_bytes is not None


def _fake_io_read_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every /proc/PID/io read shows ``read_bytes`` as the returned list's one item (IO that
    moves while stat stays put: O_DIRECT, big blocks); set it to move the counter."""
    read_bytes = [0]
    real_read = ProcHandle.read

    def fake_io(self: ProcHandle, name: str) -> bytes:
        if name == "io":
            return f"rchar: 0\nwchar: 0\nread_bytes: {read_bytes[0]}\nwrite_bytes: 0\n".encode()
        return real_read(self, name)

    monkeypatch.setattr(ProcHandle, "read", fake_io)
    return read_bytes


def test_io_rates_after_an_unmoved_stretch_are_over_the_time_since_the_last_read(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IO the CPU barely touches (O_DIRECT, big blocks) moves /proc/PID/io while stat stays put.
    The read after such a stretch held all its bytes, and its rate was taken over the last tick
    only: 1 MiB/s shown as 4 MiB/s once every 5 s, 0 in between. The rate is over the time since
    the last read, and a process whose bytes moved at a read is read again on the next tick."""
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(120)')
    read_bytes = _fake_io_read_bytes(monkeypatch)
    clock = [1000.0]
    tracker = ProcessTracker(proc.pid, clock=lambda: clock[0])

    def tick(grow: int) -> tuple[float | None, bool]:
        clock[0] += 1.0
        read_bytes[0] += grow
        row = tracker.sample()[0]
        return row.read_bytes_per_s, tracker.status_read_last_tick == [proc.pid]

    assert tracker.sample()[0].read_bytes_per_s is None  # no interval yet
    for _ in range(8):  # idle: no bytes; settles once its start-up is over
        rate, was_read = tick(0)
        if not was_read:
            break
    assert not was_read and rate == 0.0
    last_read = clock[0] - 1.0  # the tick before read it (nothing moved there)
    for _ in range(8):  # 1 MiB a second while stat stays put: read at the latest after 5 s
        rate, was_read = tick(MiB)
        if was_read:
            break
        assert rate == 0.0
    assert was_read
    # the bytes of this whole stretch over its length; it read nothing on the tick after last_read
    grown = clock[0] - last_read - 1.0
    assert rate == pytest.approx(grown * MiB / (clock[0] - last_read))
    for _ in range(3):  # moving bytes: read every tick, at the true rate
        rate, was_read = tick(MiB)
        assert was_read and rate == pytest.approx(MiB)
    rate, was_read = tick(0)  # stopped: read once more (it moved at the last read), then rests
    assert was_read and rate == 0.0
    rate, was_read = tick(0)
    assert not was_read and rate == 0.0


def test_an_idle_process_row_is_shown_again_and_built_anew_once_anything_in_it_moves(spawn: Spawn) -> None:
    """Issue 14: an idle process's stat line reads the same bytes tick after tick; its row is then
    the last one again (its PSS age advancing) instead of a parse and a build. Anything it shows
    that moves builds it anew: CPU time (and its rate falls back to 0 once idle again, not stuck
    at the busy tick's), memory, the agent's worker id."""
    proc = spawn(
        """
        import sys, time
        held = []
        print("READY", flush=True)
        for line in sys.stdin:
            verb, arg = line.split()
            if verb == "spin":
                end = time.process_time() + float(arg)
                while time.process_time() < end:
                    pass
            else:
                held.append(b"x" * int(arg))
            print("DONE", flush=True)
        """
    )
    assert proc.stdin is not None and proc.stdout is not None

    def ask(line: str) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "DONE"

    clock = [1000.0]
    slow = Cadence(unmoved_refresh_s=1e6, fd_refresh_s=1e6)  # only what moves is read again
    tracker = ProcessTracker(
        proc.pid, SmapsBudget(BudgetPolicy(initial_s=1.0)), clock=lambda: clock[0], cadence=slow
    )

    def tick() -> ProcessSample:
        clock[0] += 1.0
        return tracker.sample()[0]

    def until_quiet() -> list[ProcessSample]:
        rows = [tick()]
        for _ in range(8):  # the tick it went idle builds a row with zero rates; the next copies it
            rows.append(tick())
            if tracker.rows_shown_again_quiet == 1:
                return rows
        raise AssertionError("an idle process's row was never shown again")

    rows = until_quiet()
    again, before = rows[-1], rows[-2]
    assert again.pss_bytes is not None and again.pss_age_s == before.pss_age_s + 1.0  # type: ignore[operator]
    assert dataclasses.replace(before, pss_age_s=again.pss_age_s) == again
    assert again.cpu_percent == 0.0

    ask("spin 0.3")
    busy = tick()
    assert tracker.rows_shown_again_quiet == 0 and busy.cpu_percent is not None
    # 0.3 s of CPU over the 1 s since the copied row's tick (a copy starts the next rate's interval
    # as a build does; from the build before it, the rate was over 2 s: ~15%)
    assert 25 < busy.cpu_percent < 45, busy.cpu_percent
    idle = until_quiet()
    assert all(row.cpu_percent == 0.0 for row in idle), [row.cpu_percent for row in idle]

    ask(f"alloc {32 * MiB}")
    grown = tick()
    assert tracker.rows_shown_again_quiet == 0
    assert grown.rss_anon_bytes is not None and again.rss_anon_bytes is not None
    assert grown.rss_anon_bytes >= again.rss_anon_bytes + 30 * MiB
    until_quiet()

    tracker.budget.tokens = -10.0  # no PSS read on the next tick: only the name moves
    tracker.worker_hints = {proc.pid: 3}  # the agent now names it
    named = tick()
    assert tracker.smaps_reads_last_tick == []
    assert tracker.rows_shown_again_quiet == 0 and named.worker_id == 3


def test_a_copied_row_is_the_row_a_build_would_give_whatever_moves_around_an_idle_process(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row shown again because its process is idle equals the row a build would give on
    that tick, through all that can move while the stat line stands still: the agent's thread
    count and worker id (a role change), the fd count, the fd limit, a PSS read that moved (a
    sharer of its pages exited), a zombie child."""
    proc = spawn(
        """
        import os, sys, time
        shared = bytearray(16 * 1024 * 1024)
        for i in range(0, len(shared), 4096):
            shared[i] = 1
        if os.fork() == 0:  # shares the pages until it is killed (never reaped: a zombie)
            time.sleep(300)
            os._exit(0)
        held = []
        print("READY", flush=True)
        for line in sys.stdin:
            held.extend(os.open("/dev/null", os.O_RDONLY) for _ in range(20))
            print("DONE", flush=True)
        """
    )

    def ask(line: str) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "DONE"

    real_quiet_row = ProcessTracker._quiet_row
    copied: list[int] = []

    def checked_quiet_row(
        self: ProcessTracker, identity: tuple[int, int], tracked: Any, stat: StatFields, now: float
    ) -> ProcessSample | None:
        shadow = copy.copy(tracked)  # a build mutates its tracked state: build on a copy
        shadow.unavailable = dict(tracked.unavailable)
        row = real_quiet_row(self, identity, tracked, stat, now)
        if row is not None:
            built = self._build(identity, shadow, stat, tracked.status, tracked.io, now, False)
            assert row == built, [
                (f, getattr(row, f), getattr(built, f))
                for f in (f.name for f in dataclasses.fields(ProcessSample))
                if getattr(row, f) != getattr(built, f)
            ]
            copied.append(identity[0])
        return row

    monkeypatch.setattr(ProcessTracker, "_quiet_row", checked_quiet_row)
    clock = [1000.0]
    cadence = Cadence(unmoved_refresh_s=1e6, fd_refresh_s=3.0)  # fds recounted on quiet ticks
    tracker = ProcessTracker(
        proc.pid, SmapsBudget(BudgetPolicy(initial_s=1.0)), clock=lambda: clock[0], cadence=cadence
    )

    def ticks(n: int, step: float = 1.0) -> dict[int, ProcessSample]:
        rows: dict[int, ProcessSample] = {}
        for _ in range(n):
            clock[0] += step
            rows = {row.pid: row for row in tracker.sample()}
        return rows

    def quiet(*pids: int) -> dict[int, ProcessSample]:
        """Tick until the rows of ``pids`` were all copied on one tick: what moves next moves
        around an idle process."""
        for _ in range(20):
            before = len(copied)
            rows = ticks(1)
            if set(pids) <= set(copied[before:]):
                return rows
        raise AssertionError(f"never idle: {pids}")

    sharer = next(pid for pid in ticks(1) if pid != proc.pid)
    quiet(proc.pid, sharer)
    monkeypatch.setattr(tracker.budget, "can_spend", lambda: False)  # no PSS read rebuilds a row
    tracker.thread_hints = {proc.pid: 4}
    assert ticks(1)[proc.pid].torch_threads == 4
    fds_before = quiet(proc.pid)[proc.pid].num_fds
    tracker.cadence = dataclasses.replace(cadence, fd_refresh_s=1e6)  # no recount while it moves
    ask("fds")
    quiet(proc.pid)
    tracker.cadence = cadence
    assert fds_before is not None and ticks(1, step=3.0)[proc.pid].num_fds == fds_before + 20
    quiet(proc.pid)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (soft - 1, hard))
    assert ticks(1, step=61.0)[proc.pid].fd_limit == soft - 1  # past the limit's cache
    monkeypatch.undo()  # PSS read again from here (and every copy still checked below)
    monkeypatch.setattr(ProcessTracker, "_quiet_row", checked_quiet_row)
    pss_shared = ticks(1)[proc.pid].pss_bytes
    os.kill(sharer, signal.SIGKILL)  # the parent's PSS grows by half the shared pages, unmoved
    for _ in range(250):  # until it has exited (real time: the clock is fake)
        time.sleep(0.02)
        if ticks(1)[sharer].state == "Z":
            break
    ticks(6)
    tracker.worker_hints = {sharer: 1}  # the agent names it: a worker now
    rows = ticks(14)  # past the steady PSS refresh: the parent's PSS read again, on a quiet tick
    assert pss_shared is not None and rows[proc.pid].pss_bytes is not None
    assert rows[proc.pid].pss_bytes > pss_shared + 6 * MiB
    zombie = rows[sharer]
    assert zombie.state == "Z" and zombie.role == "worker" and zombie.worker_id == 1
    assert zombie.num_fds is None and "memory" in zombie.unavailable
    assert copied.count(sharer) >= 8 and copied.count(proc.pid) >= 15, copied


def _raise_in_the_next_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next tick raises after its reads (in its first build), as a tick that met an OSError
    reading /proc does; the watch loop (flow/loop.py) counts it and goes on."""
    real_build = ProcessTracker._build

    def build_once(self: ProcessTracker, *args: Any) -> ProcessSample:
        monkeypatch.setattr(ProcessTracker, "_build", real_build)
        raise OSError(errno.EIO, "a tick that raised after its reads")

    monkeypatch.setattr(ProcessTracker, "_build", build_once)


def test_a_pss_read_on_a_tick_that_raised_is_not_shown_under_an_old_row(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PSS read on a tick that raised was kept; the next tick, the idle process's row was copied
    from before it: its old PSS under the new reading's age (fresh-looking), until the next read.
    PSS moves while the stat line stands still: here a sharer of its pages exits."""
    proc = spawn(
        """
        import os, time
        big = bytearray(48 * 1024 * 1024)
        for i in range(0, len(big), 4096):
            big[i] = 1
        if os.fork() == 0:  # shares every page of big with its parent until it exits
            time.sleep(300)
            os._exit(0)
        print("READY", flush=True)
        time.sleep(300)
        """
    )
    clock = [1000.0]
    slow = Cadence(unmoved_refresh_s=1e6, fd_refresh_s=1e6)
    budget = SmapsBudget(BudgetPolicy(initial_s=1.0))
    tracker = ProcessTracker(proc.pid, budget, clock=lambda: clock[0], cadence=slow)

    def tick(step: float = 1.0) -> dict[int, ProcessSample]:
        clock[0] += step
        return {row.pid: row for row in tracker.sample()}

    rows = tick()
    child = next(pid for pid in rows if pid != proc.pid)
    for _ in range(8):
        rows = tick()
        if tracker.rows_shown_again_quiet == 2:
            break
    assert tracker.rows_shown_again_quiet == 2
    shared_pss = rows[proc.pid].pss_bytes
    assert shared_pss is not None and shared_pss < 40 * MiB  # half of big is the child's
    os.kill(child, signal.SIGKILL)  # never reaped: big is the parent's alone, its stat unmoved
    time.sleep(0.2)
    _raise_in_the_next_build(monkeypatch)
    with pytest.raises(OSError):
        tick(11.0)  # past the steady refresh: the parent's PSS is read, then the tick raised
    assert tracker.smaps_reads_last_tick == [(proc.pid, rows[proc.pid].start_time)]
    parent = tick()[proc.pid]
    assert parent.pss_age_s == 1.0 and tracker.smaps_reads_last_tick == []
    assert parent.pss_bytes is not None and parent.pss_bytes > 44 * MiB, (shared_pss, parent)


def test_an_orphan_seen_on_a_tick_that_raised_shows_its_new_parent(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stat line read on a tick that raised was kept; the next tick read the same bytes, took
    the idle orphan for unmoved and copied its row from before: its dead parent, for good (the
    orphan detectors look for a worker whose parent is gone)."""
    proc = spawn(
        """
        import os, time
        if os.fork() == 0:
            time.sleep(300)
            os._exit(0)
        print("READY", flush=True)
        time.sleep(300)
        """
    )
    clock = [1000.0]
    slow = Cadence(unmoved_refresh_s=1e6, fd_refresh_s=1e6)
    tracker = ProcessTracker(proc.pid, clock=lambda: clock[0], cadence=slow)
    monkeypatch.setattr(tracker.budget, "can_spend", lambda: False)  # no PSS read rebuilds a row

    def tick() -> dict[int, ProcessSample]:
        clock[0] += 1.0
        return {row.pid: row for row in tracker.sample()}

    rows = tick()
    orphan = next(pid for pid in rows if pid != proc.pid)
    for _ in range(8):
        rows = tick()
        if tracker.rows_shown_again_quiet == 2:
            break
    assert tracker.rows_shown_again_quiet == 2 and rows[orphan].ppid == proc.pid
    proc.kill()
    proc.wait()
    _raise_in_the_next_build(monkeypatch)
    with pytest.raises(OSError):
        tick()  # read the orphan's new stat line, then raised
    after = tick()[orphan]
    assert after.ppid != proc.pid, after


def test_status_and_io_read_on_a_tick_that_raised_are_shown_on_the_next(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """status and io read again on a tick that raised (the slow refresh of an idle process) were
    kept, not due again for another 5 s: the next ticks copied the row from before that read."""
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(120)')
    read_bytes = _fake_io_read_bytes(monkeypatch)
    clock = [1000.0]
    cadence = Cadence(unmoved_refresh_s=5.0, fd_refresh_s=1e6)
    tracker = ProcessTracker(proc.pid, clock=lambda: clock[0], cadence=cadence)
    monkeypatch.setattr(tracker.budget, "can_spend", lambda: False)  # no PSS read rebuilds a row

    def tick(step: float = 1.0) -> ProcessSample:
        clock[0] += step
        return tracker.sample()[0]

    for _ in range(4):
        row = tick()
        if tracker.rows_shown_again_quiet == 1:
            break
    assert tracker.rows_shown_again_quiet == 1 and row.read_bytes == 0
    read_bytes[0] = MiB  # moved while stat stood still (O_DIRECT): seen at the slow refresh
    _raise_in_the_next_build(monkeypatch)
    with pytest.raises(OSError):
        tick(5.0)
    assert tracker.status_read_last_tick == [proc.pid]
    assert tick().read_bytes == MiB


STILL_TREE = """
    import ctypes, os, signal, sys, time
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped as they exit
    r, w = os.pipe()

    def child():
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(15, b"pt_data_worker", 0, 0, 0)  # a DataLoader worker's name
            os.write(w, b"x")  # it ran: its start-up faults are (nearly) over
            time.sleep(300); os._exit(0)
        os.read(r, 1)

    for _ in range(2):
        child()
    held = []
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "fork":
            child()
        else:
            held.append(b"x" * int(line))  # written, so faulted in
        print("DONE", flush=True)
"""


class StillTree:
    """A main and two sleeping workers (STILL_TREE), watched by a tracker on a fake clock with a budget
    that never runs short (the stall limit off: on a loaded machine a preempted read's wall
    time would push a process's next read past the cadence under test)."""

    def __init__(self, spawn: Spawn) -> None:
        self.proc = spawn(STILL_TREE)
        self.clock = [1000.0]
        self.policy = BudgetPolicy(cpu_fraction=1.0, burst_s=10.0, initial_s=10.0, max_stall_fraction=0.0)
        self.tracker = ProcessTracker(self.proc.pid, SmapsBudget(self.policy), clock=lambda: self.clock[0])
        self.samples = self.tracker.sample()
        self.pids = {s.pid for s in self.samples}

    def tick(self, seconds: float) -> set[int]:
        self.clock[0] += seconds
        self.samples = self.tracker.sample()
        return {pid for pid, _ in self.tracker.smaps_reads_last_tick}

    def command(self, line: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "DONE"

    def wait_until_quiet(self, pid: int) -> None:
        """Until ``pid``'s faults and RSS stayed the same for 0.2 s: a process answering DONE still
        faults on its way back to reading stdin, and a movement the tracker saw one tick later
        made the whole tree due again (seen failing ~1 run in 3, on the old code too)."""
        last, same = None, 0
        for _ in range(200):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            now = (fields[7], fields[9], fields[21])  # minflt, majflt, rss
            same = same + 1 if now == last else 0
            if same == 4:
                return
            last = now
            time.sleep(0.05)
        raise AssertionError(f"process {pid} never stood still")

    def still(self) -> dict[int, bool]:
        return {s.pid: s.pss_still for s in self.samples}

    def settle(self) -> None:
        """Ticks until three in a row, 0.1 s apart, saw no movement, then one that takes every
        reading, all of them after the last movement."""
        quiet = 0
        for _ in range(100):
            moved_at = self.tracker.memory_moved_at
            time.sleep(0.1)
            self.tick(1.0)
            quiet = quiet + 1 if self.tracker.memory_moved_at == moved_at else 0
            if quiet == 3:
                assert self.tick(self.policy.still_refresh_s) == self.pids
                return
        raise AssertionError("the tree never stood still")


def test_a_still_tree_is_read_again_only_every_few_minutes_and_at_the_steady_cadence_once_it_moves(
    spawn: Spawn,
) -> None:
    """Issue 12 (cost): an idle tree's PSS was re-read every 10 s whatever happened, the whole
    PSS budget spent on readings that could not have changed. While no process of the tree
    faults, changes RSS, joins or leaves, a reading is taken again only every
    ``still_refresh_s``; any movement brings every process back to the steady cadence, and each
    row says whether its reading stood still since (the screen marks the others' age)."""
    tree = StillTree(spawn)
    main, policy, tick = tree.proc.pid, tree.policy, tree.tick
    assert len(tree.pids) == 3 and {pid for pid, _ in tree.tracker.smaps_reads_last_tick} == tree.pids
    tree.settle()
    assert tick(policy.steady_refresh_s + 1) == set()  # still: no read at the steady cadence
    assert tick(policy.still_refresh_s / 2) == set()
    assert tree.still() == dict.fromkeys(tree.pids, True)  # 150 s old, and still true
    assert tick(policy.still_refresh_s / 2) == tree.pids  # ... but re-taken every still_refresh_s

    tree.command("fork")  # a process joins: every reading of the tree is due at the steady cadence
    joined = tick(1.0) - {main}  # the new one, never read (and the main if its fork faulted)
    assert len(joined) == 1 and not joined & tree.pids
    assert tick(policy.steady_refresh_s) >= tree.pids - {main}
    tree.pids |= joined
    tree.settle()

    tick(1.0)  # a quiet tick: the idle rows are built once more, then copied while idle
    tree.command(str(8 * MiB))  # the main faults memory in: its own reading and its sharers' are due
    tree.wait_until_quiet(main)
    assert tick(1.0) == {main}  # moved past the threshold: at the moved cadence
    assert tree.tracker.rows_shown_again_quiet == len(tree.pids) - 1  # the children's rows, copied
    assert tree.still() == {pid: pid == main for pid in tree.pids}  # ... with the tree's news
    # the idle children at the steady cadence (the main was read after the movement, unless it
    # faulted again on its way back to reading stdin)
    assert tick(policy.steady_refresh_s) - {main} == tree.pids - {main}
    assert tick(policy.steady_refresh_s + 1) == set()  # read since the movement: still again

    tree.settle()
    (leaving,) = joined  # it leaves, and nothing else moves (no parent wakes up to reap it)
    os.kill(leaving, signal.SIGKILL)
    while os.path.exists(f"/proc/{leaving}"):
        time.sleep(0.01)
    tree.pids.remove(leaving)
    assert tick(1.0) == set()
    assert tick(policy.steady_refresh_s) == tree.pids  # its sharers' readings at the steady cadence


def test_a_movement_read_on_a_tick_that_raised_is_not_lost(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: a tick that raised after reading a moved stat line kept the line but not its
    movement; the next tick read the same bytes, skipped the process, and the readings taken
    before the movement counted as still for five minutes."""
    tree = StillTree(spawn)
    tree.settle()
    tree.command(str(8 * MiB))
    real = ProcessTracker._maybe_count_fds

    def raise_once(self: ProcessTracker, *args: Any) -> None:
        monkeypatch.setattr(ProcessTracker, "_maybe_count_fds", real)
        raise OSError(errno.EIO, "a tick that raised after its stat reads")

    monkeypatch.setattr(ProcessTracker, "_maybe_count_fds", raise_once)
    with pytest.raises(OSError):
        tree.tick(1.0)
    tree.tick(1.0)
    assert tree.still()[tree.proc.pid] is True  # read after the movement
    assert [still for pid, still in tree.still().items() if pid != tree.proc.pid] == [False, False]
    assert tree.tick(tree.policy.steady_refresh_s) - {tree.proc.pid} == tree.pids - {tree.proc.pid}


def test_major_faults_alone_are_movement(spawn: Spawn) -> None:
    """Review: a page read in from disk or swap (an mmapped dataset, swap-in) counts as a major
    fault and may leave minflt alone; it moves the tree as much as a minor one."""
    tree = StillTree(spawn)
    tree.settle()
    tracker = tree.tracker
    moved_at = tracker.memory_moved_at
    rows = {}
    for identity, tracked in tracker._tracked.items():
        stat = tracked.stat_pair[1] if tracked.stat_pair is not None else None
        assert stat is not None
        rows[identity] = (tracked, stat, {}, {})
    tracker._note_memory_movement(rows, 5000.0)
    assert tracker.memory_moved_at == moved_at  # the same lines: nothing moved
    identity = next(iter(rows))
    tracked, stat, _, _ = rows[identity]
    rows[identity] = (tracked, dataclasses.replace(stat, major_faults=stat.major_faults + 1), {}, {})
    tracker._note_memory_movement(rows, 5001.0)
    assert tracker.memory_moved_at == 5001.0
