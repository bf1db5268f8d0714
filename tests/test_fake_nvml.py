"""dlmon against a stand-in libnvidia-ml.so.1 (tests/fake_nvml): the real nvidia-ml-py, its
ctypes structs and its two-call process lists run; and a hung NVML call never freezes sampling.

Each test writes the stand-in's config, then runs dlmon in a child process whose
LD_LIBRARY_PATH points at the stand-in (see tests/nvml_support.py)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest
from nvml_support import build, environment, run_python

from dlmon.collect.gpu import GpuCollector
from dlmon.collect.gpu_sweep import GpuSweep
from dlmon.model.serialize import snapshot_from_dict, snapshot_to_dict
from dlmon.model.snapshot import GpuDevice, GpuProcess, GpuStatus

pynvml = pytest.importorskip("pynvml")

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = build(tmp_path_factory.mktemp("fake_nvml"))
    if built is None:
        pytest.skip("no C compiler to build the stand-in libnvidia-ml.so.1")
    return built


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "nvml.conf"
    path.write_text(text)
    return path


# One reading, as JSON on stdout: what GpuCollector makes of the stand-in through pynvml.
SAMPLE = """
    import json
    from dlmon.collect.gpu import GpuCollector
    from dlmon.model.serialize import to_dict
    collector = GpuCollector(host_pids=True)
    status, devices = collector.sample()
    print(json.dumps({"status": to_dict(status), "devices": [to_dict(d) for d in devices]}))
    collector.close()
"""


def _sample(fake_nvml: Path, config: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    result = run_python(SAMPLE, fake_nvml, config)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    return data["status"], data["devices"]


TWO_DEVICES = f"""
driver 555.42.06
device
name NVIDIA H100 80GB HBM3
uuid GPU-11111111-2222-3333-4444-555555555555
total {80 * GiB}
used {20 * GiB}
reserved {512 * MiB}
util 91
compute 4242 {18 * GiB}
compute 4243 na
graphics 4242 {18 * GiB}
graphics 4300 {MiB}
device
name NVIDIA H100 80GB HBM3
uuid GPU-66666666-7777-8888-9999-000000000000
total {80 * GiB}
used {3 * GiB}
util 4
"""


def test_bindings_structs_match_the_drivers(fake_nvml: Path, tmp_path: Path) -> None:
    """Issue 24 item 3: the installed nvidia-ml-py's process struct is the driver's
    nvmlProcessInfo_t (24 bytes; some 12.535 releases had a 32-byte v3 that misread every
    entry after the first), and its memory v2 version word encodes the struct's size."""
    code = f"""
        import ctypes, pynvml
        lib = ctypes.CDLL({str(fake_nvml / "libnvidia-ml.so.1")!r})
        print(lib.fakeNvmlSizeofProcessInfo(), ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t),
              lib.fakeNvmlSizeofMemoryV2(), ctypes.sizeof(pynvml.c_nvmlMemory_v2_t),
              pynvml.nvmlMemory_v2 & 0xFFFFFF)
    """
    result = run_python(code, fake_nvml, _config(tmp_path, ""))
    assert result.returncode == 0, result.stderr
    driver_proc, binding_proc, driver_mem, binding_mem, version_size = map(int, result.stdout.split())
    assert driver_proc == binding_proc == 24
    assert driver_mem == binding_mem == version_size == 40


def test_devices_memory_and_processes_read_through_the_real_bindings(fake_nvml: Path, tmp_path: Path) -> None:
    status, devices = _sample(fake_nvml, _config(tmp_path, TWO_DEVICES))
    assert status == {
        "available": True,
        "reason": None,
        "driver_version": "555.42.06",
        "process_memory_note": None,
    }
    assert [d["index"] for d in devices] == [0, 1]
    first, second = (
        GpuDevice(**{**d, "processes": tuple(GpuProcess(**p) for p in d["processes"])}) for d in devices
    )
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.uuid == "GPU-11111111-2222-3333-4444-555555555555"
    # The v2 struct's used leaves the driver's reserve out (v1's would say 20.5 GiB).
    assert (first.memory_used_bytes, first.memory_total_bytes) == (20 * GiB, 80 * GiB)
    assert first.utilization_percent == 91.0
    # Both calls of each list ran: compute and graphics merged by pid; NVML's "not available"
    # is None, not 2**64-1; a graphics-only pid is there too.
    assert [(p.pid, p.used_memory_bytes) for p in first.processes] == [
        (4242, 18 * GiB),
        (4243, None),
        (4300, MiB),
    ]
    assert (second.memory_used_bytes, second.utilization_percent, second.processes) == (3 * GiB, 4.0, ())
    assert first.stale_age_s is None and first.unavailable_reason is None


def test_a_failing_call_blanks_only_its_field_and_a_lost_gpu_only_its_device(
    fake_nvml: Path, tmp_path: Path
) -> None:
    config = TWO_DEVICES.replace("util 91\n", "util 91\nfail nvmlDeviceGetUtilizationRates 3\n").replace(
        "util 4\n", "util 4\nfail nvmlDeviceGetMemoryInfo_v2 15\n"
    )
    _, devices = _sample(fake_nvml, _config(tmp_path, config))
    first, second = (GpuDevice(**{**d, "processes": ()}) for d in devices)
    assert first.utilization_percent is None  # NVML_ERROR_NOT_SUPPORTED
    assert first.memory_used_bytes == 20 * GiB and first.unavailable_reason == "NVML: not supported"
    assert second.memory_used_bytes is None and second.utilization_percent is None
    assert second.unavailable_reason == "NVML: GPU is lost"


def test_init_failing_says_why(fake_nvml: Path, tmp_path: Path) -> None:
    status, devices = _sample(fake_nvml, _config(tmp_path, "init_error 9\n"))
    assert devices == []
    assert status["available"] is False
    assert status["reason"] == "NVIDIA driver not loaded: NVML could not talk to the GPU driver."


# -- item 2: a hung NVML ----------------------------------------------------------------------

# Both devices answer for 1.5 s, then every call on them blocks 8 s (a GPU off the bus).
HUNG = """
device
compute {pid} 2147483648
delay_ms 8000
hang_after_ms 1500
device
delay_ms 8000
hang_after_ms 1500
"""


DLMON_RECORD = (sys.executable, "-m", "dlmon", "record")


def test_record_keeps_its_pace_while_nvml_hangs_and_says_the_gpu_figures_are_stale(
    fake_nvml: Path, tmp_path: Path
) -> None:
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        config = _config(tmp_path, HUNG.format(pid=target.pid))
        out = tmp_path / "record.jsonl"
        result = subprocess.run(
            [*DLMON_RECORD, str(target.pid), "-o", str(out), "--interval", "0.5", "--duration", "10"],
            capture_output=True,
            text=True,
            timeout=60,
            env=environment(fake_nvml, config),
        )
    finally:
        target.kill()
        target.wait()
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    snapshots = [s for s in lines if "gpus" in s]
    assert len(snapshots) >= 15, len(snapshots)  # 20 at its pace; NVML's way: 2 in 20 s
    times = [s["time"] for s in snapshots]
    assert max(b - a for a, b in itertools.pairwise(times)) < 1.5
    first, last = snapshots[0], snapshots[-1]
    assert [g["stale_age_s"] for g in first["gpus"]] == [None, None]
    assert first["gpus"][0]["processes"] == [{"pid": target.pid, "used_memory_bytes": 2147483648}]
    # The last answer stands in, marked stale with its age (it grows as the hang lasts).
    ages = [g["stale_age_s"] for g in last["gpus"]]
    assert all(age is not None and age > 5.0 for age in ages), ages
    assert last["gpus"][0]["memory_used_bytes"] == 10 * GiB
    stale = [s["gpus"][0]["stale_age_s"] for s in snapshots if s["gpus"][0]["stale_age_s"] is not None]
    assert stale == sorted(stale) and len(stale) >= 10


def test_a_slow_device_is_backed_off_and_the_other_stays_fresh(fake_nvml: Path, tmp_path: Path) -> None:
    """Device 0's memory call takes 1 s: after one slow sweep it is read at most every 5 s,
    its last reading standing in; device 1 is read fresh meanwhile."""
    config = _config(
        tmp_path,
        "device\ndelay_ms 1000\ndelay_fn nvmlDeviceGetMemoryInfo_v2\nhang_after_ms 300\ndevice\nutil 12\n",
    )
    code = """
        import json, time
        from dlmon.collect.gpu import GpuCollector
        from dlmon.collect.gpu_sweep import GpuSweep
        sweep = GpuSweep(GpuCollector(host_pids=True, slow_device_s=0.25), deadline_s=0.25)
        out = []
        for _ in range(20):
            reading = sweep.sample()
            out.append([d.stale_age_s for d in reading.devices] + [reading.wall_s])
            time.sleep(0.2)
        sweep.close()
        print(json.dumps(out))
    """
    result = run_python(code, fake_nvml, config)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert all(wall <= 0.4 for *_, wall in rows), rows  # never waited past the deadline
    assert rows[0][:2] == [None, None]
    late = rows[-8:]
    assert any(row[1] is None for row in late), rows  # device 1 fresh while 0 is backed off
    assert all(row[0] is not None and row[0] >= 0.5 for row in late), rows


# -- GpuSweep with a Python stand-in collector -------------------------------------------------


class BlockingCollector:
    """Answers one device, after ``release`` is set; counts its sweeps."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sweeps = 0
        self.closed = False
        self.threads: set[int] = set()

    def sample(self) -> tuple[GpuStatus, tuple[GpuDevice, ...]]:
        self.threads.add(threading.get_ident())
        self.release.wait(30)
        self.sweeps += 1
        return GpuStatus(available=True), (GpuDevice(0, "fake", "GPU-0", self.sweeps, 100, 50.0),)

    def close(self) -> None:
        self.closed = True


def _sweep(collector: BlockingCollector, **kwargs: float) -> GpuSweep:
    return GpuSweep(cast(GpuCollector, collector), **kwargs)


def test_sweep_waits_no_longer_than_its_deadline_and_never_stacks_sweeps() -> None:
    collector = BlockingCollector()
    sweep = _sweep(collector, deadline_s=0.05, first_deadline_s=0.1)
    start = time.monotonic()
    first = sweep.sample()
    assert 0.08 <= first.wall_s < 0.5 and time.monotonic() - start < 0.5
    assert first.status.available is False and first.devices == ()
    assert first.status.reason is not None and "NVML has not answered for" in first.status.reason
    for _ in range(5):  # the sweep in flight is past its deadline: no wait, no second sweep
        assert sweep.sample().wall_s < 0.02
    collector.release.set()
    deadline = time.monotonic() + 5
    while collector.sweeps == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    reading = sweep.sample()
    assert collector.sweeps >= 1 and len(collector.threads) == 1
    assert reading.devices[0].memory_used_bytes is not None
    sweep.close()
    assert collector.closed


def test_sweep_marks_an_old_reading_stale_with_its_age() -> None:
    collector = BlockingCollector()
    collector.release.set()
    sweep = _sweep(collector, deadline_s=0.05)
    fresh = sweep.sample()
    assert fresh.devices[0].stale_age_s is None and fresh.cpu_s >= 0.0
    collector.release.clear()  # NVML hangs from now on
    time.sleep(0.3)  # the next sweep may start no sooner than the last one lasted
    sweep.sample()
    time.sleep(0.2)
    stale = sweep.sample()
    age = stale.devices[0].stale_age_s
    assert age is not None and 0.3 <= age < 2.0
    assert stale.devices[0].memory_used_bytes == fresh.devices[0].memory_used_bytes
    collector.release.set()
    sweep.close()


def test_sweep_hands_a_collector_bug_to_the_sampler() -> None:
    class Broken(BlockingCollector):
        def sample(self) -> tuple[GpuStatus, tuple[GpuDevice, ...]]:
            raise ZeroDivisionError("a bug")

    sweep = _sweep(Broken(), deadline_s=0.5)
    with pytest.raises(ZeroDivisionError):
        sweep.sample()
    sweep.close()


def test_stale_age_round_trips_and_old_records_read_as_fresh() -> None:
    import dataclasses

    from test_ui_support import make_snapshot

    snapshot = make_snapshot(gpus=1)
    stale = dataclasses.replace(snapshot, gpus=(dataclasses.replace(snapshot.gpus[0], stale_age_s=8.5),))
    assert snapshot_from_dict(json.loads(json.dumps(snapshot_to_dict(stale)))).gpus == stale.gpus
    old = snapshot_to_dict(snapshot)
    del old["gpus"][0]["stale_age_s"]  # a record from before the field
    assert snapshot_from_dict(old).gpus[0].stale_age_s is None


def test_the_gpu_panel_says_the_figures_are_stale_and_how_old() -> None:
    import dataclasses

    from test_ui_support import make_snapshot

    from dlmon.ui.state import DashboardState
    from dlmon.ui.text import text_of
    from dlmon.ui.views.gpu import gpu_lines

    snapshot = make_snapshot(gpus=2)
    gpus = (dataclasses.replace(snapshot.gpus[0], stale_age_s=8.4), snapshot.gpus[1])
    state = DashboardState()
    state.ingest(dataclasses.replace(snapshot, gpus=gpus))
    full = [text_of(line) for line in gpu_lines(state, 160, compact=False)]
    assert "stale 8s" in full[0] and "stale" not in full[1]
    compact = text_of(gpu_lines(state, 160, compact=True)[0])
    assert compact.count("stale 8s") == 1
