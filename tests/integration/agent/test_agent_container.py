"""dlmon on the host, the job in a container: real training jobs under ``unshare`` (new pid and
mount namespaces, a private /tmp), read from the host by the pid the host sees.

The agent inside names its socket by its own pid (1: the job is its namespace's first process)
and serves in its own /tmp; dlmon finds it under /proc/PID/root and reports the workers by
their host pids. Needs root (unshare); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlmon.collect import procfs
from dlmon.collect.agent_client import AgentClient, AgentReading
from dlmon.collect.stacks import StallProbe
from support.paths import ROOT, TESTS

SCRIPT = str(TESTS / "agent_scripts" / "contained.py")

needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)"
)


class Contained:
    """``python contained.py`` as pid 1 of a new pid namespace; ``private_tmp``: in a new mount
    namespace too, with a tmpfs on /tmp (the host cannot see the agent's directory at /tmp)."""

    def __init__(
        self, private_tmp: bool, setup: str = "true", env_extra: dict[str, str] | None = None
    ) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "DLMON_AGENT_DISABLE")}
        env["PYTHONPATH"] = str(ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(env_extra or {})
        if private_tmp:  # ``setup``: shell commands run inside, on the private /tmp, before the job
            inner = [
                "sh",
                "-c",
                f'mount -t tmpfs tmpfs /tmp && {setup} && exec "{sys.executable}" "{SCRIPT}"',
            ]
            args = ["unshare", "--pid", "--mount", "--fork", "--mount-proc", "--kill-child", *inner]
        else:  # the host's file system and /proc: only the pids differ
            args = ["unshare", "--pid", "--fork", "--kill-child", sys.executable, SCRIPT]
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.started = self.expect("started")
        kids = Path(f"/proc/{self.p.pid}/task/{self.p.pid}/children").read_text().split()
        assert len(kids) == 1, kids
        self.pid = int(kids[0])  # the job as the host sees it

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith("@@ "):
                self.events.put(json.loads(line[3:]))

    def expect(self, ev: str, timeout: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                err = self.p.stderr.read() if self.p.poll() is not None and self.p.stderr else ""
                pytest.fail(f"no {ev!r} from the contained job within {timeout}s; rc={self.p.poll()} {err}")
            if got["ev"] == ev:
                return got

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()  # --kill-child: pid 1 inside goes, and with it its namespace
        self.p.wait(30)


@pytest.fixture(params=[True, False], ids=["private-tmp", "own-fs"])
def job(request: pytest.FixtureRequest) -> Iterator[Contained]:
    c = Contained(private_tmp=request.param)
    try:
        yield c
    finally:
        c.close()


def read_until_loaders(client: AgentClient, pid: int, timeout: float = 30.0) -> AgentReading:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = client.poll(pid)
        if got is not None and got.loaders and all(got.loaders[0].worker_pids):
            return got
        time.sleep(0.2)
    pytest.fail(f"no loaders from the agent of the contained job {pid} within {timeout}s")


def host_pids_of(inner: list[int], host_pid: int) -> list[int]:
    """The host pids of the job's children named ``inner`` inside (by their NSpid), in order."""
    kids = [int(p) for p in Path(f"/proc/{host_pid}/task/{host_pid}/children").read_text().split()]
    by_inner = {}
    for kid in kids:
        ns = procfs.nspids(kid)
        assert ns is not None and len(ns) == 2
        by_inner[ns[-1]] = kid
    return [by_inner[p] for p in inner]


@needs_unshare
def test_host_reads_the_agent_of_a_contained_job_with_host_pids(job: Contained) -> None:
    assert job.started["pid"] == 1  # the agent's name for itself: its socket is 1.sock
    workers = host_pids_of(job.started["worker_pids"], job.pid)
    assert job.started["worker_pids"] != workers  # the test means something: the pids differ

    client = AgentClient()
    reading = read_until_loaders(client, job.pid)
    assert reading.pids == (job.pid,)
    (loader,) = reading.loaders
    assert loader.pid == job.pid
    assert list(loader.worker_pids) == workers  # host pids, in worker-id order
    for pid in loader.worker_pids:
        assert Path(f"/proc/{pid}").exists()


@needs_unshare
def test_record_from_the_host_names_the_workers_by_host_pid(job: Contained, tmp_path: Path) -> None:
    workers = host_pids_of(job.started["worker_pids"], job.pid)
    rec = tmp_path / "rec.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "dlmon", "record", str(job.pid), "-o", str(rec), "--duration", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    snaps = [json.loads(line) for line in rec.read_text().splitlines()]
    last = [s for s in snaps if s.get("loaders")][-1]
    (loader,) = last["loaders"]
    assert loader["worker_pids"] == workers
    assert loader["batches_per_s"] > 0
    rows = {p["pid"]: p for p in last["processes"]}
    assert [rows[pid]["worker_id"] for pid in workers] == [0, 1]  # the agent's worker ids on host rows


@needs_unshare
def test_a_killed_worker_is_reported_by_its_host_pid() -> None:
    job = Contained(private_tmp=True)
    try:
        client = AgentClient()
        reading = read_until_loaders(client, job.pid)
        victim = reading.loaders[0].worker_pids[0]
        os.kill(victim, signal.SIGKILL)
        job.expect("worker_lost")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not client.known_deaths():
            client.poll(job.pid)
            time.sleep(0.2)
        deaths = client.known_deaths()
        assert [(d.pid, d.signal, d.reported_by) for d in deaths] == [(victim, signal.SIGKILL, job.pid)]
    finally:
        job.close()


@needs_unshare
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv(1)")
def test_a_container_out_of_reach_is_said_in_one_line(tmp_path: Path) -> None:
    """dlmon without CAP_SYS_PTRACE (as in a container) may not read the job's /proc/PID/root:
    ``record`` and ``attach --once`` say why in one line, on stderr and in the snapshot."""
    job = Contained(private_tmp=True)
    try:
        rec = tmp_path / "rec.jsonl"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        dlmon = ["setpriv", "--bounding-set=-sys_ptrace", sys.executable, "-m", "dlmon"]
        recorded = subprocess.run(
            [*dlmon, "record", str(job.pid), "-o", str(rec), "--duration", "3"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        once = subprocess.run(
            [*dlmon, "attach", str(job.pid), "--once", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        job.close()
    why = (
        f"agent unreachable: pid {job.pid} runs in a container (pid 1 there) whose file system "
        f"(/proc/{job.pid}/root) dlmon may not read (permission denied), so its agent's socket cannot "
        "be looked for: run dlmon inside the container, or on the host as the job's user or as root "
        "with CAP_SYS_PTRACE"
    )
    for done in (recorded, once):
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        assert [line for line in done.stderr.splitlines() if "agent unreachable" in line] == [f"dlmon: {why}"]
    snaps = [json.loads(line) for line in rec.read_text().splitlines()]
    assert any(s.get("agent_note") == why for s in snaps)
    assert json.loads(once.stdout)["agent_note"] == why


@needs_unshare
def test_worker_stacks_are_read_through_the_container(job: Contained) -> None:
    """A stalled loader's worker stacks: the workers write them as ``<their own pid>.stack`` in the
    agent's directory inside; dlmon signals them by host pid and reads the files under /proc/PID/root."""
    client = AgentClient()
    workers = read_until_loaders(client, job.pid).loaders[0].worker_pids
    assert [client.agent_pid_of(job.pid, pid) for pid in workers] == job.started["worker_pids"]
    probe = StallProbe(client)
    stacks = probe._worker_stacks([(job.pid, wid, pid) for wid, pid in enumerate(workers)])
    assert probe.error is None
    assert sorted((s.pid, s.worker_id) for s in stacks) == [(workers[0], 0), (workers[1], 1)]
    assert all(s.frames for s in stacks)


@needs_unshare
def test_symlinks_inside_the_container_are_followed_within_it(tmp_path: Path) -> None:
    """The container's file system is the job's to shape: an absolute symlink in it means a path
    of the container, never of the host. ``XDG_RUNTIME_DIR`` points through a planted link at a
    host directory holding a socket named as the agent's: dlmon must not connect to it. ``TMPDIR``
    is a link to another directory inside: the agent serves there, and dlmon must find it."""
    host_dir = tmp_path / "host" / "dlmon"  # what a naive walk of /proc/PID/root/evil/dlmon reaches
    host_dir.mkdir(parents=True, mode=0o700)
    bait = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bait.bind(str(host_dir / "1.sock"))
    bait.listen(8)
    bait.setblocking(False)
    setup = f"ln -s {tmp_path / 'host'} /tmp/evil && mkdir -m 1777 /tmp/real && ln -s /tmp/real /tmp/link"
    job = Contained(
        private_tmp=True, setup=setup, env_extra={"XDG_RUNTIME_DIR": "/tmp/evil", "TMPDIR": "/tmp/link"}
    )
    try:
        client = AgentClient()
        reading = read_until_loaders(client, job.pid)
        assert list(reading.loaders[0].worker_pids) == host_pids_of(job.started["worker_pids"], job.pid)
        with pytest.raises(BlockingIOError):
            bait.accept()  # nobody came: the host's socket was never reached
    finally:
        job.close()
        bait.close()


def _each_call_a_second_later() -> Any:
    ticks = iter(range(0, 10**6))
    return lambda: float(next(ticks))


def _fake_process(proc: Path, pid: int, nspid: tuple[int, ...], children: tuple[int, ...] = ()) -> None:
    (proc / str(pid) / "task" / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "status").write_text(f"Name:\tpython\nNSpid:\t{' '.join(map(str, nspid))}\n")
    (proc / str(pid) / "task" / str(pid) / "children").write_text(" ".join(map(str, children)))


def test_a_container_pid_reused_by_a_new_worker_is_mapped_again(tmp_path: Path) -> None:
    """Pid 45 inside was worker 200 on the host; a new worker got 45 again as host pid 300: the
    mapping follows (a remembered pair is checked against NSpid, not trusted)."""
    from dlmon.collect.agent_place import HostPids

    proc = tmp_path / "proc"
    _fake_process(proc, 100, (100, 1), children=(200,))
    _fake_process(proc, 200, (200, 45))
    host = HostPids(100, 1, proc_root=str(proc), clock=_each_call_a_second_later())
    host.learn([45])
    assert host.host_pid(45) == 200
    shutil.rmtree(proc / "200")
    (proc / "100" / "task" / "100" / "children").write_text("300")
    _fake_process(proc, 300, (300, 45))
    host.learn([45])
    assert host.host_pid(45) == 300
    assert host.agent_pid(300) == 45


def test_links_in_a_container_root_resolve_within_it(tmp_path: Path) -> None:
    """Runs without root: a directory stands for /proc/PID/root."""
    from dlmon.collect.agent_place import resolve_in_root

    root = tmp_path / "root"
    (root / "real").mkdir(parents=True)
    (root / "abs").symlink_to("/real")  # the container's /real, not the host's
    (root / "rel").symlink_to("real/../real")
    (root / "up").symlink_to("../../../..")  # never above the root
    (root / "loop").symlink_to("/loop")
    (root / "out").symlink_to(str(tmp_path))  # the host's tmp_path: under the root, there is none
    r = str(root)
    assert resolve_in_root(r, "/abs") == f"{r}/real"
    assert resolve_in_root(r, "/rel") == f"{r}/real"
    assert resolve_in_root(r, "/up/real") == f"{r}/real"
    assert resolve_in_root(r, "/loop") is None
    assert resolve_in_root(r, "/out/root") is None


def test_a_container_cannot_make_a_path_resolution_long(tmp_path: Path) -> None:
    """40 links of ~4000 characters each would be ~30,000 lstat() calls on the sampler's thread
    every few seconds: a hostile container's TMPDIR is resolved as far as a kernel would go."""
    from dlmon.collect.agent_place import resolve_in_root

    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "l0").symlink_to("d")
    for i in range(1, 40):  # each link walks down and up again, ~800 parts, then on to the previous
        (root / f"l{i}").symlink_to("d/../" * 800 + f"l{i - 1}")
    assert resolve_in_root(str(root), "/l39") is None
    assert resolve_in_root(str(root), "/d" + "/." * 3000) is None  # longer than PATH_MAX
    assert resolve_in_root(str(root), "/l0/../" + "d/../" * 100 + "d") == f"{root}/d"  # an ordinary one


def test_a_host_pid_gone_to_another_container_is_not_trusted(tmp_path: Path) -> None:
    """Worker 45 inside was host pid 200; it died, and host pid 200 went to a process of another
    container that is pid 45 there too (containers' pids are small alike). Our new worker 45 is
    host pid 300: the mapping follows it (same NSpid tail, but another pid namespace)."""
    from dlmon.collect.agent_place import HostPids

    proc = tmp_path / "proc"
    _fake_process(proc, 100, (100, 1), children=(200,))
    _fake_process(proc, 200, (200, 45))
    ours, theirs = tmp_path / "ns-ours", tmp_path / "ns-theirs"
    ours.write_text("")
    theirs.write_text("")
    for pid in (100, 200):
        (proc / str(pid) / "ns").mkdir()
        os.link(ours, proc / str(pid) / "ns" / "pid")  # one inode: one pid namespace
    host = HostPids(100, 1, proc_root=str(proc), clock=_each_call_a_second_later())
    host.learn([45])
    assert host.host_pid(45) == 200
    shutil.rmtree(proc / "200")
    _fake_process(proc, 200, (200, 45))  # another container's process, not our job's child
    (proc / "200" / "ns").mkdir()
    os.link(theirs, proc / "200" / "ns" / "pid")
    (proc / "100" / "task" / "100" / "children").write_text("300")
    _fake_process(proc, 300, (300, 45))
    (proc / "300" / "ns").mkdir()
    os.link(ours, proc / "300" / "ns" / "pid")
    host.learn([45])
    assert host.host_pid(45) == 300


@needs_unshare
def test_a_stack_file_swapped_for_a_link_to_a_host_file_is_not_read(tmp_path: Path) -> None:
    """The agent's directory is the container's to write in: a worker's ``<pid>.stack`` replaced
    by a link to a host file (with a valid header) must not be followed by dlmon, which runs as
    root on the host: the file's lines would be shown as the worker's stack."""
    job = Contained(private_tmp=True)
    try:
        client = AgentClient()
        workers = read_until_loaders(client, job.pid).loaders[0].worker_pids
        directory = client.stack_dir(job.pid)
        assert directory is not None
        path = Path(directory) / f"{job.started['worker_pids'][0]}.stack"
        header = path.read_text().split("\n", 1)[0]
        secret = tmp_path / "secret"
        fake = 'Thread 0x1 (most recent call first):\n  File "/root/secret.py", line 1 in leaked_secret\n'
        secret.write_text(header + "\n" + " " * 4096 + "\n" + fake)
        path.unlink()
        path.symlink_to(secret)
        stacks = StallProbe(client)._worker_stacks([(job.pid, 0, workers[0])])
        assert not [f for s in stacks for f in s.frames if f.function == "leaked_secret"]
    finally:
        job.close()


@needs_unshare
def test_a_host_pid_reused_by_another_contained_job_is_mapped_anew() -> None:
    """dlmon still holds the pid mapping of a contained job that is gone (its agent was pid 7
    there) when the host pid is reused by another contained job whose agent is pid 1: the new
    agent's replies are read under its own name, not dropped as another pid's."""
    from dlmon.collect.agent_place import HostPids

    job = Contained(private_tmp=True)
    try:
        client = AgentClient()
        client._host_pids[job.pid] = HostPids(job.pid, 7)  # as left by the job that had the pid before
        reading = read_until_loaders(client, job.pid)
        assert reading.pids == (job.pid,)
    finally:
        job.close()


@needs_unshare
def test_a_journal_directory_swapped_after_the_connect_is_not_read(tmp_path: Path) -> None:
    """The agent's directory was checked and its socket's owner proven at the connect; the death
    journal is read by path on every poll after. The container renames a directory on that path
    and puts a link to a host directory in its place: dlmon must not read the journal found there
    (as root it would show another job's deaths, and their last words, as this one's)."""
    job = Contained(private_tmp=True, setup="mkdir -m 1777 /tmp/t", env_extra={"TMPDIR": "/tmp/t"})
    try:
        client = AgentClient()
        read_until_loaders(client, job.pid)
        elsewhere = tmp_path / "elsewhere"
        (elsewhere / "dlmon-0").mkdir(parents=True, mode=0o700)
        fake = {"pid": 4242, "worker_id": 0, "loader_id": 1, "signal": 9, "unix_time": time.time()}
        (elsewhere / "dlmon-0" / "1.deaths.jsonl").write_text(json.dumps(fake) + "\n")
        inside = Path(f"/proc/{job.pid}/root/tmp")
        (inside / "t").rename(inside / "t-old")
        (inside / "t").symlink_to(elsewhere)
        for _ in range(3):
            client.poll(job.pid)
        assert [d.pid for d in client.known_deaths()] == []
    finally:
        job.close()


@needs_unshare
def test_a_stack_directory_swapped_after_the_connect_is_not_read(tmp_path: Path) -> None:
    """As for the journal: the directory on the path to the workers' stack files is replaced by a
    link to a host directory whose ``<pid>.stack`` has a valid header and is large: dlmon, as root,
    would cut that host file to its header (as it does a worker's own grown stack file)."""
    job = Contained(private_tmp=True, setup="mkdir -m 1777 /tmp/t", env_extra={"TMPDIR": "/tmp/t"})
    try:
        client = AgentClient()
        workers = read_until_loaders(client, job.pid).loaders[0].worker_pids
        inside = Path(f"/proc/{job.pid}/root/tmp")
        name = f"{job.started['worker_pids'][0]}.stack"
        header = (inside / "t" / "dlmon-0" / name).read_text().split("\n", 1)[0]
        elsewhere = tmp_path / "elsewhere"
        (elsewhere / "dlmon-0").mkdir(parents=True, mode=0o700)
        fake = 'Thread 0x1 (most recent call first):\n  File "/root/secret.py", line 1 in leaked_secret\n'
        host_file = elsewhere / "dlmon-0" / name
        host_file.write_text(header + "\n" + fake * 4000)  # over MAX_STACK_FILE
        size = host_file.stat().st_size
        (inside / "t").rename(inside / "t-old")
        (inside / "t").symlink_to(elsewhere)
        stacks = StallProbe(client)._worker_stacks([(job.pid, 0, workers[0])])
        assert host_file.stat().st_size == size
        assert not [f for s in stacks for f in s.frames if f.function == "leaked_secret"]
    finally:
        job.close()


def test_hostile_replies_of_a_contained_agent_are_mapped_without_raising() -> None:
    """The agent in a container is the container's code: what it replies goes through the pid
    mapping before any check of the loaders' shape (and a reply of another protocol version is
    checked for its pid only). Nothing in it may raise on the sampler's thread."""
    from dlmon.collect.agent_place import HostPids, death_line_to_host, to_host

    me = os.getpid()
    host = HostPids(me, 1)
    good: dict[str, Any] = {"v": 1, "pid": 1, "agent_id": "x", "time_ns": 5, "loaders": []}
    hostile: list[dict[str, Any]] = [
        {**good, "loaders": 5},
        {**good, "loaders": "abc"},
        {**good, "loaders": [{"worker_pids": 5}]},
        {**good, "loaders": [{"worker_pids": [True, None, "1", 1]}]},
        {**good, "loaders": [{"iterators": 3}]},
        {**good, "loaders": [{"iterators": [{"worker_pids": 7}]}]},
        {**good, "worker_deaths": 5},
        {**good, "worker_deaths": [{"pid": True}, 5, {"pid": 1}]},
    ]
    for reply in hostile:
        out = to_host(reply, me, host)
        assert out["pid"] == me
    assert to_host({**good, "worker_deaths": [{"pid": 1}]}, me, host)["worker_deaths"] == [{"pid": me}]
    for line in (b"5", b"[", b'{"pid": "1"}', b"[" * 100000):
        assert death_line_to_host(line, host) == line


def test_a_pid_that_is_none_of_the_jobs_processes_is_not_looked_for_every_poll(tmp_path: Path) -> None:
    """A reply naming a worker pid that none of the job's processes has (a worker reaped, or a
    made-up reply) sent dlmon through every thread of every process of the job at each poll."""
    from dlmon.collect.agent_place import WALK_EVERY_S, HostPids

    proc = tmp_path / "proc"
    _fake_process(proc, 100, (100, 1), children=(200,))
    _fake_process(proc, 200, (200, 45))
    now = [0.0]
    host = HostPids(100, 1, proc_root=str(proc), clock=lambda: now[0])
    walks = 0
    walk = host._descendants

    def counted() -> list[int]:
        nonlocal walks
        walks += 1
        return walk()

    host._descendants = counted  # type: ignore[method-assign]
    for _ in range(10):
        host.learn([45, 999])
    assert walks == 1 and host.host_pid(45) == 200
    now[0] += WALK_EVERY_S
    host.learn([46])  # a new worker: found within the interval
    assert walks == 2
