"""dlmon against a stand-in libnvidia-ml.so.1 (tests/fake_nvml): the real nvidia-ml-py, its
ctypes structs and its two-call process lists run.

Each test writes the stand-in's config, then runs dlmon in a child process whose
LD_LIBRARY_PATH points at the stand-in (see tests/nvml_support.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from nvml_support import build, run_python

from dlmon.model.snapshot import GpuDevice, GpuProcess

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
    assert first.unavailable_reason is None


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
