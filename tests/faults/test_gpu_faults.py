"""NVML that starts raising mid-run and a GPU that disappears, at the one seam (a fake pynvml): the
dashboard shows "n/a" with the reason, the snapshot says why, and nothing crashes."""

from __future__ import annotations

from typing import Any

from textual.pilot import Pilot

from conftest import Spawn
from dlmon.collect.gpu import GpuCollector
from dlmon.collect.sampler import Sampler
from dlmon.flow.sources import LiveSource
from dlmon.model import Snapshot
from dlmon.ui import DashboardResult
from dlmon.ui.app import DlmonApp
from support.fake_pynvml import Dev, FakeNVML, NVMLError_GpuIsLost, NVMLError_Unknown

from .screen import run_dashboard, screen_text, wait_for_text
from .support import tree_of_sleepers

GiB = 1 << 30
ALL_DEVICE_CALLS = (
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetName", "nvmlDeviceGetUUID",
    "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3",
)  # fmt: skip


def test_nvml_failing_mid_run_and_a_gpu_disappearing_reach_the_screen_as_na(spawn: Spawn) -> None:
    tree = spawn(tree_of_sleepers(2))
    devs = [Dev(uuid="GPU-aaaa", compute=[(tree.pid, 2 * GiB)]), Dev(uuid="GPU-bbbb", util=5)]
    fake = FakeNVML(devs)
    snapshots: list[Snapshot] = []
    sampler = Sampler(tree.pid, gpu=GpuCollector(fake))
    source = LiveSource(tree.pid, interval=0.2, sampler=sampler)
    original_start = source.start

    def start(on_snapshot: Any, on_end: Any) -> None:
        def both(s: Snapshot) -> None:
            snapshots.append(s)
            on_snapshot(s)

        original_start(both, on_end)

    source.start = start  # type: ignore[method-assign]
    screens: dict[str, str] = {}

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        screens["healthy"] = await wait_for_text(app, pilot, "2 GPUs")
        for call in ALL_DEVICE_CALLS:  # device 0's NVML calls start raising
            devs[0].fail[call] = NVMLError_Unknown
        n = len(snapshots)
        await wait_for_text(app, pilot, "n/a")
        while len(snapshots) < n + 3:
            await pilot.pause(0.2)
        screens["raising"] = screen_text(app)
        devs[0].fail.clear()
        devs[1].fail["nvmlDeviceGetMemoryInfo"] = NVMLError_GpuIsLost
        n = len(snapshots)
        while len(snapshots) < n + 3:
            await pilot.pause(0.2)
        screens["lost"] = screen_text(app)
        del devs[1]  # gone from the bus: NVML counts one GPU
        screens["gone"] = await wait_for_text(app, pilot, "1 GPU ")
        fake.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(NVMLError_Unknown())  # type: ignore[attr-defined]
        screens["count"] = await wait_for_text(app, pilot, "could not count")
        await pilot.press("q")

    _, result = run_dashboard(source, scenario)
    assert result is not None
    for name, text in screens.items():
        print(f"--- {name}\n{text}")
    assert "Traceback" not in "".join(screens.values())
    assert source.faults.failed_samples == 0
    assert "2 GPUs" in screens["healthy"] and "n/a" not in _gpu_lines(screens["healthy"])
    assert "n/a: NVML: unknown error" in _gpu_lines(screens["raising"])
    assert "n/a%" not in screens["raising"]
    assert "n/a: NVML: GPU is lost" in _gpu_lines(screens["lost"])
    assert "GPU1" not in _gpu_lines(screens["gone"]) and "GPU0 mem 10.0G" in screens["gone"]
    assert "NVML could not count the GPUs (unknown error)" in screens["count"]
    # the snapshots, as a record file would hold them, say the same
    raising = [g for s in snapshots for g in s.gpus if g.unavailable_reason == "NVML: unknown error"]
    lost = [g for s in snapshots for g in s.gpus if g.unavailable_reason == "NVML: GPU is lost"]
    assert raising and lost and all(g.memory_used_bytes is None for g in raising + lost)


def _gpu_lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith(("GPU", "    ")))
