"""dlmon against a stand-in libnvidia-ml.so.1 (tests/fake_nvml): the real nvidia-ml-py, its
ctypes structs and its two-call process lists run; and a hung NVML call never freezes sampling.

Each test writes the stand-in's config, then runs dlmon in a child process whose
LD_LIBRARY_PATH points at the stand-in (see tests/support/nvml.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from dlmon.collect.gpu import GpuCollector
from dlmon.collect.gpu_sweep import GpuSweep
from dlmon.model.serialize import snapshot_from_dict, snapshot_to_dict
from dlmon.model.snapshot import GpuDevice, GpuProcess, GpuStatus
from support.nvml import build, environment, run_python

pynvml = pytest.importorskip("pynvml")

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = build(tmp_path_factory.mktemp("fake_nvml"))
    if built is None:
        pytest.skip("no C compiler to build the stand-in libnvidia-ml.so.1")
    return built


@pytest.fixture
def host_namespace() -> None:
    """For a test that runs ``dlmon record`` on a target and lists the target's pid (as seen here)
    in the stand-in: that models dlmon on the host, where NVML's pids are its own. On a test
    machine that is itself in a container's pid namespace it would model NVML handing out
    container pids, which it never does; there it is skipped, and the container case is
    ``test_record_in_a_containers_pid_namespace_gives_nvmls_pids_to_no_process``."""
    from dlmon.collect.gpu import host_pids_visible

    if host_pids_visible() is not True:
        pytest.skip("this test machine is not in the host's pid namespace")


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "nvml.conf"
    path.write_text(text)
    return path


# One reading, as JSON on stdout: what GpuCollector makes of the stand-in through pynvml. The pid
# namespace is given, never taken from the test machine's: NVML's pids are host pids, and whether
# dlmon's are too decides what it does with them.
SAMPLE = """
    import json, sys
    from dlmon.collect.gpu import GpuCollector
    from dlmon.model.serialize import to_dict
    collector = GpuCollector(host_pids=sys.argv[1] == "host")
    status, devices = collector.sample()
    print(json.dumps({"status": to_dict(status), "devices": [to_dict(d) for d in devices]}))
    collector.close()
"""


def _sample(
    fake_nvml: Path, config: Path, namespace: str = "host"
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    result = run_python(SAMPLE, fake_nvml, config, args=(namespace,))
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


# nvidia-ml-py 12.535.77's process struct: 32 bytes, where the driver fills 24-byte entries.
BINDINGS_12_535_77 = """
    import ctypes, json, sys
    import pynvml

    class c_nvmlProcessInfo_v3_t(pynvml._PrintableStructure):
        _fields_ = [
            ("pid", ctypes.c_uint),
            ("usedGpuMemory", ctypes.c_ulonglong),
            ("gpuInstanceId", ctypes.c_uint),
            ("computeInstanceId", ctypes.c_uint),
            ("usedGpuCcProtectedMemory", ctypes.c_ulonglong),
        ]

    pynvml.c_nvmlProcessInfo_v3_t = c_nvmlProcessInfo_v3_t
    from dlmon.collect.gpu import GpuCollector
    from dlmon.model.serialize import to_dict
    collector = GpuCollector(host_pids=True)
    status, devices = collector.sample()
    print(json.dumps([to_dict(d) for d in devices]))
    collector.close()
"""


def test_bindings_with_a_32_byte_process_struct_still_read_every_pid(fake_nvml: Path, tmp_path: Path) -> None:
    """Issue 24 item 3: with 12.535.77's struct the _v3 list misreads every entry after the first
    (garbage pids shown as other processes). dlmon checks the size at start and reads the _v2
    list, whose struct is the driver's."""
    config = _config(
        tmp_path,
        f"device\nname G\nuuid GPU-1\ntotal {80 * GiB}\nused {9 * GiB}\n"
        f"compute 4101 {1 * GiB}\ncompute 4102 {2 * GiB}\ncompute 4103 {3 * GiB}\n",
    )
    result = run_python(BINDINGS_12_535_77, fake_nvml, config)
    assert result.returncode == 0, result.stderr
    (device,) = json.loads(result.stdout)
    assert [(p["pid"], p["used_memory_bytes"]) for p in device["processes"]] == [
        (4101, 1 * GiB),
        (4102, 2 * GiB),
        (4103, 3 * GiB),
    ]
    assert device["unavailable_reason"] is None


def test_a_misread_process_entry_is_never_shown_as_a_process() -> None:
    """Entries whose pid cannot be a pid (0, or past Linux's limit) are dropped and said, not
    shown as another user's process holding VRAM."""

    class Entry:
        def __init__(self, pid: int, used: int) -> None:
            self.pid, self.usedGpuMemory = pid, used

    class Library:
        def nvmlInit(self) -> None: ...
        def nvmlSystemGetDriverVersion(self) -> str:
            return "550.1"

        def nvmlDeviceGetCount(self) -> int:
            return 1

        def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
            return object()

        def nvmlDeviceGetName(self, handle: object) -> str:
            return "G"

        def nvmlDeviceGetUUID(self, handle: object) -> str:
            return "GPU-1"

        def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[Entry]:
            return [Entry(4101, GiB), Entry(0, 4101), Entry(4294967295, 0)]

    from dlmon.collect.gpu import GpuCollector

    _, devices = GpuCollector(Library(), host_pids=True).sample()
    assert [p.pid for p in devices[0].processes] == [4101]
    assert "process list misread" in (devices[0].unavailable_reason or "")


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


def test_a_config_path_that_cannot_be_opened_fails_nvml_init(fake_nvml: Path, tmp_path: Path) -> None:
    """A mistyped DLMON_FAKE_NVML must not silently pass for the stand-in's default device."""
    status, devices = _sample(fake_nvml, tmp_path / "no-such.conf")
    assert devices == [] and status["available"] is False
    assert status["reason"] == "NVML failed to start: Unknown Error."


def test_free_memory_never_wraps_when_used_exceeds_total(fake_nvml: Path, tmp_path: Path) -> None:
    code = """
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        print(v1.free, v2.free)
    """
    config = _config(tmp_path, f"device\ntotal {GiB}\nused {2 * GiB}\nreserved {MiB}\n")
    result = run_python(code, fake_nvml, config)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "0"]


# -- item 1: MIG ---------------------------------------------------------------------------------

# Card 0 in MIG mode, as in a pod without admin rights (its aggregate figures refused): two 1g
# slices in slots 0 and 2, the job on slot 2; card 1 a whole card.
MIG = f"""
device
name NVIDIA H200
uuid GPU-aaaaaaaa-0000-0000-0000-000000000000
mig 1
mig_device 0
uuid MIG-00000000-1111-2222-3333-444444444444
total {18 * GiB}
used {1 * GiB}
mig_device 2
uuid MIG-22222222-1111-2222-3333-444444444444
total {18 * GiB}
used {{slice_used}}
compute {{pid}} {{job_used}}
device
name NVIDIA H200
uuid GPU-bbbbbbbb-0000-0000-0000-000000000000
util 12
"""


def _mig_config(tmp_path: Path, pid: int, slice_used: int, job_used: int, extra: str = "") -> Path:
    text = MIG.format(pid=pid, slice_used=slice_used, job_used=job_used)
    return _config(tmp_path, text.replace("mig 1\n", f"mig 1\n{extra}"))


def _gpu_devices(devices: list[dict[str, Any]]) -> tuple[GpuDevice, ...]:
    return tuple(
        GpuDevice(**{**d, "processes": tuple(GpuProcess(**p) for p in d["processes"])}) for d in devices
    )


def test_mig_devices_are_devices_of_their_own_with_memory_processes_and_mig_uuids(
    fake_nvml: Path, tmp_path: Path
) -> None:
    status, raw = _sample(fake_nvml, _mig_config(tmp_path, 4242, 6 * GiB, 5 * GiB))
    assert status["available"] is True
    card, first, second, whole = _gpu_devices(raw)
    # The card: in MIG mode, its refused aggregate memory and unreported utilisation are its
    # mode, not an error; no process list of its own (its slices have them).
    assert (card.key, card.mig_mode, card.is_mig_parent) == ("0", True, True)
    assert (card.memory_used_bytes, card.utilization_percent, card.processes) == (None, None, ())
    assert card.unavailable_reason is None
    assert [(d.key, d.uuid) for d in (first, second)] == [
        ("0:0", "MIG-00000000-1111-2222-3333-444444444444"),
        ("0:2", "MIG-22222222-1111-2222-3333-444444444444"),
    ]
    assert (second.memory_used_bytes, second.memory_total_bytes) == (6 * GiB, 18 * GiB)
    assert second.processes == (GpuProcess(4242, 5 * GiB),)  # the job's 5 GiB on its slice
    assert first.processes == () and first.name == "NVIDIA H200 MIG 1g.18gb"
    assert all(
        d.mig_mode and d.utilization_percent is None and d.unavailable_reason is None for d in (first, second)
    )
    assert (whole.key, whole.mig_mode, whole.utilization_percent) == ("1", None, 12.0)


def test_a_privileged_mig_card_shows_its_aggregate_memory_but_lists_no_process_twice(
    fake_nvml: Path, tmp_path: Path
) -> None:
    _, raw = _sample(fake_nvml, _mig_config(tmp_path, 4242, 6 * GiB, 5 * GiB, "mig_privileged\n"))
    card, _first, second, _whole = _gpu_devices(raw)
    assert card.memory_used_bytes == 10 * GiB and card.processes == ()
    assert second.processes == (GpuProcess(4242, 5 * GiB),)


def _mig_snapshot(devices: tuple[GpuDevice, ...], t: float = 0.0) -> Any:
    import dataclasses

    from support.ui import T0, make_snapshot

    return dataclasses.replace(make_snapshot(T0 + t, gpus=1), gpus=devices)


def test_vram_pressure_judges_the_mig_slice_not_the_card(fake_nvml: Path, tmp_path: Path) -> None:
    from dlmon.analysis import Analyzer
    from support.ui import MAIN_PID

    def alerts(config: Path) -> list[Any]:
        _, raw = _sample(fake_nvml, config)
        analyzer = Analyzer(cores=2, strict=True)
        outs = [analyzer(_mig_snapshot(_gpu_devices(raw), t)) for t in range(8)]
        return [a for a in outs[-1].alerts if a.kind == "vram_pressure"]

    # The job's slice is 99% full: that is the next step's out-of-memory error, on a card
    # whose 141 GiB would say "10% used".
    full = alerts(_mig_config(tmp_path, MAIN_PID, int(17.8 * GiB), 17 * GiB, "mig_privileged\n"))
    assert [(a.subject, a.severity) for a in full] == [("GPU 0:2", "critical")]
    assert "GPU 0:2 (NVIDIA H200 MIG 1g.18gb) memory is 99% full" in full[0].message
    # Healthy: the job's slice is a third full; the card as a whole (other tenants' slices,
    # read as root) nearly full is not this job's to judge.
    healthy = _mig_config(tmp_path, MAIN_PID, 6 * GiB, 5 * GiB, "mig_privileged\nused 140000000000\n")
    assert alerts(healthy) == []


def _with_agent(snapshot: Any, agent: bool = True) -> Any:
    """``snapshot`` whose main process has an agent that answers (torch's thread count known)."""
    import dataclasses

    from support.ui import MAIN_PID

    threads = 4 if agent else None
    procs = tuple(
        dataclasses.replace(p, torch_threads=threads) if p.pid == MAIN_PID else p for p in snapshot.processes
    )
    return dataclasses.replace(snapshot, processes=procs)


def test_vram_pressure_leaves_a_gpu_where_the_job_has_only_its_pinning_context(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """A CPU-only job with pin_memory=True on a shared box: the pinning thread's context puts the
    trainer in NVML's list on GPU 0 (500 MiB), which a colleague has filled to 96%. torch (the
    agent) holds nothing there: the job cannot run out of memory on it, so no vram_pressure.
    The same GPU with the job's tensors on it (torch holds 2 GiB) still raises it."""
    from dlmon.analysis import Analyzer
    from dlmon.collect.agent_client import AgentReading, TorchDeviceMemory, merge_torch_memory
    from support.ui import MAIN_PID

    box = f"device\ntotal {80 * GiB}\nused {77 * GiB}\ncompute 7 {int(76.5 * GiB)}\n"
    box += f"compute {MAIN_PID} {500 * MiB}\ndevice\ntotal {80 * GiB}\nused {1 * GiB}\n"
    _, raw = _sample(fake_nvml, _config(tmp_path, box))

    def alerts(torch_bytes: int) -> list[tuple[str, str]]:
        memory = TorchDeviceMemory(MAIN_PID, 0, "GPU-fake-0", None, torch_bytes, torch_bytes, torch_bytes)
        reading = AgentReading(time=0.0, pids=(MAIN_PID,), devices=(memory,))
        gpus = merge_torch_memory(_gpu_devices(raw), reading)
        analyzer = Analyzer(cores=2, strict=True)
        outs = [analyzer(_with_agent(_mig_snapshot(gpus, t), agent)) for t in range(8)]
        return [(a.subject, a.kind) for a in outs[-1].alerts if a.kind == "vram_pressure"]

    agent = True
    assert alerts(0) == []
    assert alerts(2 * GiB) == [("GPU 0", "vram_pressure")]
    # A job process NVML lists there that torch's figures do not cover (no agent answers in
    # it): its memory may be anything, so the GPU is judged.
    agent = False
    assert alerts(0) == [("GPU 0", "vram_pressure")]


def test_torch_memory_on_a_mig_device_is_matched_by_its_mig_uuid(fake_nvml: Path, tmp_path: Path) -> None:
    from dlmon.collect.agent_client import AgentReading, TorchDeviceMemory, merge_torch_memory

    _, raw = _sample(fake_nvml, _mig_config(tmp_path, 4242, 6 * GiB, 5 * GiB))
    torch_says = AgentReading(
        time=0.0,
        pids=(4242,),
        # torch calls the slice cuda:0 and gives its MIG UUID
        devices=(
            TorchDeviceMemory(
                4242, 0, "MIG-22222222-1111-2222-3333-444444444444", None, 3 * GiB, 4 * GiB, None
            ),
        ),
    )
    merged = {d.key: d.torch_reserved_bytes for d in merge_torch_memory(_gpu_devices(raw), torch_says)}
    assert merged == {"0": None, "0:0": None, "0:2": 4 * GiB, "1": None}


def test_the_gpu_panel_shows_the_mig_card_and_its_slices(fake_nvml: Path, tmp_path: Path) -> None:
    from dlmon.ui.state import DashboardState
    from dlmon.ui.text import text_of
    from dlmon.ui.views.gpu import gpu_lines
    from support.ui import MAIN_PID

    _, raw = _sample(fake_nvml, _mig_config(tmp_path, MAIN_PID, 6 * GiB, 5 * GiB))
    state = DashboardState()
    state.ingest(_mig_snapshot(_gpu_devices(raw)))
    full = [text_of(line) for line in gpu_lines(state, 200, compact=False, detailed=True)]
    heads = [line for line in full if line.startswith("GPU")]
    assert heads[0].startswith("GPU0 MIG mode: memory and processes per MIG device")
    assert "utilisation not reported in MIG mode" in heads[0] and "n/a" not in heads[0]
    assert heads[2].startswith("GPU0:2 MIG mem 6.00G/18.0G (33%)"), heads[2]
    assert "utilisation not reported in MIG mode" in heads[2]
    assert any(f"pid {MAIN_PID} main 5.00G" in line for line in full), full
    assert heads[3].startswith("GPU1 mem") and "util 12%" in heads[3]
    compact = text_of(gpu_lines(state, 200, compact=True)[0])
    assert "0: MIG mode" in compact and "0:2: 6.00G/18.0G util n/a in MIG" in compact, compact


SLOW_SLICE = """
    import json, sys, time
    from dlmon.collect.gpu import GpuCollector
    from dlmon.model.serialize import to_dict
    collector = GpuCollector(host_pids=True, slow_device_s=0.2)
    collector.sample()  # quick: the slice is slow from 0.3 s after NVML's start
    time.sleep(0.5)
    readings = [collector.sample(), collector.sample()]  # slow, then backed off
    print(json.dumps([[to_dict(d) for d in devices] for _, devices in readings]))
    collector.close()
"""


def test_a_mig_slice_slow_to_answer_is_shown_n_a_not_dropped_with_the_slices_after_it(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """Slice 0's memory call takes 0.4 s (the device's limit is 0.2 s): the card's read stops
    there, as for a whole card; slice 0 and slice 2 (not asked) must still be there, n/a and
    saying why, in this reading and in the backed-off one after it, rather than vanish from the
    panel, Prometheus and vram_pressure. The first sweep reads the slices quickly."""
    config = _mig_config(tmp_path, 4242, 6 * GiB, 5 * GiB)
    slow = config.read_text().replace(
        "mig_device 0\n",
        "mig_device 0\ndelay_ms 400\ndelay_fn nvmlDeviceGetMemoryInfo_v2\nhang_after_ms 300\n",
    )
    config.write_text(slow)
    result = run_python(SLOW_SLICE, fake_nvml, config)
    assert result.returncode == 0, result.stderr
    slowed, backed_off = json.loads(result.stdout)
    for devices in (slowed, backed_off):
        slices = {(d["index"], d["mig_index"]): d for d in devices if d["mig_index"] is not None}
        assert sorted(slices) == [(0, 0), (0, 2)], devices
        assert all(d["unavailable_reason"] == "NVML: slow to answer" for d in slices.values()), slices
        assert slices[(0, 0)]["memory_used_bytes"] == 1 * GiB  # the slow call did answer
        assert slices[(0, 2)]["memory_used_bytes"] is None  # not asked
        assert slices[(0, 2)]["uuid"] == "MIG-22222222-1111-2222-3333-444444444444"
    # card 0 and its slices backed off (the last reading, stale); card 1 read afresh
    assert [d["stale_age_s"] is not None for d in backed_off] == [True, True, True, False]


def test_record_of_a_job_on_a_mig_slice_has_the_slice_and_the_jobs_vram(
    fake_nvml: Path, tmp_path: Path, host_namespace: None
) -> None:
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        config = _mig_config(tmp_path, target.pid, 6 * GiB, 5 * GiB)
        out = tmp_path / "record.jsonl"
        result = subprocess.run(
            [*DLMON_RECORD, str(target.pid), "-o", str(out), "--interval", "0.5", "--duration", "2"],
            capture_output=True,
            text=True,
            timeout=60,
            env=environment(fake_nvml, config),
        )
    finally:
        target.kill()
        target.wait()
    assert result.returncode == 0, result.stderr
    snapshots = [s for s in map(json.loads, out.read_text().splitlines()) if "gpus" in s]
    last = snapshots[-1]
    slices = [(g["index"], g["mig_index"], g["uuid"]) for g in last["gpus"] if g["mig_index"] is not None]
    assert slices == [
        (0, 0, "MIG-00000000-1111-2222-3333-444444444444"),
        (0, 2, "MIG-22222222-1111-2222-3333-444444444444"),
    ]
    assert last["gpus"][0]["mig_mode"] is True and last["gpus"][0]["unavailable_reason"] is None
    assert last["gpus"][2]["processes"] == [
        {"pid": target.pid, "used_memory_bytes": 5 * GiB, "sm_percent": None}
    ]
    (main,) = [p for p in last["processes"] if p["pid"] == target.pid]
    assert main["gpu_memory_bytes"] == 5 * GiB


# -- item 7: job figures that count the machine ----------------------------------------------


def test_export_all_jobs_sweeps_nvml_once_per_tick_however_many_jobs(fake_nvml: Path, tmp_path: Path) -> None:
    """Three jobs, four ticks: four NVML sweeps (one nvmlDeviceGetCount each), not twelve, and
    every job's snapshot has the GPUs."""
    code = f"""
        import ctypes, json, subprocess, sys, time
        from dlmon.analysis import Analyzer
        from dlmon.collect.sampler import Sampler
        from dlmon.export.jobs import JobsExporter

        jobs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
        try:
            exporter = JobsExporter(1.0, discover=lambda: {{job.pid for job in jobs}})
            for _ in range(4):
                exporter.tick()
                time.sleep(0.3)  # past the sweep's pace: each tick may start a sweep
            gpus = [len(published.snapshot.gpus) for _, published in exporter.latest]
            lib = ctypes.CDLL({str(fake_nvml / "libnvidia-ml.so.1")!r})
            lib.fakeNvmlCountCalls.restype = ctypes.c_ulong
            print(json.dumps({{"sweeps": lib.fakeNvmlCountCalls(), "gpus": gpus}}))
        finally:
            for job in jobs:
                job.kill()
    """
    result = run_python(code, fake_nvml, _config(tmp_path, TWO_DEVICES))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["gpus"] == [2, 2, 2]
    # At most one sweep a tick (12 before); fewer where a loaded machine leaves one in flight.
    assert 1 <= data["sweeps"] <= 4, data


# A GPU box the job shares: colleagues' processes on both cards (60 and 30 GiB of 80).
SHARED_BOX = f"""
device
total {80 * GiB}
used {62 * GiB}
compute 7 {60 * GiB}
{{job}}
device
total {80 * GiB}
used {30 * GiB}
compute 8 {30 * GiB}
"""


def test_the_run_summarys_vram_is_the_jobs_processes_not_every_gpu(
    fake_nvml: Path, tmp_path: Path, host_namespace: None
) -> None:
    from dlmon.export.text import format_text
    from dlmon.flow.summary import summarize

    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        config = _config(tmp_path, SHARED_BOX.format(job=f"compute {target.pid} {2 * GiB}"))
        out = tmp_path / "record.jsonl"
        result = subprocess.run(
            [*DLMON_RECORD, str(target.pid), "-o", str(out), "--interval", "0.5", "--duration", "2"],
            capture_output=True,
            text=True,
            timeout=60,
            env=environment(fake_nvml, config),
        )
    finally:
        target.kill()
        target.wait()
    assert result.returncode == 0, result.stderr
    summary = summarize(str(out))
    assert summary.peaks["vram"].value == 2 * GiB  # not the 92 GiB both cards hold
    (line,) = [x for x in format_text(summary).splitlines() if "VRAM used" in x]
    assert "VRAM used (the job's processes)" in line and "2.0 GiB" in line, line


def _pin_advice(
    fake_nvml: Path, tmp_path: Path, job_line: str, pin_memory: bool, torch_reserved: int | None = None
) -> list[str]:
    """advise() on a job whose GPUs are the stand-in's reading of SHARED_BOX; with
    ``torch_reserved``, the trainer's agent says torch holds that much on GPU 0."""
    import dataclasses

    from dlmon.analysis import advise
    from dlmon.collect.agent_client import AgentReading, TorchDeviceMemory, merge_torch_memory
    from support.snapshots import MAIN_PID, loader, proc, snap

    _, raw = _sample(fake_nvml, _config(tmp_path, SHARED_BOX.format(job=job_line.format(pid=MAIN_PID))))
    gpus = _gpu_devices(raw)
    if torch_reserved is not None:
        memory = TorchDeviceMemory(MAIN_PID, 0, "GPU-fake-0", None, 0, torch_reserved, 0)
        gpus = merge_torch_memory(gpus, AgentReading(time=0.0, pids=(MAIN_PID,), devices=(memory,)))
    workers = [proc(1001 + i, uss=100 * MiB, pss=150 * MiB, cpu=30.0) for i in range(2)]
    main = dataclasses.replace(
        proc(MAIN_PID, "main", uss=800 * MiB, pss=900 * MiB, cpu=60.0), torch_threads=4
    )
    loaders = [loader(num_workers=2, batch_size=64, wait=0.05, pin_memory=pin_memory)]
    history = [
        dataclasses.replace(snap(t, [main, *workers], available=64 * GiB, loaders=loaders), gpus=gpus)
        for t in range(5)
    ]
    return [
        f"{x.text} because {x.because}" for x in advise(history, cores=8).lines if x.topic == "pin_memory"
    ]


def test_a_cpu_only_job_on_a_gpu_box_is_not_told_to_pin_memory(fake_nvml: Path, tmp_path: Path) -> None:
    assert _pin_advice(fake_nvml, tmp_path, "", pin_memory=False) == []
    (line,) = _pin_advice(fake_nvml, tmp_path, "", pin_memory=True)
    assert line.startswith("Set pin_memory=False: the job uses no CUDA device")


def test_a_cpu_only_job_pinning_on_a_real_driver_is_told_to_stop(fake_nvml: Path, tmp_path: Path) -> None:
    """What a real driver shows of a CPU-only job with pin_memory=True: the pinning thread's
    cudaHostAlloc makes a CUDA context on the current device, so NVML lists the trainer there
    (~500 MiB of context), while torch holds no device memory. That is still a job that uses no
    CUDA device for its tensors: pinning costs it a thread and page-locked memory for nothing."""
    context = f"compute {{pid}} {500 * MiB}"
    (line,) = _pin_advice(fake_nvml, tmp_path, context, pin_memory=True, torch_reserved=0)
    assert line.startswith("Set pin_memory=False: the job uses no CUDA device"), line
    assert "torch holds no memory on any GPU" in line
    # Healthy: the same context, torch's tensors on it: no "set it False".
    busy = _pin_advice(fake_nvml, tmp_path, context, pin_memory=True, torch_reserved=2 * GiB)
    assert not any("pin_memory=False" in x for x in busy), busy


def test_a_job_on_a_mig_slice_whose_torch_names_the_card_is_not_told_to_stop_pinning(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """Healthy: a pod's job on a MIG slice (NVML's pids not its own, so torch's figures are the
    only evidence), whose torch gives the card's UUID rather than the slice's (which UUID a CUDA
    build reports for a MIG device is not yet seen on hardware, docs/gpu.md): torch's 4 GiB on
    the card still say the job uses CUDA: no "Set pin_memory=False"."""
    import dataclasses

    from dlmon.analysis import advise
    from dlmon.collect.agent_client import AgentReading, TorchDeviceMemory, merge_torch_memory
    from support.snapshots import MAIN_PID, loader, proc, snap

    _, raw = _sample(fake_nvml, _mig_config(tmp_path, 91234, 6 * GiB, 5 * GiB), "container")
    memory = TorchDeviceMemory(
        MAIN_PID, 0, "GPU-aaaaaaaa-0000-0000-0000-000000000000", None, 3 * GiB, 4 * GiB, 0
    )
    gpus = merge_torch_memory(_gpu_devices(raw), AgentReading(time=0.0, pids=(MAIN_PID,), devices=(memory,)))
    main = dataclasses.replace(
        proc(MAIN_PID, "main", uss=800 * MiB, pss=900 * MiB, cpu=60.0), torch_threads=4
    )
    loaders = [loader(num_workers=0, batch_size=64, wait=0.05, pin_memory=True)]
    history = [
        dataclasses.replace(snap(t, [main], available=64 * GiB, loaders=loaders), gpus=gpus) for t in range(5)
    ]
    texts = [x.text for x in advise(history, cores=8).lines if x.topic == "pin_memory"]
    assert not any("pin_memory=False" in x for x in texts), texts


def test_a_gpu_job_on_a_shared_box_keeps_its_pin_memory_advice(fake_nvml: Path, tmp_path: Path) -> None:
    """Healthy: the job's trainer is on GPU 0; pin_memory=True draws no "set it False"."""
    job = f"compute {{pid}} {2 * GiB}"
    assert not any("pin_memory=False" in x for x in _pin_advice(fake_nvml, tmp_path, job, pin_memory=True))
    (line,) = _pin_advice(fake_nvml, tmp_path, job, pin_memory=False)
    assert line.startswith("Set pin_memory=True")


# -- item 8: CUDA inside DataLoader workers -----------------------------------------------------

# A real training whose DataLoader starts its workers with 'spawn' (as a worker that may use CUDA
# must); it prints its workers' pids once they deliver, then keeps training.
SPAWN_JOB = """
import sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset
dl = DataLoader(TensorDataset(torch.zeros(100_000, 4)), batch_size=2, num_workers=2,
                multiprocessing_context="spawn", persistent_workers=True)
it = iter(dl)
next(it)
print(" ".join(str(w.pid) for w in it._workers), flush=True)
while True:
    next(it)
    time.sleep(0.02)
"""


def _cuda_in_worker_alerts(
    fake_nvml: Path, tmp_path: Path, job_lines: Callable[[int, list[int]], str]
) -> tuple[list[dict[str, Any]], int, list[int]]:
    """``dlmon record`` of a real spawn-worker job while the stand-in lists ``job_lines(trainer,
    workers)`` on GPU 0: the last snapshot's cuda_in_worker alerts."""
    pytest.importorskip("torch")
    job = subprocess.Popen([sys.executable, "-c", SPAWN_JOB], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None
        workers = [int(x) for x in job.stdout.readline().split()]
        assert len(workers) == 2, workers
        config = _config(tmp_path, f"device\ntotal {80 * GiB}\nused {4 * GiB}\n{job_lines(job.pid, workers)}")
        out = tmp_path / "record.jsonl"
        result = subprocess.run(
            [*DLMON_RECORD, str(job.pid), "-o", str(out), "--interval", "0.5", "--duration", "6"],
            capture_output=True,
            text=True,
            timeout=90,
            env=environment(fake_nvml, config),
        )
    finally:
        job.kill()
        job.wait()
    assert result.returncode == 0, result.stderr
    last = [s for s in map(json.loads, out.read_text().splitlines()) if "alerts" in s][-1]
    return [a for a in last["alerts"] if a["kind"] == "cuda_in_worker"], job.pid, workers


def test_a_spawn_worker_holding_a_cuda_context_is_flagged_with_its_vram(
    fake_nvml: Path, tmp_path: Path, host_namespace: None
) -> None:
    alerts, trainer, workers = _cuda_in_worker_alerts(
        fake_nvml, tmp_path, lambda main, w: f"compute {main} {2 * GiB}\ncompute {w[0]} {500 * MiB}\n"
    )
    (alert,) = alerts
    assert alert["subject"] == f"workers of pid {trainer}"
    assert f"(pid {workers[0]}) 500.0 MiB on GPU 0" in alert["message"], alert["message"]
    assert str(workers[1]) not in alert["message"]
    assert alert["evidence"]["vram_bytes"] == 500 * MiB and alert["evidence"]["workers"] == 1
    assert "Keep CUDA out of the Dataset" in alert["advice"]


def test_a_trainer_with_vram_and_workers_without_is_no_cuda_in_worker(
    fake_nvml: Path, tmp_path: Path, host_namespace: None
) -> None:
    alerts, _, _ = _cuda_in_worker_alerts(fake_nvml, tmp_path, lambda main, w: f"compute {main} {2 * GiB}\n")
    assert alerts == []


# -- item 9: a driver reload, the real reason, the pid namespace --------------------------------

RELOAD = """
    import json, sys, time
    from dlmon.collect.gpu import GpuCollector
    from dlmon.model.serialize import to_dict
    collector = GpuCollector(host_pids=True)
    readings = [collector.sample()]
    time.sleep(1.5)  # the stand-in's driver is reloaded 1 s after the first init
    readings += [collector.sample(), collector.sample()]
    print(json.dumps([[to_dict(status), [to_dict(d) for d in devices]] for status, devices in readings]))
"""


def test_nvml_is_started_again_after_a_driver_reload(fake_nvml: Path, tmp_path: Path) -> None:
    """After a reload every call of the old NVML answers NVML_ERROR_UNINITIALIZED: the sweep
    that meets it starts NVML again and reads the GPUs in the same sweep."""
    result = run_python(RELOAD, fake_nvml, _config(tmp_path, "reload_after_ms 1000\n" + TWO_DEVICES))
    assert result.returncode == 0, result.stderr
    readings = json.loads(result.stdout)
    for status, devices in readings:
        assert status["available"] is True, status
        assert [d["memory_used_bytes"] for d in devices] == [20 * GiB, 3 * GiB]
        assert [d["unavailable_reason"] for d in devices] == [None, None]
        assert devices[0]["processes"][0] == {"pid": 4242, "used_memory_bytes": 18 * GiB, "sm_percent": 0.0}


def test_the_reason_is_the_missing_figures_not_the_first_error_of_the_read(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """memory_v2 is not supported (v1 answers: no figure is missing for it); utilisation times
    out: the device says why utilisation is missing, in NVML's words, not "not supported"."""
    config = TWO_DEVICES.replace(
        "util 91\n",
        "util 91\nfail nvmlDeviceGetMemoryInfo_v2 3\nfail nvmlDeviceGetUtilizationRates 10\n",
    )
    _, devices = _sample(fake_nvml, _config(tmp_path, config))
    first = devices[0]
    assert first["memory_used_bytes"] == 20 * GiB + 512 * MiB  # v1's, with the driver's reserve
    assert first["utilization_percent"] is None
    assert first["unavailable_reason"] == "NVML: Timeout"


def test_in_a_containers_pid_namespace_nvmls_host_pids_are_given_to_no_process(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """The same stand-in read in both namespaces, each named explicitly."""
    _, host = _sample(fake_nvml, _config(tmp_path, TWO_DEVICES), "host")
    status, container = _sample(fake_nvml, _config(tmp_path, TWO_DEVICES), "container")
    assert [p["pid"] for p in host[0]["processes"]] == [4242, 4243, 4300]
    assert [d["processes"] for d in container] == [[], []]
    assert status["process_memory_note"] is not None and "container" in status["process_memory_note"]
    assert [d["memory_used_bytes"] for d in container] == [d["memory_used_bytes"] for d in host]


def test_record_in_a_containers_pid_namespace_gives_nvmls_pids_to_no_process(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """``dlmon record`` and its target in a pid namespace of their own (a container): NVML lists
    host pid 2 with 5 GiB, which inside is the target's pid; dlmon gives it to no process and
    says why, and the devices' figures stay."""
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-Urpf", "--mount-proc", "true"], capture_output=True)
    if unshare is None or probe.returncode != 0:
        pytest.skip("cannot make a pid namespace here (unshare -Urpf)")
    config = _config(tmp_path, f"device\ncompute 2 {5 * GiB}\n")
    out = tmp_path / "record.jsonl"
    script = (
        f"{sys.executable} -c 'import time; time.sleep(30)' & echo target $!; "
        f"exec {' '.join(DLMON_RECORD)} $! -o {out} --interval 0.5 --duration 2"
    )
    result = subprocess.run(
        [unshare, "-Urpf", "--mount-proc", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment(fake_nvml, config),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:2] == ["target", "2"]
    snapshots = [s for s in map(json.loads, out.read_text().splitlines()) if "gpus" in s]
    last = snapshots[-1]
    assert last["gpu"]["process_memory_note"] is not None
    assert last["gpus"][0]["processes"] == [] and last["gpus"][0]["memory_used_bytes"] == 10 * GiB
    (target,) = [p for p in last["processes"] if p["pid"] == 2]
    assert target["gpu_memory_bytes"] is None


# -- item 5: containers ------------------------------------------------------------------------

# Run inside a pid namespace of its own (a container): a job holding /dev/nvidia0 open (a stand-in
# node under DEV), sampled and analysed by dlmon, which finds out for itself that NVML's pids are
# not its own.
IN_CONTAINER = """
    import json, os, subprocess, sys, time
    from pathlib import Path
    from dlmon.analysis import Analyzer
    from dlmon.collect.sampler import Sampler
    from dlmon.model.serialize import snapshot_to_dict
    dev = Path(sys.argv[1])
    for n in (0, 1):
        (dev / f"nvidia{n}").touch()
    hold = "import sys, time; node = open(sys.argv[1]); time.sleep(60)"
    job = subprocess.Popen([sys.executable, "-c", hold, str(dev / "nvidia0")])
    try:
        while not any(os.readlink(f"/proc/{job.pid}/fd/{fd}").endswith("nvidia0")
                      for fd in os.listdir(f"/proc/{job.pid}/fd")):
            time.sleep(0.05)
        sampler = Sampler(job.pid, dev_root=str(dev))
        analyzer = Analyzer(cores=2)
        for _ in range(9):
            snapshot = analyzer(sampler.sample())
            time.sleep(0.6)
        print(json.dumps(snapshot_to_dict(snapshot)))
    finally:
        job.kill()
"""

# GPU 0 (the job's, by its node) lists one process by host pid; GPU 1, two colleagues' at 95%.
CONTAINER_BOX = f"""
device
total {80 * GiB}
used {{used}}
compute 91234 {3 * GiB}
device
total {80 * GiB}
used {76 * GiB}
compute 95001 {40 * GiB}
compute 95002 {36 * GiB}
"""


def _in_container(fake_nvml: Path, tmp_path: Path, used: int) -> dict[str, Any]:
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-Urpf", "--mount-proc", "true"], capture_output=True)
    if unshare is None or probe.returncode != 0:
        pytest.skip("cannot make a pid namespace here (unshare -Urpf)")
    config = _config(tmp_path, CONTAINER_BOX.format(used=used))
    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    code = textwrap.dedent(IN_CONTAINER)
    result = subprocess.run(
        [unshare, "-Urpf", "--mount-proc", sys.executable, "-c", code, str(dev)],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment(fake_nvml, config),
    )
    assert result.returncode == 0, result.stderr
    return cast(dict[str, Any], json.loads(result.stdout))


def test_in_a_container_colleagues_full_gpu_is_counted_not_judged(fake_nvml: Path, tmp_path: Path) -> None:
    """The issue's case: a --gpus all container on a shared box; a colleague's GPU 1 is 95% full.
    Its processes are counted (none the job's: no process of the job holds /dev/nvidia1), and
    vram_pressure stays quiet; the job's own GPU 0 is counted as maybe the job's."""
    snapshot = _in_container(fake_nvml, tmp_path, used=4 * GiB)
    job_gpu, colleagues = snapshot["gpus"]
    assert (job_gpu["unattributed_processes"], job_gpu["other_processes"]) == (1, 0)
    assert job_gpu["unattributed_memory_bytes"] == 3 * GiB and job_gpu["processes"] == []
    assert (colleagues["unattributed_processes"], colleagues["other_processes"]) == (2, 2)
    assert colleagues["unattributed_memory_bytes"] == 76 * GiB
    assert [a for a in snapshot["alerts"] if a["kind"] == "vram_pressure"] == []

    from dlmon.model.serialize import snapshot_from_dict
    from dlmon.ui.state import DashboardState
    from dlmon.ui.text import text_of
    from dlmon.ui.views.gpu import gpu_lines

    state = DashboardState()
    state.ingest(snapshot_from_dict(snapshot))
    text = [text_of(line) for line in gpu_lines(state, 200, compact=False, detailed=True)]
    assert any("1 process by host pid 3.00G (maybe the job's)" in line for line in text), text
    assert any("2 processes by host pid 76.0G (none the job's)" in line for line in text), text


def test_in_a_container_the_jobs_own_full_gpu_still_raises_vram_pressure(
    fake_nvml: Path, tmp_path: Path
) -> None:
    snapshot = _in_container(fake_nvml, tmp_path, used=79 * GiB)
    alerts = [(a["subject"], a["severity"]) for a in snapshot["alerts"] if a["kind"] == "vram_pressure"]
    assert alerts == [("GPU 0", "critical")]


def test_device_holders_are_read_again_after_their_refresh_and_at_once_for_a_new_process(
    tmp_path: Path,
) -> None:
    """Real processes holding stand-in nodes; a fake clock, no waiting."""
    from dlmon.collect.gpu_holders import DeviceHolders

    for n in (0, 3):
        (tmp_path / f"nvidia{n}").touch()
    (tmp_path / "nvidiactl").touch()  # not a GPU's node
    hold = "import sys, time; nodes = [open(a) for a in sys.argv[1:]]; print(flush=True); time.sleep(60)"

    def holding(*names: str) -> subprocess.Popen[str]:
        nodes = [str(tmp_path / n) for n in names]
        job = subprocess.Popen([sys.executable, "-c", hold, *nodes], stdout=subprocess.PIPE, text=True)
        assert job.stdout is not None and job.stdout.readline() == "\n"
        return job

    now = [0.0]
    holders = DeviceHolders(dev_root=str(tmp_path), refresh_s=10.0, clock=lambda: now[0])
    first = holding("nvidia0", "nvidiactl")
    second = holding("nvidia0", "nvidia3")
    try:
        assert holders.read([first.pid]) == {0: {first.pid}}
        assert holders.read([first.pid, second.pid]) == {0: {first.pid, second.pid}, 3: {second.pid}}
        second.kill()
        second.wait()
        now[0] = 5.0  # within the refresh: what was read stands
        assert holders.read([first.pid, second.pid]) == {0: {first.pid, second.pid}, 3: {second.pid}}
        now[0] = 10.0
        assert holders.read([first.pid, second.pid]) == {0: {first.pid}}
        assert holders.read([first.pid]) == {0: {first.pid}}  # a process no longer asked for is dropped
    finally:
        for job in (first, second):
            job.kill()
            job.wait()


NOT_DUMPABLE = (
    "import ctypes, sys, time; node = open(sys.argv[1]); ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); "
    "print(flush=True); time.sleep(60)"
)


def test_a_job_process_whose_fds_cannot_all_be_read_leaves_no_gpu_certainly_a_colleagues(
    tmp_path: Path,
) -> None:
    """A job's process holding /dev/nvidia0 whose fds dlmon cannot read (not dumpable, read from
    a user namespace without CAP_SYS_PTRACE over it), or reads only in part (more fds than the
    limit): it may hold any node, so the holders are not known, rather than "none": else
    GPU 0 would be called certainly a colleague's and its vram_pressure never judged."""
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-Ur", "true"], capture_output=True)
    if unshare is None or probe.returncode != 0:
        pytest.skip("cannot make a user namespace here (unshare -Ur)")
    node = tmp_path / "nvidia0"
    node.touch()
    job = subprocess.Popen([sys.executable, "-c", NOT_DUMPABLE, str(node)], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None and job.stdout.readline() == "\n"
        code = (
            "import json, sys; from dlmon.collect.gpu_holders import DeviceHolders; "
            "print(json.dumps(DeviceHolders(dev_root=sys.argv[1]).read([int(sys.argv[2])])))"
        )
        result = subprocess.run(
            [unshare, "-Ur", sys.executable, "-c", code, str(tmp_path), str(job.pid)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) is None
    finally:
        job.kill()
        job.wait()

    from dlmon.collect.gpu_holders import DeviceHolders

    # fds 0-2, five others, then the node: a limit of 4 reads it in part
    hold = "import os, sys, time; [os.open(os.devnull, 0) for _ in range(5)]; n = open(sys.argv[1]); "
    many = subprocess.Popen(
        [sys.executable, "-c", hold + "print(flush=True); time.sleep(60)", str(node)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert many.stdout is not None and many.stdout.readline() == "\n"
        assert DeviceHolders(dev_root=str(tmp_path), max_fds=4).read([many.pid]) is None
        assert DeviceHolders(dev_root=str(tmp_path)).read([many.pid]) == {0: {many.pid}}
    finally:
        many.kill()
        many.wait()


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


def test_record_keeps_producing_snapshots_while_nvml_hangs_and_marks_the_gpu_figures_stale(
    fake_nvml: Path, tmp_path: Path, host_namespace: None
) -> None:
    """The one end-to-end run against a hanging stand-in: ``dlmon record`` goes on recording
    while every NVML call blocks 8 s, the last answer standing in, marked stale with its age.
    The bounds are loose on purpose: what is checked is that it goes on, not how fast (the
    speed targets live in benchmarks/sampler.py)."""
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
    assert len(snapshots) >= 8, len(snapshots)  # 20 at its pace; NVML's pace: 2 in 10 s
    first, last = snapshots[0], snapshots[-1]
    assert [g["stale_age_s"] for g in first["gpus"]] == [None, None]
    assert first["gpus"][0]["processes"] == [
        {"pid": target.pid, "used_memory_bytes": 2147483648, "sm_percent": 0.0}
    ]
    # The last answer stands in, marked stale with its age (it grows as the hang lasts).
    ages = [g["stale_age_s"] for g in last["gpus"]]
    assert all(age is not None and age > 1.0 for age in ages), ages
    assert last["gpus"][0]["memory_used_bytes"] == 10 * GiB
    stale = [s["gpus"][0]["stale_age_s"] for s in snapshots if s["gpus"][0]["stale_age_s"] is not None]
    assert stale == sorted(stale) and len(stale) >= 4


# -- GpuSweep with a Python stand-in collector, on a fake clock --------------------------------
#
# No wall-clock assertions and no sleeps: the sweep reads ``Clock``; its sampler-side wait is
# ``Wait`` (which either lets the fake time run out at once or waits to be told the sweep ended),
# and the stand-in collector blocks on an event the test sets.


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Wait:
    """The sampler thread's wait: ``hung`` lets the deadline pass at once (the fake time moves
    on by what was left); otherwise it waits (really, generously) until the sweep says it ended."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.hung = True
        self.calls: list[float] = []

    def __call__(self, cond: threading.Condition, seconds: float) -> None:
        self.calls.append(round(seconds, 6))
        if self.hung:
            self.clock.now += seconds
        else:
            cond.wait(30)


class StandIn:
    """Answers one device once ``release`` is set, ``took`` s later on the fake clock; raises
    what ``errors`` holds first. Counts its sweeps and the threads they ran on."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.release = threading.Event()
        self.entered = threading.Event()
        self.started = 0
        self.sweeps = 0
        self.took = 0.0
        self.pace_s = 0.0  # what GpuCollector says its healthy devices took
        self.device_stale: float | None = None  # a device the collector itself backed off
        self.errors: list[BaseException] = []
        self.threads: set[int] = set()
        self.closed_on: list[int] = []

    def sample(self) -> tuple[GpuStatus, tuple[GpuDevice, ...]]:
        self.started += 1
        self.threads.add(threading.get_ident())
        self.entered.set()
        assert self.release.wait(30)
        if self.errors:
            raise self.errors.pop(0)
        self.clock.now += self.took
        self.sweeps += 1
        device = GpuDevice(0, "fake", "GPU-0", self.sweeps, 100, 50.0, stale_age_s=self.device_stale)
        return GpuStatus(available=True), (device,)

    def close(self) -> None:
        self.closed_on.append(threading.get_ident())


def _sweep(collector: StandIn, wait: Wait, **kwargs: float) -> GpuSweep:
    return GpuSweep(cast(GpuCollector, collector), clock=collector.clock, wait=wait, **kwargs)


def _setup() -> tuple[StandIn, Wait]:
    clock = Clock()
    return StandIn(clock), Wait(clock)


def _sweep_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dlmon-gpu"]


def test_sweep_waits_no_longer_than_its_deadline_and_never_stacks_sweeps() -> None:
    collector, wait = _setup()
    before = set(_sweep_threads())
    sweep = _sweep(collector, wait, deadline_s=0.05, first_deadline_s=0.1)
    first = sweep.sample()
    assert wait.calls == [0.1]  # the first deadline, then no more
    assert first.status.available is False and first.devices == ()
    assert first.status.reason is not None and "NVML has not answered for" in first.status.reason
    assert collector.entered.wait(30)
    for _ in range(5):  # the sweep in flight is past its deadline: no wait, no second sweep
        assert sweep.sample().devices == ()
    assert wait.calls == [0.1] and collector.started == 1
    collector.release.set()
    assert sweep.idle(30)
    assert collector.sweeps == 1 and collector.started == 1
    wait.hung = False
    reading = sweep.sample()  # it ended: this tick starts the next one, which answers in time
    assert reading.devices[0].memory_used_bytes == 2 and reading.devices[0].stale_age_s is None
    assert collector.sweeps == 2
    assert len(collector.threads) == 1
    assert len(set(_sweep_threads()) - before) == 1
    sweep.close()
    assert collector.closed_on == list(collector.threads)  # on the sweep's thread


def test_sweep_marks_an_old_reading_stale_with_its_age() -> None:
    collector, wait = _setup()
    collector.release.set()
    wait.hung = False
    sweep = _sweep(collector, wait, deadline_s=0.05)
    fresh = sweep.sample()
    assert fresh.devices[0].stale_age_s is None and fresh.cpu_s >= 0.0
    collector.release.clear()  # NVML hangs from now on
    wait.hung = True
    collector.entered.clear()
    collector.clock.now += 1.0
    assert sweep.sample().devices[0].stale_age_s == 1.05  # a second sweep started, and hangs
    assert collector.entered.wait(30)
    collector.clock.now += 2.0
    stale = sweep.sample()  # no wait: that sweep is past its deadline
    assert stale.devices[0].stale_age_s == 3.05
    assert stale.devices[0].memory_used_bytes == fresh.devices[0].memory_used_bytes
    assert collector.started == 2
    collector.release.set()
    sweep.close()


def test_a_device_already_stale_in_a_reading_ages_on_from_its_own_age() -> None:
    """Review finding 1: a device the collector backed off is 5 s old in the reading; when the
    next sweep hangs, its age is 5 s plus the reading's, not the larger of the two."""
    collector, wait = _setup()
    collector.release.set()
    collector.device_stale = 5.0
    wait.hung = False
    sweep = _sweep(collector, wait, deadline_s=0.05)
    assert sweep.sample().devices[0].stale_age_s == 5.0
    collector.release.clear()
    wait.hung = True
    collector.clock.now += 1.0
    assert sweep.sample().devices[0].stale_age_s == 6.05
    collector.release.set()
    sweep.close()


def test_sweeps_are_paced_on_the_healthy_devices_not_on_a_hang_and_at_most_a_back_off() -> None:
    """Review finding 2: a sweep that took 8 s because one device hung (the collector's pace_s
    leaves it out) does not keep the next sweep back 8 s; and the pause is capped at 5 s."""
    collector, wait = _setup()
    collector.release.set()
    wait.hung = False
    collector.took, collector.pace_s = 8.0, 0.01
    sweep = _sweep(collector, wait, deadline_s=0.05, first_deadline_s=100.0)
    assert sweep.sample().devices[0].memory_used_bytes == 1
    collector.took = 0.0
    collector.clock.now += 0.5  # the next tick: a new sweep, fresh
    reading = sweep.sample()
    assert reading.devices[0].memory_used_bytes == 2 and reading.devices[0].stale_age_s is None
    collector.pace_s = 30.0  # the devices answered, slowly: refreshed no faster than that, to 5 s
    collector.clock.now += 0.5
    sweep.sample()
    collector.clock.now += 3.0
    assert sweep.sample().devices[0].stale_age_s is not None and collector.sweeps == 3
    collector.clock.now += 2.0
    assert sweep.sample().devices[0].memory_used_bytes == 4
    sweep.close()


def test_close_while_a_sweep_hangs_returns_and_nvml_is_shut_down_on_the_sweep_thread() -> None:
    collector, wait = _setup()
    sweep = _sweep(collector, wait, deadline_s=0.05)
    sweep.sample()
    assert collector.entered.wait(30)
    (thread,) = [t for t in _sweep_threads() if t.ident in collector.threads]
    closing = threading.Thread(target=sweep.close, kwargs={"timeout_s": 0.05})
    closing.start()
    closing.join(30)  # generous: close() gives up on the hung sweep after its timeout
    assert not closing.is_alive()
    assert collector.closed_on == []  # not shut down under the hung call, nor on the caller's thread
    collector.release.set()
    thread.join(30)
    assert not thread.is_alive()
    assert collector.closed_on == [thread.ident] and threading.get_ident() not in collector.closed_on


def test_sweep_hands_a_collector_bug_to_the_sampler_exactly_once() -> None:
    collector, wait = _setup()
    collector.release.set()
    collector.errors.append(ZeroDivisionError("a bug"))
    wait.hung = False
    sweep = _sweep(collector, wait, deadline_s=0.5)
    with pytest.raises(ZeroDivisionError):
        sweep.sample()
    reading = sweep.sample()  # not raised again; the next sweep answers
    assert reading.devices[0].memory_used_bytes == 1
    assert sweep.sample().devices[0].memory_used_bytes == 2
    sweep.close()


def test_stale_age_round_trips_and_old_records_read_as_fresh() -> None:
    import dataclasses

    from support.ui import make_snapshot

    snapshot = make_snapshot(gpus=1)
    stale = dataclasses.replace(snapshot, gpus=(dataclasses.replace(snapshot.gpus[0], stale_age_s=8.5),))
    assert snapshot_from_dict(json.loads(json.dumps(snapshot_to_dict(stale)))).gpus == stale.gpus
    old = snapshot_to_dict(snapshot)
    del old["gpus"][0]["stale_age_s"]  # a record from before the field
    assert snapshot_from_dict(old).gpus[0].stale_age_s is None


def test_the_gpu_panel_says_the_figures_are_stale_and_how_old() -> None:
    import dataclasses

    from dlmon.ui.state import DashboardState
    from dlmon.ui.text import text_of
    from dlmon.ui.views.gpu import gpu_lines
    from support.ui import make_snapshot

    snapshot = make_snapshot(gpus=2)
    gpus = (dataclasses.replace(snapshot.gpus[0], stale_age_s=8.4), snapshot.gpus[1])
    state = DashboardState()
    state.ingest(dataclasses.replace(snapshot, gpus=gpus))
    full = [text_of(line) for line in gpu_lines(state, 160, compact=False)]
    assert "stale 8s" in full[0] and "stale" not in full[1]
    compact = text_of(gpu_lines(state, 160, compact=True)[0])
    assert compact.count("stale 8s") == 1


def test_a_reading_under_a_second_old_says_so_not_0s() -> None:
    """Review finding 8: a reading that finished just after the tick gave up is stale 0.3 s."""
    import dataclasses

    from dlmon.ui.state import DashboardState
    from dlmon.ui.text import text_of
    from dlmon.ui.views.gpu import gpu_lines
    from support.ui import make_snapshot

    snapshot = make_snapshot(gpus=1)
    state = DashboardState()
    state.ingest(
        dataclasses.replace(snapshot, gpus=(dataclasses.replace(snapshot.gpus[0], stale_age_s=0.3),))
    )
    line = text_of(gpu_lines(state, 160, compact=False)[0])
    assert "stale <1s" in line and "stale 0s" not in line


# -- beyond: the trainer's GPU confirms or tempers input_bound -----------------------------------

INPUT_BOUND_JOB = """
import sys, time
import dlmon.agent

dlmon.agent.start()
import torch
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __len__(self):
        return 10**6

    def __getitem__(self, i):
        time.sleep(0.02)  # one worker, 8 samples a batch: the trainer waits nearly all the time
        return torch.zeros(4)


if __name__ == "__main__":
    print("READY", flush=True)
    end = time.monotonic() + float(sys.argv[1])
    for batch in DataLoader(Slow(), batch_size=8, num_workers=1):
        if time.monotonic() > end:
            break
"""


def test_a_real_input_bound_job_is_confirmed_by_its_idle_gpu_and_tempered_by_a_busy_one(
    fake_nvml: Path, tmp_path: Path, host_namespace: None
) -> None:
    """A real DataLoader job starved by its one slow worker, recorded twice by `dlmon record`
    with the stand-in listing the trainer on GPU 0: first beside a colleague whose kernels keep
    the GPU 99% busy while the trainer has no sample (it ran none), then running 97% itself. The
    record's input_bound says the trainer's own figure: critical and confirmed, then a warning
    whose wait is hidden behind GPU work. A colleague's GPU beside it is never the trainer's."""
    script = tmp_path / "job.py"
    script.write_text(INPUT_BOUND_JOB)
    env = environment(fake_nvml, _config(tmp_path, ""))
    job = subprocess.Popen([sys.executable, str(script), "120"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "READY"
        found = {}
        for case, own in (("shared", f"compute 7 {GiB}\nsm 7 99\n"), ("busy", f"sm {job.pid} 97\n")):
            util = 99 if case == "shared" else 97
            config = _config(
                tmp_path,
                f"device\ntotal {80 * GiB}\nused {10 * GiB}\nutil {util}\ncompute {job.pid} {8 * GiB}\n{own}"
                f"device\ntotal {80 * GiB}\nused {70 * GiB}\nutil 99\ncompute 7 {60 * GiB}\n",
            )
            out = tmp_path / f"record-{case}.jsonl"
            result = subprocess.run(
                [*DLMON_RECORD, str(job.pid), "-o", str(out), "--interval", "0.5", "--duration", "16"],
                capture_output=True,
                text=True,
                timeout=90,
                env=environment(fake_nvml, config),
            )
            assert result.returncode == 0, result.stderr
            lines = [json.loads(line) for line in out.read_text().splitlines()]
            last = [line for line in lines if line["type"] == "snapshot"][-1]
            found[case] = [a for a in last["alerts"] if a["kind"] == "input_bound"]
    finally:
        job.kill()
        job.wait()
    (idle,) = found["shared"]
    assert "its kernels kept GPU 0 busy only 0% of that time" in idle["message"], idle["message"]
    assert idle["severity"] == "critical"
    (busy,) = found["busy"]
    hidden = "yet its kernels kept GPU 0 busy 97% of that time: the wait is hidden"
    assert hidden in busy["message"], busy["message"]
    assert busy["severity"] == "warning"


BEYOND = f"""
device
total {80 * GiB}
used {20 * GiB}
util 88
compute 4242 {18 * GiB}
compute 4243 {1 * GiB}
sm 4242 45
power_mw 300000
clock_events 0x41
"""

TWO_SWEEPS = """
    import ctypes, json, sys, time
    from dlmon.collect.gpu import GpuCollector
    from dlmon.model.serialize import to_dict
    collector = GpuCollector(host_pids=True)
    first = collector.sample()[1]
    time.sleep(0.5)
    second = collector.sample()[1]
    lib = ctypes.CDLL(sys.argv[1] + "/libnvidia-ml.so.1")
    lib.fakeNvmlLastSeenTimestamp.restype = ctypes.c_ulonglong
    print(json.dumps({
        "first": [to_dict(d) for d in first], "second": [to_dict(d) for d in second],
        "last_seen": lib.fakeNvmlLastSeenTimestamp(), "now_us": int(time.time() * 1e6),
    }))
    collector.close()
"""


def test_per_process_sm_utilisation_power_and_clock_events(fake_nvml: Path, tmp_path: Path) -> None:
    """Issue 24, beyond: each process's SM utilisation from its samples since the newest one seen
    (the second sweep asks from the first's timestamp, never from 0), power from the energy
    counter's delta (none at the first sweep), and the clock event reasons that slow the GPU
    (idle is no slowdown)."""
    result = run_python(TWO_SWEEPS, fake_nvml, _config(tmp_path, BEYOND), args=(str(fake_nvml),))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    (first,), (second,) = data["first"], data["second"]
    sm = {p["pid"]: p["sm_percent"] for p in second["processes"]}
    assert sm == {4242: 45.0, 4243: 0.0}  # NVML samples only processes that ran a kernel
    assert {p["pid"]: p["sm_percent"] for p in first["processes"]}[4242] == 45.0
    assert first["power_w"] is None
    assert 270 <= second["power_w"] <= 330, second["power_w"]
    assert second["clock_events"] == ["hw thermal"]
    # asked for samples newer than the first sweep's, a moment ago: not 0, not the whole buffer
    assert 0 < data["now_us"] - data["last_seen"] < 5_000_000


def test_a_driver_without_the_beyond_calls_reads_as_before(fake_nvml: Path, tmp_path: Path) -> None:
    """NOT_SUPPORTED or missing: no sm figure, no power, no clock events, and no reason on the
    device (these are extras, not figures the device lacks)."""
    config = _config(
        tmp_path,
        f"device\ntotal {80 * GiB}\nused {20 * GiB}\ncompute 4242 {GiB}\n"
        "fail nvmlDeviceGetProcessUtilization 3\nfail nvmlDeviceGetCurrentClocksEventReasons 3\n",
    )
    result = run_python(TWO_SWEEPS, fake_nvml, config, args=(str(fake_nvml),))
    assert result.returncode == 0, result.stderr
    (second,) = json.loads(result.stdout)["second"]
    assert [p["sm_percent"] for p in second["processes"]] == [None]
    assert (second["power_w"], second["clock_events"], second["unavailable_reason"]) == (None, [], None)


def test_the_gpu_panel_shows_power_slowdowns_and_each_processs_sm_share(
    fake_nvml: Path, tmp_path: Path
) -> None:
    from dlmon.ui.state import DashboardState
    from dlmon.ui.text import text_of
    from dlmon.ui.views.gpu import gpu_lines
    from support.ui import MAIN_PID

    config = _config(tmp_path, BEYOND.replace("4242", str(MAIN_PID)))
    result = run_python(TWO_SWEEPS, fake_nvml, config, args=(str(fake_nvml),))
    assert result.returncode == 0, result.stderr
    devices = _gpu_devices(json.loads(result.stdout)["second"])
    state = DashboardState()
    state.ingest(_mig_snapshot(devices))
    full = [text_of(line) for line in gpu_lines(state, 200, compact=False, detailed=True)]
    assert " W" in full[0] and "clocks held down: hw thermal" in full[0], full[0]
    assert any(f"pid {MAIN_PID} main 18.0G sm 45%" in line for line in full), full


def test_a_listed_process_without_samples_ran_no_kernel(fake_nvml: Path, tmp_path: Path) -> None:
    """NVML returns a utilisation sample only for a process that ran a kernel in that period, and
    NOT_FOUND when none did: a listed process without one is at 0%, not unknown. Read as unknown,
    a starved trainer on a GPU kept busy by a colleague took the device's 99% as its own (found in
    review: input_bound was tempered to "the wait is hidden" on an idle trainer)."""
    config = _config(
        tmp_path,
        f"device\ntotal {80 * GiB}\nused {20 * GiB}\nutil 99\ncompute 4242 {GiB}\ncompute 7 {9 * GiB}\n"
        "sm 7 99\n"
        f"device\ntotal {80 * GiB}\nused {20 * GiB}\nutil 0\ncompute 4243 {GiB}\n",
    )
    result = run_python(TWO_SWEEPS, fake_nvml, config, args=(str(fake_nvml),))
    assert result.returncode == 0, result.stderr
    shared, alone = json.loads(result.stdout)["second"]
    assert {p["pid"]: p["sm_percent"] for p in shared["processes"]} == {7: 99.0, 4242: 0.0}
    assert [p["sm_percent"] for p in alone["processes"]] == [0.0]  # NOT_FOUND: no process ran one


SLOW_UTIL = """
    import json, sys
    from dlmon.collect.gpu import GpuCollector
    from dlmon.model.serialize import to_dict
    collector = GpuCollector(host_pids=True, slow_device_s=0.2)
    print(json.dumps([to_dict(d) for d in collector.sample()[1]]))
    collector.close()
"""


def test_a_slow_utilisation_call_keeps_the_process_list_read_before_it(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """The extras come after the process list: a per-process utilisation call slower than the
    device's limit cuts the read short, but the list already read stays (found in review: the
    partial reading dropped it, and the job's VRAM with it, for the whole back-off)."""
    config = _config(
        tmp_path,
        f"device\ntotal {80 * GiB}\nused {20 * GiB}\ncompute 4242 {3 * GiB}\nsm 4242 50\n"
        "delay_ms 400\ndelay_fn nvmlDeviceGetProcessUtilization\npower_mw 1000\n",
    )
    result = run_python(SLOW_UTIL, fake_nvml, config)
    assert result.returncode == 0, result.stderr
    (device,) = json.loads(result.stdout)
    assert device["unavailable_reason"] and "slow" in device["unavailable_reason"], device
    assert [(p["pid"], p["used_memory_bytes"]) for p in device["processes"]] == [(4242, 3 * GiB)]
    assert device["power_w"] is None  # not asked after the slow call


def test_pcie_throughput_from_the_byte_counters_and_their_timestamps(fake_nvml: Path, tmp_path: Path) -> None:
    """Issue 24, beyond: PCIe bytes per second from NVML's field-value counters (not
    nvmlDeviceGetPcieThroughput, which samples 20 ms per call): none at the first sweep, the
    counters' rates at the second; a driver without them gives None and no reason."""
    config = BEYOND + "pcie_rx_bps 4000000000\npcie_tx_bps 2000000\n"
    result = run_python(TWO_SWEEPS, fake_nvml, _config(tmp_path, config), args=(str(fake_nvml),))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    (first,), (second,) = data["first"], data["second"]
    assert (first["pcie_rx_bytes_per_s"], first["pcie_tx_bytes_per_s"]) == (None, None)
    assert 3.6e9 <= second["pcie_rx_bytes_per_s"] <= 4.4e9, second["pcie_rx_bytes_per_s"]
    assert 1.8e6 <= second["pcie_tx_bytes_per_s"] <= 2.2e6, second["pcie_tx_bytes_per_s"]
    result = run_python(TWO_SWEEPS, fake_nvml, _config(tmp_path, BEYOND), args=(str(fake_nvml),))
    (second,) = json.loads(result.stdout)["second"]
    assert (second["pcie_rx_bytes_per_s"], second["unavailable_reason"]) == (None, None)


def test_the_gpu_panel_shows_pcie_traffic_and_sm_activity(fake_nvml: Path, tmp_path: Path) -> None:
    from dlmon.ui.state import DashboardState
    from dlmon.ui.text import text_of
    from dlmon.ui.views.gpu import gpu_lines
    from support.ui import MAIN_PID

    config = BEYOND.replace("4242", str(MAIN_PID)) + "pcie_rx_bps 4000000000\npcie_tx_bps 2000000\n"
    config += "gpm_sm 12.5\ngpm_occupancy 4\n"
    result = run_python(TWO_SWEEPS, fake_nvml, _config(tmp_path, config), args=(str(fake_nvml),))
    assert result.returncode == 0, result.stderr
    devices = _gpu_devices(json.loads(result.stdout)["second"])
    state = DashboardState()
    state.ingest(_mig_snapshot(devices))
    head = text_of(gpu_lines(state, 220, compact=False, detailed=True)[0])
    assert "pcie in 3." in head and "G/s out 1." in head and "M/s" in head, head
    assert "SMs busy 12% occ 4%" in head, head


GPM_SWEEPS = """
    import ctypes, json, sys, time
    from dlmon.collect.gpu import GpuCollector
    from dlmon.model.serialize import to_dict
    lib = ctypes.CDLL(sys.argv[1] + "/libnvidia-ml.so.1")
    collector = GpuCollector(host_pids=True)
    readings = []
    for _ in range(4):
        readings.append([to_dict(d) for d in collector.sample()[1]])
        time.sleep(0.1)
    live = lib.fakeNvmlGpmSamplesLive()
    collector.close()
    print(json.dumps({"readings": readings, "live": live, "after_close": lib.fakeNvmlGpmSamplesLive()}))
"""


def test_gpm_sm_activity_between_sweeps_with_one_sample_kept(fake_nvml: Path, tmp_path: Path) -> None:
    """Issue 24, beyond (Hopper): GPM's SM utilisation and occupancy between the previous
    sweep's sample and this one's; none at the first sweep; one sample held per device while
    running and none after close (NVML's samples are the caller's to free). A device without GPM
    answers None."""
    config = BEYOND + "gpm_sm 12.5\ngpm_occupancy 4\ndevice\ntotal 1000\nused 10\n"
    result = run_python(GPM_SWEEPS, fake_nvml, _config(tmp_path, config), args=(str(fake_nvml),))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    gpm = [[(d["sm_active_percent"], d["sm_occupancy_percent"]) for d in r] for r in data["readings"]]
    assert gpm == [[(None, None), (None, None)]] + [[(12.5, 4.0), (None, None)]] * 3
    assert (data["live"], data["after_close"]) == (1, 0)


GPM_LOST = """
    import ctypes, json, sys
    from dlmon.collect.gpu import GpuCollector
    lib = ctypes.CDLL(sys.argv[1] + "/libnvidia-ml.so.1")
    collector = GpuCollector(host_pids=True)
    for _ in range(3):
        collector.sample()
    lost_at_sample_get = lib.fakeNvmlGpmSamplesLive()
    collector._forget(1)  # what a lost GPU or a shrunk device count does to its index
    forgotten = lib.fakeNvmlGpmSamplesLive()
    collector.close()
    closed = lib.fakeNvmlGpmSamplesLive()
    print(json.dumps({"lost": lost_at_sample_get, "forgotten": forgotten, "closed": closed}))
"""


def test_gpm_samples_are_freed_when_the_gpu_is_lost_or_forgotten(fake_nvml: Path, tmp_path: Path) -> None:
    """Review of issue 24: a GPU lost at nvmlGpmSampleGet leaked the sample just allocated, one
    per sweep; a forgotten device (lost later, or gone from the count) kept its held sample
    (allocated by NVML, the caller's to free) and would have compared it with another GPU's."""
    config = BEYOND + "gpm_sm 12.5\nfail nvmlGpmSampleGet 15\ndevice\ntotal 1000\nused 10\ngpm_sm 30\n"
    result = run_python(GPM_LOST, fake_nvml, _config(tmp_path, config), args=(str(fake_nvml),))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["lost"], data["forgotten"], data["closed"]) == (1, 0, 0), data


PCIE_SWEEPS = """
    import ctypes, json, sys, time
    from dlmon.collect.gpu import GpuCollector
    from dlmon.model.serialize import to_dict
    lib = ctypes.CDLL(sys.argv[1] + "/libnvidia-ml.so.1")
    collector = GpuCollector(host_pids=True)
    readings = []
    for _ in range(3):
        readings.append([to_dict(d)["pcie_rx_bytes_per_s"] for d in collector.sample()[1]])
        time.sleep(0.6)
    print(json.dumps({"readings": readings, "calls": lib.fakeNvmlFieldValueCalls()}))
    collector.close()
"""


def test_a_32_bit_pcie_counter_gives_no_rate_not_a_wrapped_one(fake_nvml: Path, tmp_path: Path) -> None:
    """Review of issue 24: NVML's PCIe byte counters "can be wrapped" (nvml.h) and each field
    says its own width in valueType. The union's 64-bit member was read whatever the type: a
    32-bit counter (4 GiB, under 0.1 s at PCIe Gen5 speed) that wrapped between sweeps gave a
    rate short by 4 GiB per wrap, printed as a measurement. Such a counter now gives none."""
    config = BEYOND + "pcie_rx_bps 10000000000\npcie_value_type 1\ndevice\ntotal 1000\nused 10\n"
    config += "pcie_rx_bps 10000000000\n"
    result = run_python(PCIE_SWEEPS, fake_nvml, _config(tmp_path, config), args=(str(fake_nvml),))
    assert result.returncode == 0, result.stderr
    readings = json.loads(result.stdout)["readings"]
    assert [r[0] for r in readings] == [None, None, None], readings
    assert readings[0][1] is None and all(9e9 <= r[1] <= 11e9 for r in readings[1:]), readings


def test_pcie_counters_a_device_lacks_are_asked_once(fake_nvml: Path, tmp_path: Path) -> None:
    """Review of issue 24: docs/gpu.md says a driver without the PCIe counters is asked once;
    each field answered NOT_SUPPORTED in its own nvmlReturn (the call itself succeeds), so
    nvmlDeviceGetFieldValues was called again every sweep on every such device."""
    result = run_python(PCIE_SWEEPS, fake_nvml, _config(tmp_path, BEYOND), args=(str(fake_nvml),))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["readings"] == [[None]] * 3 and data["calls"] == 1, data


def test_the_gpu_panel_says_a_missing_pcie_direction_without_a_rate_unit() -> None:
    """Review of issue 24: with one counter known and the other not (a driver giving only one, a
    32-bit one), the panel printed "out n/a/s"."""
    from dlmon.ui.state import DashboardState
    from dlmon.ui.text import text_of
    from dlmon.ui.views.gpu import gpu_lines

    card = GpuDevice(0, "NVIDIA H200", "GPU-1", GiB, 80 * GiB, 50, pcie_rx_bytes_per_s=4e9)
    state = DashboardState()
    state.ingest(_mig_snapshot((card,)))
    head = text_of(gpu_lines(state, 220, compact=False, detailed=True)[0])
    assert "pcie in 3.73G/s out n/a" in head and "n/a/s" not in head, head


def test_a_record_with_gpm_shares_over_100_percent_is_no_measurement() -> None:
    """Review of issue 24: GPM's SM busy and occupancy are shares (0-100, the collector keeps
    only those), but a record's names ending in _percent were allowed up to 10^6 (a process on
    many cores): "SMs busy 5000%" from a damaged record was drawn and exported as a ratio of 50."""
    import dataclasses

    import pytest

    from dlmon.model.serialize import SnapshotFormatError, snapshot_from_dict, snapshot_to_dict
    from support.ui import T0, make_snapshot

    card = GpuDevice(0, "NVIDIA H200", "GPU-1", GiB, 80 * GiB, 50, sm_active_percent=99.5)
    good = snapshot_to_dict(dataclasses.replace(make_snapshot(T0, gpus=1), gpus=(card,)))
    assert snapshot_from_dict(good).gpus[0].sm_active_percent == 99.5
    for name in ("sm_active_percent", "sm_occupancy_percent"):
        bad = json.loads(json.dumps(good))
        bad["gpus"][0][name] = 5000.0
        with pytest.raises(SnapshotFormatError, match="out of range"):
            snapshot_from_dict(bad)


GPM_SUPPORT_ASKED = """
    import ctypes, json, sys
    from dlmon.collect.gpu import GpuCollector
    lib = ctypes.CDLL(sys.argv[1] + "/libnvidia-ml.so.1")
    collector = GpuCollector(host_pids=True)
    for _ in range(3):
        collector.sample()
    print(json.dumps({"asked": lib.fakeNvmlGpmSupportCalls()}))
    collector.close()
"""


def test_gpm_support_is_asked_again_after_an_error_that_is_not_an_answer(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """Review of issue 24: any error of nvmlGpmQueryDeviceSupport (a timeout, an unknown error)
    was kept as "GPM not supported" for the whole run; only NOT_SUPPORTED (and a missing
    function) say so, as for the other extras."""
    asked = []
    for code in (999, 3):  # NVML_ERROR_UNKNOWN: ask again; NVML_ERROR_NOT_SUPPORTED: once
        config = BEYOND + f"gpm_sm 12.5\nfail nvmlGpmQueryDeviceSupport {code}\n"
        result = run_python(GPM_SUPPORT_ASKED, fake_nvml, _config(tmp_path, config), args=(str(fake_nvml),))
        assert result.returncode == 0, result.stderr
        asked.append(json.loads(result.stdout)["asked"])
    assert asked == [3, 1], asked
