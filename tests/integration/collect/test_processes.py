"""The process tree collector against real processes and against smem, which no one here wrote."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import Spawn
from dlmon.collect.processes import Cadence, ProcessTracker
from dlmon.collect.procfs import ProcessGone, ProcHandle, parse_stat
from dlmon.collect.smaps_budget import SmapsBudget
from dlmon.model.format import DEAD_STATES

MiB = 1024 * 1024

FORKED_TREE = """
    import os, sys, time
    shared = bytearray(64 * 1024 * 1024)
    for i in range(0, len(shared), 4096):
        shared[i] = 1
    for _ in range(3):
        if os.fork() == 0:
            private = bytearray(16 * 1024 * 1024)
            for i in range(0, len(private), 4096):
                private[i] = 2
            touched = sum(shared[::4096])  # reads: pages stay shared with the parent
            time.sleep(120)
            os._exit(0)
    own = bytearray(24 * 1024 * 1024)  # private to the parent, allocated after the forks
    for i in range(0, len(own), 4096):
        own[i] = 3
    time.sleep(1.0)
    print("READY", flush=True)
    time.sleep(120)
"""

# smem is itself a Python program: while it runs it maps the same shared libraries as the
# target, so ~100 KiB of the target's private file pages turn shared under its eyes.
ORACLE_SLACK = 256 * 1024


def unlimited_tracker(pid: int) -> ProcessTracker:
    return ProcessTracker(pid, SmapsBudget(unlimited=True))


def test_parse_stat_survives_hostile_comm() -> None:
    raw = b"42 (a) b (c)) S 1 42 42 0 -1 4194560 1 0 0 0 7 3 0 0 20 0 5 0 12345 100 25 rest\n"
    stat = parse_stat(raw)
    assert (stat.comm, stat.state, stat.ppid) == ("a) b (c)", "S", 1)
    assert (stat.utime_ticks, stat.stime_ticks, stat.num_threads, stat.start_time) == (7, 3, 5, 12345)
    assert stat.pgrp == 42


def test_forked_children_found_and_pss_below_rss(spawn: Spawn) -> None:
    proc = spawn(FORKED_TREE)
    samples = unlimited_tracker(proc.pid).sample()
    assert [s.role for s in samples] == ["main", "child", "child", "child"]
    assert all(s.ppid == proc.pid for s in samples[1:])
    rss = sum(s.rss_bytes or 0 for s in samples)
    pss = sum(s.pss_bytes or 0 for s in samples)
    assert rss > 4 * 64 * MiB  # each process maps the 64 MiB shared buffer
    assert pss < rss * 0.6  # PSS counts the shared pages once across the four
    for child in samples[1:]:
        assert child.uss_bytes is not None and child.uss_bytes >= 16 * MiB


@pytest.mark.skipif(shutil.which("smem") is None, reason="smem is not installed (apt-get install smem)")
def test_pss_and_uss_agree_with_smem(spawn: Spawn) -> None:
    proc = spawn(FORKED_TREE)
    ours = {s.pid: s for s in unlimited_tracker(proc.pid).sample()}
    out = subprocess.run(
        ["smem", "-H", "-c", "pid uss pss"], capture_output=True, text=True, check=True
    ).stdout
    theirs = {
        int(p): (int(u) * 1024, int(s) * 1024) for p, u, s in (line.split() for line in out.splitlines())
    }
    for pid, sample in ours.items():
        uss, pss = theirs[pid]
        assert sample.pss_bytes == pytest.approx(pss, rel=0.05, abs=ORACLE_SLACK), pid
        assert sample.uss_bytes == pytest.approx(uss, rel=0.05, abs=ORACLE_SLACK), pid
        assert sample.uss_bytes is not None and sample.uss_bytes > 16 * MiB  # 5% is the bound that matters


def test_grandchildren_are_in_the_tree(spawn: Spawn) -> None:
    proc = spawn(
        """
        import os, time
        if os.fork() == 0:           # like a forkserver: workers are grandchildren
            if os.fork() == 0:
                time.sleep(120); os._exit(0)
            time.sleep(120); os._exit(0)
        time.sleep(0.5)
        print("READY", flush=True)
        time.sleep(120)
        """
    )
    samples = unlimited_tracker(proc.pid).sample()
    assert len(samples) == 3
    middle = next(s for s in samples if s.ppid == proc.pid)
    assert any(s.ppid == middle.pid for s in samples)


def test_zombie_child_is_reported_as_zombie_with_no_memory(spawn: Spawn) -> None:
    proc = spawn(
        """
        import os, time
        child = os.fork()
        if child == 0:
            os._exit(3)
        time.sleep(0.5)              # never reaped: the child stays a zombie
        print("READY", flush=True)
        time.sleep(120)
        """
    )
    samples = unlimited_tracker(proc.pid).sample()
    zombie = next(s for s in samples if s.role != "main")
    assert zombie.state == "Z"
    assert zombie.rss_bytes is None and zombie.pss_bytes is None and zombie.uss_bytes is None
    assert "zombie" in zombie.unavailable["memory"]


def test_processes_vanishing_mid_sample_never_break_a_sample(spawn: Spawn) -> None:
    proc = spawn(
        """
        import subprocess, time
        print("READY", flush=True)
        while True:                   # a storm of children that live a few milliseconds
            subprocess.run(["true"])
        """
    )
    tracker = ProcessTracker(proc.pid, SmapsBudget(unlimited=True))
    seen_children = 0
    for _ in range(150):
        samples = tracker.sample()
        assert samples[0].pid == proc.pid and samples[0].role == "main"
        for s in samples:
            assert s.state and s.start_time > 0
        seen_children += len(samples) - 1
    assert seen_children > 0  # the race really happened: children were seen, then gone
    assert tracker.tracked_count <= 3


def test_exited_and_reaped_child_leaves_the_tree(spawn: Spawn) -> None:
    proc = spawn(
        """
        import subprocess, sys, time
        child = subprocess.Popen(["sleep", "120"])
        print("READY", flush=True)
        sys.stdin.readline()
        child.kill(); child.wait()
        print("DONE", flush=True)
        time.sleep(120)
        """
    )
    tracker = unlimited_tracker(proc.pid)
    assert len(tracker.sample()) == 2
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "DONE"
    assert [s.pid for s in tracker.sample()] == [proc.pid]


def test_orphaned_children_stay_tracked_after_the_target_dies(spawn: Spawn) -> None:
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
    tracker = unlimited_tracker(proc.pid)
    children = {s.pid for s in tracker.sample()} - {proc.pid}
    proc.kill()
    proc.wait()
    samples = tracker.sample()
    assert tracker.target_state() is None
    assert {s.pid for s in samples} == children  # reparented, still watched
    assert all(s.ppid != proc.pid for s in samples)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_cpu_and_io_rates_come_from_real_work(spawn: Spawn, tmp_path: object) -> None:
    proc = spawn(
        """
        import os, time
        print("READY", flush=True)
        fd = os.open("/tmp", os.O_TMPFILE | os.O_WRONLY)
        end = time.time() + 120
        while time.time() < end:      # busy CPU and real writes that reach the block layer
            os.write(fd, b"x" * 1048576)
            os.fsync(fd)
        """
    )
    # fds recounted every tick: the child opens its file after READY, maybe after the first count
    tracker = ProcessTracker(proc.pid, SmapsBudget(unlimited=True), cadence=Cadence(fd_refresh_s=0.0))
    first = tracker.sample()[0]
    assert first.cpu_percent is None and first.write_bytes_per_s is None  # no interval yet
    cpu_before, wall_before = _cpu_seconds(proc.pid), time.monotonic()
    time.sleep(1.0)
    second = tracker.sample()[0]
    # compared with the kernel's own count over the same second, not with a fixed share: on a
    # loaded machine the writer gets less CPU, and the figure must follow what it really got
    oracle = 100 * (_cpu_seconds(proc.pid) - cpu_before) / (time.monotonic() - wall_before)
    assert second.cpu_percent is not None and second.cpu_percent > 0.5 * oracle > 0.5, (second, oracle)
    assert second.write_bytes_per_s is not None and second.write_bytes_per_s > 0
    assert second.num_threads == 1 and second.num_fds is not None and second.num_fds >= 4


def test_major_faults_per_second_are_the_kernels_count(spawn: Spawn, tmp_path: Path) -> None:
    """Pages read back in (a mapped file evicted from the page cache, read again): the rate is
    the kernel's own majflt over the same interval, as /proc/PID/stat says it."""
    data = tmp_path / "pages.bin"
    data.write_bytes(os.urandom(64 * 1024 * 1024))
    proc = spawn(
        f"""
        import mmap, os, time
        fd = os.open({str(data)!r}, os.O_RDONLY)
        os.fsync(fd)  # written just now: dirty pages would stay in the cache
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        m.madvise(mmap.MADV_RANDOM)  # no read-ahead: one fault per page touched
        print("READY", flush=True)
        end = time.time() + 120
        while time.time() < end:  # evict the file's pages, then touch each: a major fault per page
            m.madvise(mmap.MADV_DONTNEED)  # unmapped first: the page cache drops no mapped page
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            for i in range(0, len(m), 4096):
                m[i]
        """
    )

    def majflt() -> int:
        return parse_stat(Path(f"/proc/{proc.pid}/stat").read_bytes()).major_faults

    tracker = ProcessTracker(proc.pid, SmapsBudget(unlimited=True))
    assert tracker.sample()[0].major_faults_per_s is None  # no interval yet
    before, wall_before = majflt(), time.monotonic()
    time.sleep(1.0)
    second = tracker.sample()[0]
    oracle = (majflt() - before) / (time.monotonic() - wall_before)
    assert oracle > 20, oracle  # the job really faults pages in
    assert second.major_faults_per_s is not None and 0.5 * oracle < second.major_faults_per_s < 2 * oracle, (
        second.major_faults_per_s,
        oracle,
    )


def test_reused_pid_is_a_new_process(spawn: Spawn) -> None:
    """Kill a child, make the kernel hand its pid to a new child, and check nothing carries over."""
    proc = spawn(
        """
        import subprocess, sys
        child = subprocess.Popen(["sh", "-c", "while :; do :; done"])
        print("READY", flush=True)
        print(child.pid, flush=True)
        sys.stdin.readline()
        child.kill(); child.wait()
        for attempt in range(20):
            with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
                fh.write(str(child.pid - 1))
            new = subprocess.Popen(["sleep", "120"])
            if new.pid == child.pid:
                break
            new.kill(); new.wait()
        print("REUSED" if new.pid == child.pid else "MISSED", flush=True)
        sys.stdin.readline()
        """
    )
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("needs root to steer pid allocation through ns_last_pid")
    assert proc.stdin is not None and proc.stdout is not None
    child_pid = int(proc.stdout.readline())
    tracker = unlimited_tracker(proc.pid)
    tracker.sample()
    time.sleep(0.3)
    before = next(s for s in tracker.sample() if s.pid == child_pid)
    assert before.cpu_percent is not None and before.cpu_percent > 5  # the busy loop
    proc.stdin.write("\n")
    proc.stdin.flush()
    if proc.stdout.readline().strip() != "REUSED":
        pytest.skip("another process took the pid first")
    time.sleep(0.05)
    after = next(s for s in tracker.sample() if s.pid == child_pid)
    assert after.start_time != before.start_time
    assert after.comm == "sleep"
    assert after.cpu_percent is None  # a new identity: no rate from the old process's counters
    assert after.pss_bytes is not None  # read fresh, not carried over


def test_handle_of_a_reaped_process_never_reopens_a_reused_pid(spawn: Spawn) -> None:
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(120)')
    handle = ProcHandle(proc.pid)
    proc.kill()
    proc.wait()
    with pytest.raises(ProcessGone):
        handle.stat()
    handle.close()
    with pytest.raises(ProcessGone):
        handle.read("status")


def test_other_users_process_gives_reasons_not_crashes(spawn: Spawn) -> None:
    """Sample a root-owned process from a child that dropped to uid 65534 (nobody)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another uid")
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(120)')
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            sample = ProcessTracker(proc.pid, SmapsBudget(unlimited=True)).sample()[0]
            report = repr((sample.rss_bytes, sample.pss_bytes, sample.read_bytes, dict(sample.unavailable)))
            os.write(write_end, report.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as fh:
        report = fh.read()
    os.waitpid(child, 0)
    rss, pss, read_bytes, unavailable = eval(report)  # our own repr of plain values
    assert rss is not None and rss > 0  # status is world-readable
    assert pss is None and read_bytes is None
    assert unavailable["smaps"] == "permission denied"
    assert unavailable["io"] == "permission denied"


def test_copy_on_read_growth_is_refreshed_promptly_under_the_budget(spawn: Spawn) -> None:
    """RSS stays flat while a forked child copies shared pages; its faults make dlmon re-read PSS
    within seconds, not at the 10 s steady refresh."""
    proc = spawn(
        """
        import os, sys, time
        shared = bytearray(96 * 1024 * 1024)
        for i in range(0, len(shared), 4096):
            shared[i] = 1
        if os.fork() == 0:
            time.sleep(1.5)
            for i in range(0, len(shared), 4096):   # ~24 MiB/s of copy-on-write, RSS unchanged
                shared[i] = 2
                if i % (1024 * 4096) == 0:
                    time.sleep(0.04)
            time.sleep(120)
            os._exit(0)
        print("READY", flush=True)
        time.sleep(120)
        """
    )
    tracker = ProcessTracker(proc.pid)  # the default budget, not unlimited
    first = {s.pid: s for s in tracker.sample()}
    child_pid = next(pid for pid in first if pid != proc.pid)
    start_uss = first[child_pid].uss_bytes
    assert start_uss is not None and start_uss < 8 * MiB
    end = time.monotonic() + 4.5
    while time.monotonic() < end:
        time.sleep(0.5)
        child = next(s for s in tracker.sample() if s.pid == child_pid)
    assert child.rss_bytes is not None and first[child_pid].rss_bytes is not None
    assert abs(child.rss_bytes - first[child_pid].rss_bytes) < 4 * MiB  # RSS is blind to it
    assert child.uss_bytes is not None and child.uss_bytes > start_uss + 32 * MiB
    assert child.pss_age_s is not None and child.pss_age_s <= 2.0  # moved: due after 1 s; ticks 0.5 s


def test_one_off_reads_by_path_agree_with_the_handle_and_give_none_once_gone(
    spawn: Spawn, tmp_path: Path
) -> None:
    """The reads launch, export and the CLI make through collect.procfs (no handle, no held fd)."""
    from dlmon.collect import procfs

    mark = f"DLMON_TEST_MARK={os.getpid()}-{time.monotonic_ns()}"
    name, value = mark.split("=", 1)
    proc = spawn('print("READY", flush=True)\nimport time; time.sleep(60)', env={name: value})
    handle = ProcHandle(proc.pid)
    try:
        assert procfs.start_ticks(proc.pid) == handle.start_time
        stat = procfs.read_stat(proc.pid)
        assert stat is not None and stat.ppid == os.getpid() and stat.start_time == handle.start_time
        assert stat.state not in DEAD_STATES and stat.pgrp == proc.pid  # spawn: its own group
    finally:
        handle.close()
    assert procfs.thread_group_of(proc.pid) == proc.pid
    assert procfs.real_uid(proc.pid) == os.getuid()
    assert procfs.exe_path(proc.pid) == procfs.exe_path(os.getpid()) is not None  # both python
    assert procfs.smaps_unreadable(proc.pid) is None
    cmdline = procfs.read_cmdline(proc.pid)
    assert (proc.pid, cmdline) in procfs.group_members(proc.pid)  # its own session and group
    assert procfs.processes_with_environ(mark.encode()) == [(proc.pid, cmdline)]
    assert procfs.processes_with_environ(mark.encode(), exclude=proc.pid) == []

    proc.kill()
    proc.wait()
    assert procfs.read_stat(proc.pid) is None
    assert procfs.start_ticks(proc.pid) is None and procfs.thread_group_of(proc.pid) is None
    assert procfs.real_uid(proc.pid) is None and procfs.exe_path(proc.pid) is None
    assert procfs.group_members(proc.pid) == [] and procfs.processes_with_environ(mark.encode()) == []

    assert procfs.read_boot_time(str(tmp_path)) is None  # no stat file
    (tmp_path / "stat").write_bytes(b"cpu  1 2 3\nbtime 1700000000\n")
    assert procfs.read_boot_time(str(tmp_path)) == procfs.boot_time(str(tmp_path)) == 1_700_000_000.0
    (tmp_path / "stat").write_bytes(b"cpu  1 2 3\n")
    assert procfs.read_boot_time(str(tmp_path)) is None


def test_thread_group_of_a_thread_id_is_its_process(spawn: Spawn) -> None:
    """/proc/TID exists for a thread too (unlisted): its Tgid names the process it belongs to,
    which ``dlmon attach TID`` points the user to."""
    from dlmon.collect import procfs

    proc = spawn(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        'print("READY", flush=True)\ntime.sleep(60)'
    )
    tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
    assert tids  # the thread started before READY
    assert procfs.thread_group_of(tids[0]) == proc.pid
    assert procfs.thread_group_of(proc.pid) == proc.pid


def test_real_uid_is_the_first_number_of_the_status_uid_line(tmp_path: Path) -> None:
    """Read by collect's own status parser, under ``proc_root`` like its neighbours."""
    from dlmon.collect import procfs

    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_bytes(
        b"Name:\tpython\nTgid:\t42\nUid:\t1000\t1001\t1002\t1003\nGid:\t5\n"
    )
    assert procfs.real_uid(42, str(tmp_path)) == 1000
    assert procfs.real_uid(43, str(tmp_path)) is None  # gone
    assert procfs.thread_group_of(42, str(tmp_path)) == 42


def test_a_zombie_is_dead_to_read_stat() -> None:
    """model.format.DEAD_STATES holds str, as StatFields.state and ProcessSample.state do: the
    one-off reads (group_members, processes_with_environ, run's leftovers) skip a zombie."""
    from dlmon.collect import procfs

    proc = subprocess.Popen(["true"], start_new_session=True)  # not waited for: a zombie
    try:
        deadline = time.monotonic() + 30
        while (stat := procfs.read_stat(proc.pid)) is not None and stat.state not in DEAD_STATES:
            assert time.monotonic() < deadline, stat
            time.sleep(0.01)
        assert stat is not None and stat.state == "Z"
        assert procfs.group_members(proc.pid) == []  # its own group, of one zombie
    finally:
        proc.wait()


def test_seen_processes_names_the_live_ones_it_saw_not_a_reused_pid_nor_a_zombie(spawn: Spawn) -> None:
    """``dlmon run``'s leftovers: a process the watch saw in the tree is named at the end while
    it lives, by pid and start time (read_stat), so a zombie or a reused pid is not."""
    import dataclasses

    from dlmon.collect import procfs
    from dlmon.launch.session import SeenProcesses
    from support.ui import make_snapshot

    live = spawn('print("READY", flush=True)\nimport time; time.sleep(60)')
    reused = spawn('print("READY", flush=True)\nimport time; time.sleep(60)')
    zombie = subprocess.Popen(["true"], start_new_session=True)
    try:
        while (stat := procfs.read_stat(zombie.pid)) is not None and stat.state != "Z":
            time.sleep(0.01)
        snap = make_snapshot(zombie=False)
        template = snap.processes[1]
        procs = tuple(
            dataclasses.replace(template, pid=pid, start_time=start)
            for pid, start in (
                (live.pid, procfs.start_ticks(live.pid)),
                (reused.pid, (procfs.start_ticks(reused.pid) or 0) + 1),  # another process's start
                (zombie.pid, procfs.start_ticks(zombie.pid)),
            )
        )
        seen = SeenProcesses(training_pid=os.getpid())
        seen(dataclasses.replace(snap, processes=procs))
        assert seen.alive() == [(live.pid, procfs.read_cmdline(live.pid))]
    finally:
        zombie.wait()
