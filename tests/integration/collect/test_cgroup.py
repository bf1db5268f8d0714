"""dlmon.collect.cgroup: v2 from fixture trees, v1 on this machine's real memory hierarchy."""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dlmon.collect.cgroup import (
    NOT_VISIBLE,
    CgroupMemoryReader,
    Mount,
    locate_memory_cgroup,
    parse_mountinfo,
    parse_proc_cgroup,
    read_cgroup_memory,
)
from dlmon.collect.system import read_oom_kill_count
from dlmon.model import CgroupMemory, Pressure
from support.paths import TESTS

FIXTURES = TESTS / "fixtures"
PROC = FIXTURES / "proc"
V2_HOST = FIXTURES / "cgroup_v2" / "host"
V2_CONTAINER = FIXTURES / "cgroup_v2" / "container"
MIB = 1024 * 1024
GIB = 1024 * MIB
V1_UNLIMITED = 9223372036854771712  # PAGE_COUNTER_MAX * 4096, what v1 reports for "no limit"


# --------------------------------------------------------------------------- parsing


def test_parse_proc_cgroup() -> None:
    v2 = parse_proc_cgroup("0::/job.slice/train.scope\n")
    assert (v2.v1_memory_path, v2.v2_path) == (None, "/job.slice/train.scope")
    hybrid = parse_proc_cgroup((PROC / "hybrid" / "4246" / "cgroup").read_text())
    assert hybrid.v1_memory_path == "/user.slice/user-1000.slice/session-2.scope"
    assert hybrid.v2_path == "/user.slice/user-1000.slice/session-2.scope"
    comounted = parse_proc_cgroup("4:cpu,memory:/a\n3:name=systemd:/b\n2:memoryx:/c\n")
    assert comounted.v1_memory_path == "/a"
    assert comounted.v2_path is None


def test_parse_mountinfo() -> None:
    mounts = parse_mountinfo((PROC / "hybrid" / "self" / "mountinfo").read_text())
    assert [m.fstype for m in mounts] == ["cgroup2", "cgroup", "cgroup", "cgroup"]
    memory = [m for m in mounts if "memory" in m.super_options]
    assert memory == [Mount("/", "/sys/fs/cgroup/memory", "cgroup", ("rw", "memory"))]
    # mountinfo escapes spaces as \040; optional fields (shared:N) vary in number
    odd = parse_mountinfo(
        "40 31 0:38 /ctr\\0401 /mnt/my\\040cgroup rw shared:1 master:2 - cgroup2 cgroup2 rw,nsdelegate\n"
        "garbage line\n"
    )
    assert odd == (Mount("/ctr 1", "/mnt/my cgroup", "cgroup2", ("rw", "nsdelegate")),)


# --------------------------------------------------------------------------- v2 fixtures


def test_v2_nested_parent_has_smaller_limit() -> None:
    cg = read_cgroup_memory(4242, proc_root=str(PROC), mount_root=str(V2_HOST))
    assert cg == CgroupMemory(
        version=2,
        path="/job.slice/train.scope",
        limit_bytes=1 * GIB,  # job.slice's 1 GiB, not train.scope's own 2 GiB
        current_bytes=805310464,  # ... compared with job.slice's usage, not train.scope's 805306368
        oom_kill_count=3,  # and job.slice's kills: the limit that kills is job.slice's
        pressure=Pressure(
            io_some_avg10=4.2,
            io_full_avg10=3.9,
            memory_some_avg10=21.3,
            memory_full_avg10=17.8,
            cpu_some_avg10=55.0,
        ),
        working_set_bytes=805310464 - 469762048,  # usage - inactive_file of job.slice's memory.stat
        cache_bytes=536870912,
        inactive_file_bytes=469762048,
        usage_path="/job.slice",
    )


def test_v2_unlimited_is_none() -> None:
    cg = read_cgroup_memory(4243, proc_root=str(PROC), mount_root=str(V2_HOST))
    assert cg is not None
    assert cg.path == "/free.slice/free.scope"
    assert cg.limit_bytes is None
    assert cg.current_bytes == 4091904
    assert cg.oom_kill_count == 0  # a zero is a measurement


def test_v2_path_missing_falls_back_to_mount_root() -> None:
    # /proc/PID/cgroup names the host's path, the container sees its own cgroup at the mount root
    reader = CgroupMemoryReader(4244, proc_root=str(PROC), mount_root=str(V2_CONTAINER))
    assert reader.location is not None
    assert reader.location.fallback
    assert reader.location.directory == str(V2_CONTAINER)
    assert reader.location.ancestors == ()
    cg = reader.read()
    assert cg is not None
    assert (cg.version, cg.path, cg.limit_bytes, cg.current_bytes, cg.oom_kill_count) == (
        2,
        "/",
        512 * MIB,
        256 * MIB,
        1,
    )
    assert cg.pressure is not None and cg.pressure.memory_full_avg10 == 5.0


def test_path_outside_our_namespace_is_not_visible(tmp_path: Path) -> None:
    # the kernel shows a cgroup outside our cgroup namespace as /../..; the mount root is dlmon's
    # own cgroup then, and its limit is the sidecar's, not the target's: say so instead
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "cgroup").write_text("0::/../../job.slice/train.scope\n")
    loc, reason = locate_memory_cgroup(9, proc_root=str(tmp_path), mount_root=str(V2_CONTAINER))
    assert loc is None
    assert reason == NOT_VISIBLE and reason.startswith("cgroup not visible from here")
    reader = CgroupMemoryReader(9, proc_root=str(tmp_path), mount_root=str(V2_CONTAINER))
    assert reader.read() is None and reader.reason == NOT_VISIBLE


def test_v2_located_through_mountinfo(tmp_path: Path) -> None:
    # no mount_root override: the mount point comes from mountinfo
    (tmp_path / "self").mkdir()
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "cgroup").write_text("0::/job.slice/train.scope\n")
    (tmp_path / "self" / "mountinfo").write_text(
        f"25 23 0:24 / {V2_HOST} rw,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
    )
    loc, reason = locate_memory_cgroup(77, proc_root=str(tmp_path))
    assert reason is None and loc is not None
    assert loc.directory == f"{V2_HOST}/job.slice/train.scope"
    assert loc.ancestors == (f"{V2_HOST}/job.slice", str(V2_HOST))
    assert not loc.fallback
    cg = read_cgroup_memory(77, proc_root=str(tmp_path))
    assert cg is not None and cg.limit_bytes == 1 * GIB

    # a mount of a subtree (mountinfo root field /job.slice): the path is taken relative to it,
    # and ancestors above the mount cannot be seen
    (tmp_path / "self" / "mountinfo").write_text(
        f"25 23 0:24 /job.slice {V2_HOST}/job.slice rw - cgroup2 cgroup2 rw\n"
    )
    loc, _ = locate_memory_cgroup(77, proc_root=str(tmp_path))
    assert loc is not None
    assert loc.directory == f"{V2_HOST}/job.slice/train.scope"
    assert loc.ancestors == (f"{V2_HOST}/job.slice",)
    assert loc.path == "/job.slice/train.scope"


def test_missing_process_or_mount(tmp_path: Path) -> None:
    reader = CgroupMemoryReader(999999, proc_root=str(PROC), mount_root=str(V2_HOST))
    assert reader.location is None
    assert reader.read() is None
    assert reader.reason is not None and "999999" in reader.reason
    # /proc/PID/cgroup readable, but no cgroup2 in mountinfo and no override
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "cgroup").write_text("0::/a\n")
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "mountinfo").write_text("22 27 0:21 / /proc rw - proc proc rw\n")
    loc, reason = locate_memory_cgroup(5, proc_root=str(tmp_path))
    assert loc is None and reason is not None and "not mounted" in reason


def _write_v1(d: Path, limit: int, hier: int, usage: int, oom_kill: int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (d / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}\n")
    (d / "memory.stat").write_text(
        f"cache 0\nrss {usage}\nhierarchical_memory_limit {hier}\nhierarchical_memsw_limit {hier}\n"
        f"total_rss {usage}\n"
    )


def test_hybrid_uses_v1_for_memory(tmp_path: Path) -> None:
    v1 = tmp_path / "memory"
    session = v1 / "user.slice" / "user-1000.slice" / "session-2.scope"
    _write_v1(session, limit=2 * GIB, hier=768 * MIB, usage=100 * MIB, oom_kill=4)
    cg = read_cgroup_memory(4246, proc_root=str(PROC / "hybrid"), mount_root=str(v1))
    assert cg == CgroupMemory(
        version=1,
        path="/user.slice/user-1000.slice/session-2.scope",
        limit_bytes=768 * MIB,  # hierarchical_memory_limit: a parent's limit is smaller
        current_bytes=100 * MIB,
        oom_kill_count=4,
        pressure=None,
        usage_path="/user.slice/user-1000.slice/session-2.scope",  # the parents show no files
    )
    _write_v1(session, limit=V1_UNLIMITED, hier=V1_UNLIMITED, usage=1, oom_kill=0)
    cg = read_cgroup_memory(4246, proc_root=str(PROC / "hybrid"), mount_root=str(v1))
    assert cg is not None and cg.limit_bytes is None and cg.oom_kill_count == 0


def test_reader_relocates_when_moved(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "8").mkdir(parents=True)
    (proc / "self").mkdir()
    (proc / "self" / "mountinfo").write_text("25 23 0:24 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    root = tmp_path / "cg"
    for name, limit in (("a", "1000000"), ("b", "max")):
        (root / name).mkdir(parents=True)
        (root / name / "memory.max").write_text(limit + "\n")
        (root / name / "memory.current").write_text("4096\n")
    (proc / "8" / "cgroup").write_text("0::/a\n")
    reader = CgroupMemoryReader(8, proc_root=str(proc), mount_root=str(root), relocate_interval_s=0.0)
    first = reader.read()
    assert first is not None and first.path == "/a" and first.limit_bytes == 1000000
    assert first.oom_kill_count is None  # no memory.events: unknown, not 0
    # the target moves to b and a is removed
    (proc / "8" / "cgroup").write_text("0::/b\n")
    shutil.rmtree(root / "a")
    second = reader.read()
    assert second is not None and second.path == "/b" and second.limit_bytes is None
    # everything gone: None, with a reason, and no exception
    shutil.rmtree(root)
    assert reader.read() is None
    assert reader.reason is not None


# --------------------------------------------------------------------------- real cgroup v1

_CHILD = r"""
import sys
sys.stdin.readline()                     # wait until we are in the test cgroup
blob = b"\x01" * int(sys.argv[1])        # allocate and touch
print("ready", flush=True)
sys.stdin.readline()
"""


def _own_v1_memory_dir() -> Path | None:
    """Our memory cgroup directory on a v1 hierarchy, found independently of the code under test."""
    path = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _hid, controllers, p = line.split(":", 2)
        if "memory" in controllers.split(","):
            path = p
    if path is None:
        return None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = right.split()[:3]
        if fstype == "cgroup" and "memory" in options.split(","):
            mount_root, mount_point = left.split()[3:5]
            rel = path[len(mount_root) :] if mount_root != "/" else path
            d = Path(mount_point + rel)
            return d if d.is_dir() else Path(mount_point)
    return None


@pytest.fixture
def v1_cgroup(request: pytest.FixtureRequest) -> Iterator[Callable[[int | None], Path]]:
    """Factory of child memory cgroups under ours; all are removed at the end, even on failure."""
    parent = _own_v1_memory_dir()
    if parent is None:
        pytest.skip("no cgroup v1 memory hierarchy on this machine")
    created: list[Path] = []
    counter = itertools.count()

    def make(limit: int | None) -> Path:
        d = parent / f"dlmon-test-{os.getpid()}-{next(counter)}"
        try:
            d.mkdir()
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                pytest.skip(f"cgroup v1 memory hierarchy {parent} is not writable: {e}")
            raise
        created.append(d)
        if limit is not None:
            (d / "memory.limit_in_bytes").write_text(str(limit))
        return d

    yield make
    for d in reversed(created):
        for _ in range(100):  # the killed processes leave the cgroup asynchronously
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)


def _start_child(cgroup_dir: Path, nbytes: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    (cgroup_dir / "cgroup.procs").write_text(str(proc.pid))
    return proc


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_real_v1_limit_and_usage(
    v1_cgroup: Callable[[int | None], Path], children: list[subprocess.Popen[str]]
) -> None:
    d = v1_cgroup(256 * MIB)
    proc = _start_child(d, 32 * MIB)
    children.append(proc)
    reader = CgroupMemoryReader(proc.pid)
    assert reader.location is not None, reader.reason
    assert reader.location.version == 1  # this machine is hybrid: memory is on v1
    assert Path(reader.location.directory) == d
    assert reader.location.path.endswith("/" + d.name)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "ready"
    cg = reader.read()
    assert cg is not None
    assert cg.version == 1
    assert cg.limit_bytes == 256 * MIB
    assert cg.current_bytes is not None and 32 * MIB <= cg.current_bytes <= 256 * MIB
    assert cg.oom_kill_count == 0
    assert cg.pressure is None


def test_real_v1_no_limit_is_none_or_inherited(
    v1_cgroup: Callable[[int | None], Path], children: list[subprocess.Popen[str]]
) -> None:
    d = v1_cgroup(None)
    proc = _start_child(d, 0)
    children.append(proc)
    # what the parents allow, read independently: hierarchical_memory_limit of the new cgroup
    hier = next(
        int(line.split()[1])
        for line in (d / "memory.stat").read_text().splitlines()
        if line.startswith("hierarchical_memory_limit ")
    )
    cg = read_cgroup_memory(proc.pid)
    assert cg is not None
    assert cg.limit_bytes == (None if hier >= 2**60 else hier)


def test_real_v1_oom_kill_counted(
    v1_cgroup: Callable[[int | None], Path], children: list[subprocess.Popen[str]]
) -> None:
    d = v1_cgroup(64 * MIB)
    proc = _start_child(d, 256 * MIB)
    children.append(proc)
    reader = CgroupMemoryReader(proc.pid)  # located while the pid is alive
    before = reader.read()
    machine_before = read_oom_kill_count()
    assert before is not None and before.oom_kill_count == 0
    assert before.limit_bytes == 64 * MIB
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.wait(timeout=15) == -9, "the OOM killer should have SIGKILLed the child"
    after = reader.read()  # the process is gone; the cgroup is still there
    assert after is not None
    assert after.oom_kill_count == 1
    machine_after = read_oom_kill_count()
    if machine_before is not None and machine_after is not None:
        assert machine_after >= machine_before + 1


# ------------------------------------------------- working set, limit level, moves (real v1)

_STREAMER = r"""
import sys
sys.stdin.readline()                     # wait until we are in the test cgroup
path = sys.argv[1]
print("go", flush=True)
while True:                              # stream the file again and again, keeping nothing
    with open(path, "rb", buffering=0) as fh:
        while fh.read(1 << 20):
            pass
"""


def _v1_stat(d: Path, key: str) -> int:
    return next(
        int(line.split()[1])
        for line in (d / "memory.stat").read_text().splitlines()
        if line.split()[0] == key
    )


def test_real_v1_streaming_a_file_is_cache_not_used_memory(
    v1_cgroup: Callable[[int | None], Path], children: list[subprocess.Popen[str]], tmp_path: Path
) -> None:
    """A job capped at 1.5 GiB streams a 2.5 GiB file: its cgroup fills with page cache up to the
    limit, while what it really uses is a few MiB. The snapshot (JSON), the one-line form and the
    dashboard show the working set and the cache apart; headroom comes from the working set; the
    analysis raises nothing."""
    from dlmon.analysis import Analyzer
    from dlmon.analysis.detectors import headroom
    from dlmon.collect.sampler import Sampler
    from dlmon.model.format import one_line
    from dlmon.model.serialize import snapshot_to_dict
    from dlmon.ui.state import DashboardState
    from dlmon.ui.views import memory_lines, text_of

    data = tmp_path / "dataset.bin"
    with data.open("wb") as fh:  # sparse: read back as zeros, through the page cache all the same
        fh.truncate(2560 * MIB)
    d = v1_cgroup(1536 * MIB)
    proc = subprocess.Popen(
        [sys.executable, "-c", _STREAMER, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    children.append(proc)
    (d / "cgroup.procs").write_text(str(proc.pid))
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "go"
    deadline = time.monotonic() + 120
    while _v1_stat(d, "total_cache") < 1024 * MIB:  # the cache fills the cgroup
        assert time.monotonic() < deadline, "the streamer did not fill the cgroup with cache"
        time.sleep(0.2)

    sampler = Sampler(proc.pid)
    analyzer = Analyzer(strict=True)
    state = DashboardState()
    snapshots = []
    try:
        for _ in range(12):
            snapshot = analyzer(sampler.sample())
            state.ingest(snapshot)
            snapshots.append(snapshot)
            time.sleep(0.5)
    finally:
        sampler.close()
    last = snapshots[-1]
    cg = last.cgroup
    assert cg is not None and cg.limit_bytes == 1536 * MIB
    assert cg.current_bytes is not None and cg.current_bytes > 1024 * MIB  # "nearly full" as before
    assert cg.cache_bytes is not None and cg.cache_bytes > 1024 * MIB
    assert cg.working_set_bytes is not None and cg.working_set_bytes < 256 * MIB
    as_json = snapshot_to_dict(last)
    assert as_json["cgroup"]["working_set_bytes"] == cg.working_set_bytes
    assert as_json["memory"]["cgroup_working_set_bytes"] == cg.working_set_bytes
    assert as_json["memory"]["cgroup_cache_bytes"] == cg.cache_bytes
    room = headroom(last)
    assert room is not None
    assert room.bytes > 1024 * MIB or room.source == "machine"  # not "0 B left" of the cgroup
    assert all(not s.alerts for s in snapshots), [a.message for s in snapshots for a in s.alerts]
    assert "cgroup ws " in one_line(last) and " cache " in one_line(last)
    screen = "\n".join(text_of(line) for line in memory_lines(state, 200, False))
    assert "cgroup working set " in screen and "of 1.5 GiB" in screen
    assert "cache 1." in screen and "(reclaimable)" in screen


def test_real_v1_usage_read_where_the_limit_is(
    v1_cgroup: Callable[[int | None], Path], children: list[subprocess.Popen[str]]
) -> None:
    """Slurm's layout: the limit on the job's cgroup, the task in an unlimited step below it.
    Usage is compared with the limit at the job's level (what the kernel compares)."""
    job = v1_cgroup(512 * MIB)
    step = job / "step_0"
    step.mkdir()
    try:
        sibling = _start_child(job, 48 * MIB)  # another task of the job, in the job's own cgroup
        children.append(sibling)
        assert sibling.stdin is not None and sibling.stdout is not None
        sibling.stdin.write("go\n")
        sibling.stdin.flush()
        assert sibling.stdout.readline().strip() == "ready"
        proc = _start_child(step, 0)
        children.append(proc)
        cg = read_cgroup_memory(proc.pid)
        assert cg is not None
        assert cg.limit_bytes == 512 * MIB
        assert cg.usage_path is not None and cg.usage_path.endswith("/" + job.name)
        # the job's usage includes the sibling's 48 MiB, the step's alone does not
        assert cg.current_bytes is not None and cg.current_bytes >= 48 * MIB
        assert int((step / "memory.usage_in_bytes").read_text()) < 48 * MIB
    finally:
        for p in children:
            p.kill()
            p.wait()
        for _ in range(100):
            try:
                step.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def test_real_v1_reader_follows_a_move_at_once(
    v1_cgroup: Callable[[int | None], Path], children: list[subprocess.Popen[str]]
) -> None:
    """A launcher moves the job into another cgroup after start: the next read follows it, even
    though the old cgroup still exists."""
    first = v1_cgroup(256 * MIB)
    second = v1_cgroup(128 * MIB)
    proc = _start_child(first, 0)
    children.append(proc)
    reader = CgroupMemoryReader(proc.pid)  # default relocate interval: 10 s
    before = reader.read()
    assert before is not None and before.limit_bytes == 256 * MIB
    (second / "cgroup.procs").write_text(str(proc.pid))
    after = reader.read()
    assert after is not None and after.limit_bytes == 128 * MIB
    assert after.path.endswith("/" + second.name)


# --------------------------------------------------------------------------- usable cores (real)


def test_real_usable_cores_are_the_targets_affinity_and_cpu_quota(
    children: list[subprocess.Popen[str]],
) -> None:
    """The snapshot carries the target's cores, not dlmon's: a child pinned to one CPU, then put
    in a v1 cpu cgroup with a quota of half a core."""
    from dlmon.collect.cgroup import UsableCores
    from dlmon.collect.sampler import Sampler

    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE, text=True
    )
    children.append(proc)
    os.sched_setaffinity(proc.pid, {min(os.sched_getaffinity(0))})
    assert UsableCores(proc.pid).read() == 1.0
    cpu_root = Path("/sys/fs/cgroup/cpu")
    if not (cpu_root / "cpu.cfs_quota_us").exists():
        pytest.skip("no cgroup v1 cpu hierarchy")
    os.sched_setaffinity(proc.pid, os.sched_getaffinity(0))
    d = cpu_root / f"dlmon-test-cpu-{os.getpid()}"
    d.mkdir()
    try:
        (d / "cpu.cfs_period_us").write_text("100000")
        (d / "cpu.cfs_quota_us").write_text("50000")
        (d / "cgroup.procs").write_text(str(proc.pid))
        assert UsableCores(proc.pid).read() == 0.5
        sampler = Sampler(proc.pid)
        try:
            assert sampler.sample().target_cores == 0.5
        finally:
            sampler.close()
    finally:
        proc.kill()
        proc.wait()
        for _ in range(100):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def test_usable_cores_are_kept_for_their_refresh_then_read_again(
    children: list[subprocess.Popen[str]],
) -> None:
    """Issue 14: affinity and quotas were read every tick, as costly as the rest of the
    machine-wide files; they are set at launch, so a reading stands for ``refresh_s``."""
    from dlmon.collect.cgroup import UsableCores

    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        pytest.skip("needs two CPUs")
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE, text=True
    )
    children.append(proc)
    cores = UsableCores(proc.pid, refresh_s=0.3)
    assert cores.read() == len(mine)
    os.sched_setaffinity(proc.pid, {min(mine)})
    assert cores.read() == len(mine)  # the reading stands for refresh_s
    time.sleep(0.35)
    assert cores.read() == 1.0
