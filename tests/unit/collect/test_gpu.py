"""Tests for dlmon.collect.gpu: the real no-driver path, then a fake pynvml at the one seam."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from dlmon.collect.gpu import MAX_BACKOFF_S, ULONGLONG_MAX, GpuCollector
from dlmon.model.snapshot import GpuDevice, GpuProcess, GpuStatus
from support.fake_pynvml import (
    COMPUTE,
    GRAPHICS,
    Dev,
    FakeNVML,
    Handle,
    NVMLError_DriverNotLoaded,
    NVMLError_GpuIsLost,
    NVMLError_LibraryNotFound,
    NVMLError_NoPermission,
    NVMLError_NotSupported,
    NVMLError_Timeout,
    NVMLError_Unknown,
    two_devices,
)

MiB = 1 << 20
GiB = 1 << 30


# -- the real library on a machine without an NVIDIA driver -----------------------------------


def test_real_pynvml_without_driver_is_unavailable_and_cheap() -> None:
    collector = GpuCollector()
    status, devices = collector.sample()
    if status.available:  # running on a real GPU machine: the other branch is what CI sees
        assert devices and all(d.name for d in devices)
        collector.close()
        return
    assert devices == ()
    assert status.reason and status.reason.endswith(".")
    assert "NVML" in status.reason or "NVIDIA" in status.reason
    start = time.perf_counter()
    for _ in range(2000):
        assert collector.sample() == (status, ())
    assert time.perf_counter() - start < 0.5
    collector.close()


def test_module_imports_without_pynvml_and_pulls_in_no_ui_or_torch() -> None:
    code = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "pynvml":
                    raise ImportError("blocked for the test")
                return None

        sys.meta_path.insert(0, Block())
        import dlmon.collect.gpu as gpu
        status, devices = gpu.GpuCollector().sample()
        assert status.available is False, status
        assert status.reason == "NVML not available: nvidia-ml-py not installed", status.reason
        assert devices == ()
        heavy = sorted(m for m in ("torch", "rich", "textual", "pynvml") if m in sys.modules)
        assert not heavy, heavy
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def sample(fake: FakeNVML) -> tuple[GpuStatus, tuple[GpuDevice, ...]]:
    return GpuCollector(fake).sample()


# -- the fake at work ---------------------------------------------------------------------------


def test_two_devices_with_processes() -> None:
    status, devices = sample(FakeNVML(two_devices()))
    assert status == GpuStatus(available=True, reason=None, driver_version="580.159.04")
    assert devices == (
        GpuDevice(
            index=0,
            name="NVIDIA H200",
            uuid="GPU-aaaa",
            memory_used_bytes=20 * GiB,  # the v2 figure, without the 512 MiB reserved
            memory_total_bytes=140 * GiB,
            utilization_percent=81.0,
            # 4242 has a compute and a graphics context: counted once; 77 is graphics only
            processes=(GpuProcess(77, 64 * MiB), GpuProcess(4242, 18 * GiB), GpuProcess(4300, 1 * GiB)),
        ),
        GpuDevice(
            index=1,
            name="NVIDIA H200",
            uuid="GPU-bbbb",
            memory_used_bytes=3 * GiB,
            memory_total_bytes=140 * GiB,
            utilization_percent=0.0,
            processes=(GpuProcess(4343, 2 * GiB),),
        ),
    )


def test_same_pid_twice_in_one_listing_is_summed() -> None:  # one entry per MIG instance
    fake = FakeNVML([Dev(compute=[(10, 1 * GiB), (10, 2 * GiB)])])
    assert sample(fake)[1][0].processes == (GpuProcess(10, 3 * GiB),)


def test_v3_absent_from_pynvml_uses_v2() -> None:
    fake = FakeNVML(two_devices(), absent=(COMPUTE + "_v3", GRAPHICS + "_v3"))
    collector = GpuCollector(fake)
    devices = collector.sample()[1]
    assert devices[0].processes[1] == GpuProcess(4242, 18 * GiB)
    assert fake.count(COMPUTE + "_v2") == 2  # once per device
    assert fake.count(COMPUTE) == 0


def test_v3_missing_in_driver_uses_v2_and_is_not_retried() -> None:
    fake = FakeNVML(two_devices(), no_symbol=(COMPUTE + "_v3",))
    collector = GpuCollector(fake)
    for _ in range(3):
        assert collector.sample()[1][1].processes == (GpuProcess(4343, 2 * GiB),)
    assert fake.count(COMPUTE + "_v3") == 1
    assert fake.count(COMPUTE + "_v2") == 6
    assert fake.count(GRAPHICS + "_v3") == 6  # graphics' v3 works here: still used


def test_v3_and_v2_missing_use_the_plain_call() -> None:
    fake = FakeNVML(two_devices(), absent=(COMPUTE + "_v3", COMPUTE + "_v2"), no_symbol=(GRAPHICS + "_v3",))
    devices = sample(fake)[1]
    assert devices[0].processes == (
        GpuProcess(77, 64 * MiB),
        GpuProcess(4242, 18 * GiB),
        GpuProcess(4300, 1 * GiB),
    )
    assert fake.count(COMPUTE) == 2
    assert fake.count(GRAPHICS + "_v2") == 2


def test_no_process_function_at_all_gives_no_processes_and_no_error() -> None:
    # pynvml 13's unversioned call raises NVMLLibraryMismatchError, which is not an NVMLError
    every = tuple(kind + s for kind in (COMPUTE, GRAPHICS) for s in ("_v3", "_v2", ""))
    devices = sample(FakeNVML(two_devices(), no_symbol=every))[1]
    assert [d.processes for d in devices] == [(), ()]
    assert devices[0].memory_used_bytes == 20 * GiB


def test_utilization_not_supported_is_none_for_that_field_only() -> None:
    devs = two_devices()
    devs[0].fail["nvmlDeviceGetUtilizationRates"] = NVMLError_NotSupported
    d0, d1 = sample(FakeNVML(devs))[1]
    assert d0.utilization_percent is None
    assert (d0.name, d0.uuid, d0.memory_used_bytes, d0.memory_total_bytes) == (
        "NVIDIA H200",
        "GPU-aaaa",
        20 * GiB,
        140 * GiB,
    )
    assert len(d0.processes) == 3
    assert d1.utilization_percent == 0.0


@pytest.mark.parametrize("error", [NVMLError_NoPermission, NVMLError_Unknown, NVMLError_Timeout])
def test_other_errors_blank_only_their_field(error: type[Exception]) -> None:
    devs = two_devices()
    devs[1].fail["nvmlDeviceGetMemoryInfo"] = error
    d0, d1 = sample(FakeNVML(devs))[1]
    assert (d1.memory_used_bytes, d1.memory_total_bytes) == (None, None)
    assert d1.utilization_percent == 0.0 and d1.uuid == "GPU-bbbb"
    assert d0.memory_used_bytes == 20 * GiB


def test_used_gpu_memory_none_or_not_available_is_none_and_zero_stays_zero() -> None:
    fake = FakeNVML([Dev(compute=[(1, None), (2, ULONGLONG_MAX), (3, 0), (4, 5 * MiB)])])
    assert sample(fake)[1][0].processes == (
        GpuProcess(1, None),
        GpuProcess(2, None),
        GpuProcess(3, 0),
        GpuProcess(4, 5 * MiB),
    )


def test_gpu_lost_mid_sample_blanks_that_device_only_and_recovers() -> None:
    devs = two_devices()
    devs[0].fail["nvmlDeviceGetMemoryInfo"] = NVMLError_GpuIsLost
    fake = FakeNVML(devs)
    collector = GpuCollector(fake)
    status, (d0, d1) = collector.sample()
    assert status.available is True
    assert d0 == GpuDevice(0, None, None, None, None, None, (), unavailable_reason="NVML: GPU is lost")
    assert d1.uuid == "GPU-bbbb" and d1.memory_used_bytes == 3 * GiB
    assert d1.processes == (GpuProcess(4343, 2 * GiB),)
    assert fake.count("nvmlDeviceGetUtilizationRates") == 1  # device 0 was not read further

    del devs[0].fail["nvmlDeviceGetMemoryInfo"]  # back on the bus
    d0 = collector.sample()[1][0]
    assert (d0.uuid, d0.memory_used_bytes, d0.utilization_percent) == ("GPU-aaaa", 20 * GiB, 81.0)
    assert fake.count("nvmlDeviceGetHandleByIndex") == 3  # device 0's handle was fetched anew


def test_names_and_driver_version_as_bytes_are_decoded() -> None:
    fake = FakeNVML([Dev(name=b"Tesla V100-SXM2-16GB", uuid=b"GPU-\xffold")], driver=b"470.57.02")
    status, (device,) = sample(fake)
    assert status.driver_version == "470.57.02"
    assert device.name == "Tesla V100-SXM2-16GB"
    assert device.uuid == "GPU-\ufffdold"


def test_handles_and_names_are_cached() -> None:
    fake = FakeNVML(two_devices())
    collector = GpuCollector(fake)
    for _ in range(3):
        collector.sample()
    assert fake.count("nvmlInit") == 1
    assert fake.count("nvmlDeviceGetHandleByIndex") == 2
    assert fake.count("nvmlDeviceGetName") == 2
    assert fake.count("nvmlDeviceGetMemoryInfo") == 6


def test_memory_falls_back_to_v1_when_the_driver_lacks_v2() -> None:
    fake = FakeNVML(two_devices(), no_symbol=("nvmlDeviceGetMemoryInfo_v2",))
    collector = GpuCollector(fake)
    for _ in range(2):
        d0 = collector.sample()[1][0]
        assert d0.memory_used_bytes == 20 * GiB + 512 * MiB  # v1 counts the reserved memory
    assert fake.count("nvmlDeviceGetMemoryInfo") == 1 + 4  # one failed v2 try, then v1 only


def test_memory_v2_not_supported_uses_v1_until_v2_answers_then_never_mixes() -> None:
    fake = FakeNVML([Dev()], memory_v2_error=NVMLError_NotSupported)
    collector = GpuCollector(fake)
    assert collector.sample()[1][0].memory_used_bytes == 10 * GiB + 512 * MiB  # v1
    fake.memory_v2_error = None
    assert collector.sample()[1][0].memory_used_bytes == 10 * GiB  # v2 answers now
    fake.memory_v2_error = NVMLError_Unknown
    assert collector.sample()[1][0].memory_used_bytes is None  # not v1's larger figure
    assert fake.count("nvmlDeviceGetMemoryInfo") == 2 + 1 + 1


def test_memory_uses_v1_when_pynvml_has_no_v2() -> None:
    fake = FakeNVML(two_devices(), absent=("nvmlMemory_v2",))
    assert sample(fake)[1][1].memory_used_bytes == 3 * GiB + 512 * MiB


def test_init_failing_driver_not_loaded_says_so_and_retries_rarely() -> None:
    now = [1000.0]
    fake = FakeNVML(two_devices(), init_error=NVMLError_DriverNotLoaded)
    collector = GpuCollector(fake, retry_interval_s=60.0, clock=lambda: now[0])
    status, devices = collector.sample()
    assert devices == ()
    assert status.available is False
    assert status.reason == "NVIDIA driver not loaded: NVML could not talk to the GPU driver."
    for t in (1001.0, 1030.0, 1059.9):
        now[0] = t
        assert collector.sample() == (status, ())
    assert fake.count("nvmlInit") == 1
    now[0] = 1060.0
    collector.sample()
    assert fake.count("nvmlInit") == 2

    fake.init_error = None  # the driver came up
    now[0] = 1200.0
    status, devices = collector.sample()
    assert status.available is True and len(devices) == 2


def test_init_failing_library_not_found() -> None:
    status, devices = sample(FakeNVML([], init_error=NVMLError_LibraryNotFound))
    assert devices == ()
    assert status.reason is not None and status.reason.startswith("NVML library not found")


def test_no_gpus() -> None:
    status, devices = sample(FakeNVML([]))
    assert (status.available, status.reason, devices) == (
        False,
        "NVML sees no NVIDIA GPU on this machine.",
        (),
    )


def test_close_shuts_down_and_a_later_sample_starts_again() -> None:
    fake = FakeNVML(two_devices())
    with GpuCollector(fake) as collector:
        collector.sample()
    assert fake.count("nvmlShutdown") == 1
    assert collector.sample()[0].available is True
    assert fake.count("nvmlInit") == 2


def test_bugs_outside_nvml_are_not_swallowed() -> None:
    devs = two_devices()
    devs[0].fail["nvmlDeviceGetUtilizationRates"] = ZeroDivisionError
    with pytest.raises(ZeroDivisionError):
        sample(FakeNVML(devs))


def test_a_slow_device_is_backed_off_doubling_and_read_again_once_fast() -> None:
    """A device read slower than ``slow_device_s`` is skipped for 5 s, then 10 s while still
    slow; its last reading stands in, marked with its age; the other device is read each time."""
    now = [0.0]
    fake = FakeNVML(two_devices())
    slow = {0}
    util = fake.nvmlDeviceGetUtilizationRates  # type: ignore[attr-defined]

    def timed(handle: Handle) -> Any:
        if handle.index in slow:
            now[0] += 1.0  # NVML took 1 s on this device
        return util(handle)

    fake.nvmlDeviceGetUtilizationRates = timed  # type: ignore[attr-defined]
    collector = GpuCollector(fake, clock=lambda: now[0], slow_device_s=0.25)
    _, first = collector.sample()
    assert first[0].stale_age_s is None and first[0].memory_used_bytes == 20 * GiB
    now[0] += 2.0
    _, second = collector.sample()
    assert second[0] == dataclasses.replace(first[0], stale_age_s=2.0)
    assert second[1].stale_age_s is None
    reads = fake.count("nvmlDeviceGetUtilizationRates")
    assert reads == 3  # device 0 once, device 1 twice
    now[0] += 3.5  # past the 5 s: read again, still slow, backed off 10 s
    assert collector.sample()[1][0].stale_age_s is None
    now[0] += 9.0
    assert collector.sample()[1][0].stale_age_s == 9.0
    slow.clear()
    now[0] += 1.5
    collector.sample()  # read again, fast now: no more back-off
    now[0] += 0.1
    assert collector.sample()[1][0].stale_age_s is None


def _slowed(fake: FakeNVML, now: list[float], slow: set[int]) -> None:
    """Every call on a device in ``slow`` takes NVML 1 s (on the fake clock)."""
    for name in [n for n in dir(fake) if n.startswith("nvmlDevice") and n != "nvmlDeviceGetCount"]:
        function = getattr(fake, name)

        def timed(*args: Any, _function: Any = function, **kwargs: Any) -> Any:
            index = args[0] if isinstance(args[0], int) else args[0].index
            if index in slow:
                now[0] += 1.0
            return _function(*args, **kwargs)

        setattr(fake, name, timed)


def test_a_slow_device_is_not_asked_its_remaining_calls() -> None:
    """Review finding 3: once one call on a device has been slow, its other calls are not made
    (a hung GPU blocks each of them as long): the sweep costs one hang, not six."""
    now = [0.0]
    fake = FakeNVML(two_devices())
    _slowed(fake, now, {0})
    collector = GpuCollector(fake, clock=lambda: now[0], slow_device_s=0.25)
    _, devices = collector.sample()
    assert now[0] == 1.0  # one call on device 0, not its handle, name, uuid, memory, ...
    assert devices[0].unavailable_reason == "NVML: slow to answer"
    assert devices[0].name is None and devices[0].processes == ()
    assert devices[1].memory_used_bytes == 3 * GiB and devices[1].unavailable_reason is None
    assert collector.pace_s == 0.0  # the newly backed-off device is not what the sweep paces on


def _read_again_after(collector: GpuCollector, now: list[float], wait: float) -> bool:
    """Whether device 0 is read (not its last reading, stale) ``wait`` s from now."""
    now[0] += wait
    return collector.sample()[1][0].stale_age_s is None


def test_one_fast_read_halves_the_back_off_rather_than_clearing_it() -> None:
    """Review finding 4: a flapping device (slow, fast, slow) backs off longer each time it is
    slow after a long back-off; one fast read halves it rather than starting again at 5 s."""
    now = [0.0]
    fake = FakeNVML(two_devices())
    slow = {0}
    _slowed(fake, now, slow)
    collector = GpuCollector(fake, clock=lambda: now[0], slow_device_s=0.25)
    collector.sample()  # slow: 5 s
    assert _read_again_after(collector, now, 5.0)  # slow: 10 s
    assert _read_again_after(collector, now, 10.0)  # slow: 20 s
    assert _read_again_after(collector, now, 20.0)  # slow: 40 s
    slow.clear()
    assert _read_again_after(collector, now, 40.0)  # fast: halved to 20 s, read next time
    slow.add(0)
    assert _read_again_after(collector, now, 0.1)  # slow again: 2 x 20 = 40 s, not 5 s
    assert not _read_again_after(collector, now, 30.0)


def test_the_back_off_is_capped() -> None:
    now = [0.0]
    fake = FakeNVML(two_devices())
    _slowed(fake, now, {0})
    collector = GpuCollector(fake, clock=lambda: now[0], slow_device_s=0.25)
    collector.sample()
    for wait in (5.0, 10.0, 20.0, 40.0, MAX_BACKOFF_S, MAX_BACKOFF_S):
        assert not _read_again_after(collector, now, wait - 0.5)
        assert _read_again_after(collector, now, 0.5)


def test_pace_leaves_a_slow_nvml_start_out() -> None:
    """Review finding 2: a 3 s nvmlInit does not hold the next sweep back 3 s."""
    now = [0.0]
    fake = FakeNVML(two_devices())
    init = fake.nvmlInit  # type: ignore[attr-defined]

    def slow_init() -> None:
        now[0] += 3.0
        init()

    fake.nvmlInit = slow_init  # type: ignore[attr-defined]
    collector = GpuCollector(fake, clock=lambda: now[0], slow_device_s=0.25)
    collector.sample()
    assert collector.pace_s == 0.0


def test_a_device_slow_in_its_process_listings_is_not_asked_the_others() -> None:
    now = [0.0]
    fake = FakeNVML(two_devices())
    compute = getattr(fake, COMPUTE + "_v3")

    def slow_listing(handle: Handle) -> Any:
        now[0] += 1.0
        return compute(handle)

    setattr(fake, COMPUTE + "_v3", slow_listing)
    collector = GpuCollector(fake, clock=lambda: now[0], slow_device_s=0.25)
    _, devices = collector.sample()
    assert fake.count(GRAPHICS + "_v3") == 0  # neither device: both were slow in the compute list
    assert (
        devices[0].unavailable_reason == "NVML: slow to answer" and devices[0].memory_used_bytes == 20 * GiB
    )


def test_extras_a_device_does_not_support_are_not_asked_again_each_sweep() -> None:
    """Per-process utilisation, energy and clock reasons NOT_SUPPORTED (an older card, a vGPU):
    asked once, not at every sweep on every such device (found in review: three failing calls
    a device a sweep, for nothing)."""
    extras = (
        "nvmlDeviceGetProcessUtilization",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetCurrentClocksEventReasons",
    )
    fake = FakeNVML(two_devices())

    def unsupported(*args: Any) -> Any:
        raise NVMLError_NotSupported()

    for name in extras:
        setattr(fake, name, fake._recorded(name, unsupported))
    collector = GpuCollector(fake)
    for _ in range(3):
        _, devices = collector.sample()
    assert [fake.count(name) for name in extras] == [2, 2, 2]  # once on each of the two devices
    assert all(p.sm_percent is None for d in devices for p in d.processes)
    assert all(d.power_w is None and d.clock_events == () for d in devices)
