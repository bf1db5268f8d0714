"""Second-reader regressions for the death/stall machinery that runs in the training process
and the collectors that read it (issue 9): each one failed before its fix."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlmon.collect import kernel
from dlmon.collect.kernel import KernelLog

OOM_LINE = (
    "6,1234,{usec},-;Out of memory: Killed process {pid} (python) total-vm:278712kB, "
    "anon-rss:65280kB, file-rss:6612kB, shmem-rss:0kB, UID:0 pgtables:196kB oom_score_adj:0\n"
)


def _append_record(path: Path, pid: int) -> None:
    usec = int(time.monotonic() * 1e6)
    with open(path, "a") as f:
        f.write(OOM_LINE.format(usec=usec, pid=pid))


def test_kernel_log_keeps_a_kill_of_a_job_pid_and_drops_one_of_a_reused_pid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pid the job used long ago may be another process's now: its OOM kill is not the job's.

    (Before: any pid ever seen in the tree, up to 8192 of them, counted as the job's for ever, and
    an OOM kill of an unrelated process that got a reused pid became a 'worker OOM-killed'.)"""
    kmsg = tmp_path / "kmsg"  # a regular file read one record per tick, like /dev/kmsg
    kmsg.write_text("")
    # a real process of the "job" that has ended: its pid is free for reuse
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(kernel, "SEEN_GRACE_S", 0.5, raising=False)
    log = KernelLog(str(kmsg))
    assert log.unavailable is None
    log.sample([os.getpid(), gone.pid])
    _append_record(kmsg, os.getpid())  # killed while in the tree: the job's
    events = log.sample([os.getpid()])
    assert [e.pid for e in events] == [os.getpid()]
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        log.sample([os.getpid()])
        time.sleep(0.1)
    _append_record(kmsg, gone.pid)  # long after it left the tree: someone else's process now
    events = log.sample([os.getpid()])
    assert gone.pid not in [e.pid for e in events], events
    log.close()
