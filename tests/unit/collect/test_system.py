"""dlmon.collect.system against fixtures and against the real machine (free, df, unshare)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlmon.collect.system import (
    MeminfoReading,
    parse_meminfo,
    parse_pressure,
    parse_vmstat_oom_kill,
    read_meminfo,
    read_oom_kill_count,
    read_pressure,
    read_shm,
)
from dlmon.model import Pressure, ShmSample
from support.paths import TESTS

FIXTURES = TESTS / "fixtures"
PROC = FIXTURES / "proc"
KIB = 1024
MIB = 1024 * 1024


# --------------------------------------------------------------------------- fixtures


def test_meminfo_fixture() -> None:
    m = read_meminfo(str(PROC))
    assert m == MeminfoReading(
        total_bytes=32768000 * KIB,
        available_bytes=20480000 * KIB,
        free_bytes=1024000 * KIB,
        shmem_bytes=6291456 * KIB,
        dirty_bytes=2048 * KIB,
        swap_total_bytes=4194304 * KIB,
        swap_free_bytes=4000000 * KIB,
    )


def test_meminfo_missing_fields_are_none_not_zero() -> None:
    # a kernel before 3.14 has no MemAvailable; a broken line must not raise
    m = parse_meminfo("MemTotal:  1000 kB\nMemFree: garbage kB\nShmem:\nSwapTotal:   0 kB\n")
    assert m.total_bytes == 1000 * KIB
    assert m.available_bytes is None
    assert m.free_bytes is None
    assert m.shmem_bytes is None
    assert m.swap_total_bytes == 0  # a zero is a measurement


def test_meminfo_unreadable(tmp_path: Path) -> None:
    assert read_meminfo(str(tmp_path)) == MeminfoReading()


def test_vmstat_fixture() -> None:
    assert read_oom_kill_count(str(PROC)) == 3
    assert read_oom_kill_count(str(FIXTURES / "nonexistent")) is None
    # kernels before 4.13 have no oom_kill line; oom_kill_disable-like prefixes must not match
    assert parse_vmstat_oom_kill("pgfault 5\noom_kill_other 9\n") is None


def test_parse_pressure() -> None:
    text = (PROC / "pressure" / "io").read_text()
    assert parse_pressure(text) == (12.5, 7.75)
    # cpu on kernels before 5.13 has only a "some" line
    assert parse_pressure("some avg10=1.00 avg60=2.00 avg300=3.00 total=4\n") == (1.0, None)
    assert parse_pressure("") == (None, None)
    assert parse_pressure("some avg10=x avg60=1\nfull avg10=2.5\n") == (None, 2.5)


def test_read_pressure_proc_fixture() -> None:
    expected = Pressure(
        io_some_avg10=12.5,
        io_full_avg10=7.75,
        memory_some_avg10=3.1,
        memory_full_avg10=1.2,
        cpu_some_avg10=42.0,
    )
    assert read_pressure(str(PROC / "pressure")) == expected
    assert read_pressure(str(PROC / "pressure"), cgroup=False) == expected
    # the cgroup naming does not exist in /proc/pressure
    assert read_pressure(str(PROC / "pressure"), cgroup=True) is None


def test_read_pressure_cgroup_fixture() -> None:
    d = FIXTURES / "cgroup_v2" / "host" / "job.slice" / "train.scope"
    expected = Pressure(
        io_some_avg10=4.2,
        io_full_avg10=3.9,
        memory_some_avg10=21.3,
        memory_full_avg10=17.8,
        cpu_some_avg10=55.0,
    )
    assert read_pressure(str(d)) == expected
    assert read_pressure(str(d), cgroup=True) == expected
    assert read_pressure(str(d), cgroup=False) is None


def test_read_pressure_partial(tmp_path: Path) -> None:
    (tmp_path / "memory.pressure").write_text("some avg10=5.50 avg60=0 avg300=0 total=1\n")
    p = read_pressure(str(tmp_path))
    assert p == Pressure(memory_some_avg10=5.5)
    assert read_pressure(str(tmp_path / "nope")) is None


# --------------------------------------------------------------------------- real machine


def test_real_pressure_matches_proc() -> None:
    if not os.path.exists("/proc/pressure/memory"):
        pytest.skip("this kernel has no PSI (/proc/pressure)")
    p = read_pressure("/proc/pressure")
    assert p is not None
    some, _full = parse_pressure(Path("/proc/pressure/memory").read_text())
    assert p.memory_some_avg10 is not None and some is not None
    assert abs(p.memory_some_avg10 - some) < 5.0  # same file, a moment apart


def test_real_meminfo_available_matches_free() -> None:
    if shutil.which("free") is None:
        pytest.skip("free (procps) is not installed")
    m = read_meminfo()
    out = subprocess.run(["free", "-b"], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    header = lines[0].split()
    mem = next(line.split() for line in lines if line.startswith("Mem:"))
    # the header has no label column: Mem: <total> <used> <free> <shared> <buff/cache> <available>
    free_available = int(mem[1 + header.index("available")])
    free_total = int(mem[1 + header.index("total")])
    assert m.total_bytes == free_total
    assert m.available_bytes is not None
    assert abs(m.available_bytes - free_available) <= 0.02 * free_available
    assert m.free_bytes is not None and 0 < m.free_bytes <= m.total_bytes
    assert m.swap_total_bytes is not None and m.swap_free_bytes is not None
    assert m.swap_free_bytes <= m.swap_total_bytes


def test_real_oom_kill_count() -> None:
    text = Path("/proc/vmstat").read_text()
    if "\noom_kill " not in text:
        pytest.skip("kernel before 4.13: no oom_kill in /proc/vmstat")
    n = read_oom_kill_count()
    assert isinstance(n, int) and n >= 0


def _df_shm() -> tuple[int, int, int]:
    out = subprocess.run(
        ["df", "-B1", "--output=size,used,avail", "/dev/shm"], capture_output=True, text=True, check=True
    ).stdout
    size, used, avail = (int(x) for x in out.splitlines()[1].split())
    return size, used, avail


def test_read_shm_matches_df() -> None:
    if shutil.which("df") is None:
        pytest.skip("df is not installed")
    blob = Path("/dev/shm") / f"dlmon-test-{os.getpid()}"
    readings: list[tuple[ShmSample | None, tuple[int, int, int]]] = []
    try:
        with open(blob, "wb") as f:
            f.write(b"\1" * (16 * MIB))  # 16 MiB that both must see as used
        # other processes may write to /dev/shm between the two readings: up to 3 tries
        for _ in range(3):
            s = read_shm(os.getpid())
            size, used, avail = _df_shm()
            readings.append((s, (size, used, avail)))
            assert s is not None and s.used_bytes is not None and s.available_bytes is not None
            if abs(s.used_bytes - used) <= 4 * MIB and abs(s.available_bytes - avail) <= 4 * MIB:
                break
    finally:
        blob.unlink(missing_ok=True)
    assert s is not None and s.used_bytes is not None and s.available_bytes is not None
    assert s.path == f"/proc/{os.getpid()}/root/dev/shm"
    assert s.total_bytes == size
    assert s.used_bytes >= 16 * MIB
    assert abs(s.used_bytes - used) <= 4 * MIB, readings
    assert abs(s.available_bytes - avail) <= 4 * MIB, readings


def test_read_shm_fallback() -> None:
    own = read_shm(None)
    assert own is not None and own.path == "/dev/shm"
    gone = read_shm(2**22 + 12345)  # above pid_max's default: no such process
    assert gone is not None and gone.path == "/dev/shm"
    assert gone.total_bytes == own.total_bytes
    assert read_shm(None, fallback="/nonexistent/dev/shm") is None


@pytest.fixture
def private_shm_process() -> Iterator[subprocess.Popen[bytes]]:
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    proc = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=8m tmpfs /dev/shm && exec sleep 30"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                if "ermission" in err or "not permitted" in err:
                    pytest.skip(f"cannot make a private mount namespace here: {err.strip()}")
                pytest.fail(f"unshare/mount failed ({proc.returncode}): {err.strip()}")
            try:
                if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep":
                    break  # exec'd: the mount is done
            except OSError:
                pass
            time.sleep(0.01)
        else:
            pytest.fail("unshare never reached `sleep`")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_read_shm_private_mount_namespace(private_shm_process: subprocess.Popen[bytes]) -> None:
    pid = private_shm_process.pid
    theirs = read_shm(pid)
    ours = read_shm(None)
    assert theirs is not None and ours is not None
    assert theirs.path == f"/proc/{pid}/root/dev/shm"
    assert theirs.total_bytes == 8 * MIB
    assert theirs.used_bytes == 0
    assert ours.total_bytes is not None and ours.total_bytes > 8 * MIB
    # the private mount did not leak into our namespace
    assert os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize == ours.total_bytes
