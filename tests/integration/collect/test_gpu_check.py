"""scripts/gpu-check, the one-shot hardware check, run here against the stand-in libnvidia-ml.

No GPU machine has been lent to this project: these tests check the runner (every step writes its
results as it goes, a hung NVML costs one step and not the run, no GPU is one line and exit 2) and
the steps that need NVML but not CUDA. The CUDA steps say SKIP here; docs/gpu.md says what only
hardware can confirm.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.nvml import ROOT, build, environment

SCRIPT = ROOT / "scripts" / "gpu-check"
DEVICE = (
    "device\nname NVIDIA H200\nuuid GPU-1\ntotal 150000000000\nused 3000000000\nutil 40\n"
    "compute 4101 1073741824\n"
)


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = build(tmp_path_factory.mktemp("fake_nvml"))
    if built is None:
        pytest.skip("no C compiler to build the stand-in libnvidia-ml.so.1")
    return built


def _check(
    fake_nvml: Path, tmp_path: Path, config: str, *args: str, python_path: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    conf = tmp_path / "nvml.conf"
    conf.write_text(config)
    out = tmp_path / "out"
    env = environment(fake_nvml, conf)
    if python_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(python_path), env["PYTHONPATH"]])
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    lines = []
    if (out / "results.jsonl").exists():
        lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return done, lines


def test_every_step_writes_its_results_and_the_cuda_steps_say_why_they_skip(
    fake_nvml: Path, tmp_path: Path
) -> None:
    steps = "versions,devices,memory_versions,nvml_latency,children_vram,pinned"
    done, lines = _check(fake_nvml, tmp_path, DEVICE, "--only", steps, "--budget", "200")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert [line["step"] for line in lines][:1] == ["versions"]
    assert {line["step"] for line in lines} == set(steps.split(","))
    by_step = {line["step"]: line for line in lines}
    versions = by_step["versions"]
    assert versions["result"] == "PASS"
    assert versions["data"]["struct_sizes"]["c_nvmlProcessInfo_v3_t"] == 24
    latency = by_step["nvml_latency"]["data"]
    # every NVML call dlmon's collector makes is timed, on each device
    from dlmon.collect.gpu import _PROCESS_LISTS

    timed = set(latency["per_call"]["gpu0"])
    wanted = {name for variants in _PROCESS_LISTS for name in variants[:2]}
    assert wanted <= timed
    assert {"nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetUtilizationRates"} <= timed
    assert latency["sweep"]["median_ms"] > 0
    for step in ("children_vram", "pinned"):
        assert by_step[step]["result"] == "SKIP"
        assert "torch.cuda.is_available() is False" in by_step[step]["detail"]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "PASS: 0 failed" in summary


def test_a_hung_nvml_costs_one_step_and_the_run_goes_on(fake_nvml: Path, tmp_path: Path) -> None:
    """Every device call sleeps 10 minutes: the devices step is cut off at --max-step with what it
    found, and the steps after it still run and write their lines."""
    config = DEVICE + "delay_ms 600000\n"
    args = ("--only", "devices,children_vram", "--max-step", "6", "--budget", "120")
    done, lines = _check(fake_nvml, tmp_path, config, *args)
    assert done.returncode == 1, done.stdout + done.stderr
    cut = [line for line in lines if line["step"] == "devices"]
    assert [(line["check"], line["result"]) for line in cut] == [("finished in time", "FAIL")]
    assert "cut off after 6 s" in cut[0]["detail"]
    assert any(line["step"] == "children_vram" for line in lines)  # run after it, whatever it found


# Started in the devices step (through sitecustomize, before the step's NVML hangs): a process
# of a session of its own, as dlmon run's and dlmon tune's trainings and the CUDA children are.
ESCAPER = """
import subprocess, sys
if "--step" in sys.argv and "devices" in sys.argv:
    subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "{marker}"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
"""


def _marked(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker.encode() in argv:
                found.append(int(entry))
    return found


def test_a_step_cut_off_leaves_nothing_running_that_left_its_process_group(
    fake_nvml: Path, tmp_path: Path
) -> None:
    """A step's training under dlmon run, or a CUDA child, runs in a session of its own: killing the
    step's process group missed it, and a cut-off step left it running, holding its GPU memory
    (found in review: dlmon tune's `while True` training would outlive the whole run). The
    runner finds them by a token in their environment and kills them when the step ends."""
    marker = f"gpu-check-escaper-{os.getpid()}"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(ESCAPER.format(marker=marker))
    config = DEVICE + "delay_ms 600000\n"
    args = ("--only", "devices", "--max-step", "6", "--budget", "60")
    try:
        done, lines = _check(fake_nvml, tmp_path, config, *args, python_path=hook)
        assert done.returncode == 1, done.stdout + done.stderr
        assert _marked(marker) == [], "a process the step started is still running"
        left = [line for line in lines if line["check"] == "left nothing running"]
        assert left and left[0]["result"] == "WARN", lines
    finally:
        for pid in _marked(marker):
            os.kill(pid, signal.SIGKILL)


def test_no_gpu_is_one_line_and_exit_2(fake_nvml: Path, tmp_path: Path) -> None:
    done, lines = _check(fake_nvml, tmp_path, "init_error 9\n")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert [(line["check"], line["result"]) for line in lines] == [("NVML", "SKIP")]
    assert "nothing to check" in lines[0]["detail"]
