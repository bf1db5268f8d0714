"""``dlmon tune`` as a user runs it: real torch training scripts (tests/tune_scripts/), real
DataLoader workers, a real v1 memory cgroup, real signals. Sweeps are tiny (2 shared cores)."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlmon.tune.plan import TIMES as X
from support.paths import TESTS

SCRIPTS = TESTS / "tune_scripts"
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def tune_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dlmon", "tune", "--no-plot", *args]


def script(name: str, *args: str) -> list[str]:
    return ["--", sys.executable, str(SCRIPTS / name), *args]


def run_tune(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def results_of(path: Path) -> dict[tuple[int, int], dict[str, object]]:
    data = json.loads(path.read_text())
    return {(r["config"]["workers"], r["config"]["batch_size"]): r for r in data["results"]}


def sweep_ratio(tmp_path: Path, name: str, *args: str) -> float:
    """samples/s with 2 workers over samples/s with none, through dlmon tune; checks the output."""
    out_json = tmp_path / f"{name}.json"
    out_csv = tmp_path / f"{name}.csv"
    done = run_tune(
        *tune_cmd(
            "--workers",
            "0,2",
            "--batch-sizes",
            "16",
            "--seconds-per-config",
            "3",
            "--json",
            str(out_json),
            "--csv",
            str(out_csv),
        ),
        *script(name, *args),
    )
    assert done.returncode == 0, done.stderr
    res = results_of(out_json)
    assert {r["outcome"] for r in res.values()} == {"ok"}, done.stdout
    assert "workers  batch  pin  samples/s" in done.stdout
    assert "recommended: " in done.stdout and "paste: DataLoader(dataset, batch_size=16" in done.stdout
    assert "learning rate" in done.stdout
    assert out_csv.read_text().splitlines()[0].startswith("workers,batch_size,pin_memory")
    assert json.loads(out_json.read_text())["complete"] is True
    return float(res[(2, 16)]["samples_per_s"]) / float(res[(0, 16)]["samples_per_s"])


@pytest.mark.slow
def test_more_workers_help_a_cpu_heavy_dataset_and_not_a_trivial_one(tmp_path: Path) -> None:
    # Each sample: 1 ms of Python CPU and 3 ms of waiting (a slow read), so 2 workers help even when
    # other jobs hold the 2 cores (pure CPU samples gain nothing on a machine with no idle core: the
    # pure-CPU knee is benchmarks/tune_knee.py's). A quiet machine gives ~1.9x here and ~1x for the
    # trivial dataset; load can swing one 3 s window by 30%, so the pair is measured again (at most
    # 3 times) until the comparison is clear.
    tried = []
    heavy_args = ("--cpu-ms", "1", "--wait-ms", "3")
    for _ in range(3):
        ratios = {
            "cpu_heavy.py": sweep_ratio(tmp_path, "cpu_heavy.py", *heavy_args),
            "trivial.py": sweep_ratio(tmp_path, "trivial.py"),
        }
        tried.append(ratios)
        heavy, trivial = ratios["cpu_heavy.py"], ratios["trivial.py"]
        if heavy > 1.2 and heavy > trivial + 0.15 and trivial < 1.2:
            return
    raise AssertionError(f"2 workers / 0 workers, per attempt: {tried}")


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    if os.geteuid() != 0 or not (CGROUP_V1 / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    path = CGROUP_V1 / f"dlmon-tune-test-{os.getpid()}"
    path.mkdir()
    (path / "memory.limit_in_bytes").write_text(str(640 * 2**20))
    yield path
    for _ in range(100):
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)


@pytest.mark.slow
def test_a_configuration_beyond_the_cgroup_cap_is_stopped_and_the_sweep_goes_on(
    tmp_path: Path, memory_cgroup: Path
) -> None:
    out_json = tmp_path / "sweep.json"
    args = tune_cmd(
        "--workers", "0,1", "--batch-sizes", "8,256", "--seconds-per-config", "3", "--json", str(out_json)
    ) + script("memhog.py")
    shell = f'echo $$ > {memory_cgroup}/cgroup.procs && exec "$@"'
    done = run_tune("sh", "-c", shell, "sh", *args)
    assert done.returncode == 0, done.stderr
    res = results_of(out_json)
    assert res[(0, 8)]["outcome"] == "ok" and res[(1, 8)]["outcome"] == "ok", res
    assert res[(0, 256)]["outcome"] == "would_oom", res[(0, 256)]
    assert res[(0, 256)]["peak_pss_bytes"] < 0.9 * 640 * 2**20, res[(0, 256)]  # stopped before the line
    assert res[(1, 256)]["outcome"] == "skipped"
    assert f"needs at least the memory of 0 workers {X} batch 256" in res[(1, 256)]["detail"]
    assert res[(0, 256)]["limit_source"] == "cgroup"
    assert "would OOM at ~" in done.stdout
    assert "oom_kill 0" in (memory_cgroup / "memory.oom_control").read_text()  # stopped before the killer


@pytest.mark.slow
def test_a_small_dev_shm_is_reported_as_shm_exhausted_and_larger_configs_skipped(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /dev/shm")
    out_json = tmp_path / "sweep.json"
    args = tune_cmd(
        "--workers", "0,2", "--batch-sizes", "4,16", "--seconds-per-config", "1", "--json", str(out_json)
    ) + script("big_samples.py")
    shell = 'mount -t tmpfs -o size=6m tmpfs /dev/shm && exec "$@"'
    done = run_tune("unshare", "-m", "sh", "-c", shell, "sh", *args)
    assert done.returncode == 0, done.stderr
    res = results_of(out_json)
    assert res[(0, 4)]["outcome"] == "ok" and res[(0, 16)]["outcome"] == "ok"
    assert res[(2, 4)]["outcome"] == "shm_exhausted", res[(2, 4)]
    assert "SIGBUS (/dev/shm full, 6 MiB)" in res[(2, 4)]["detail"]
    assert res[(2, 16)]["outcome"] == "skipped"
    assert "shm exhausted" in done.stdout


@pytest.mark.slow
def test_cuda_oom_through_the_agents_seam_ends_that_config_only(tmp_path: Path) -> None:
    """No --batch-sizes: the first run uses the script's own (16, which hits the fake CUDA OOM), then
    its neighbours x1/2 and x2 follow."""
    out_json = tmp_path / "sweep.json"
    done = run_tune(
        *tune_cmd("--workers", "0", "--seconds-per-config", "1", "--json", str(out_json)),
        *script("cpu_heavy.py", "--batch-size", "16"),
        env={"DLMON_TUNE_FAKE_CUDA_OOM": "16"},
    )
    assert done.returncode == 0, done.stderr
    res = results_of(out_json)
    assert sorted(res) == [(0, 8), (0, 16), (0, 32)]
    assert next(iter(res)) == (0, 16)  # the script's own batch size ran first
    assert res[(0, 8)]["outcome"] == "ok"
    assert res[(0, 16)]["outcome"] == "cuda_oom"
    assert "CUDA out of memory" in res[(0, 16)]["detail"]
    assert res[(0, 32)]["outcome"] == "skipped" and "batch 16" in res[(0, 32)]["detail"]
    assert "CUDA OOM: CUDA out of memory" in done.stdout


def read_until(fd: int, needle: str, timeout: float) -> str:
    """Read ``fd`` (unbuffered: a buffered reader would hide lines from select) until ``needle``."""
    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            seen += chunk
            if needle.encode() in seen:
                return seen.decode()
    raise AssertionError(f"{needle!r} not seen in: {seen.decode(errors='replace')}")


@pytest.mark.slow
def test_ctrl_c_keeps_what_was_measured_and_resume_finishes(tmp_path: Path) -> None:
    out_json = tmp_path / "sweep.json"
    cmd = tune_cmd(
        "--workers", "0,1", "--batch-sizes", "8", "--seconds-per-config", "2", "--json", str(out_json)
    ) + script("trivial.py")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    read_until(proc.stderr.fileno(), f"[2/2] 1 worker {X} batch 8 (ETA", 180)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 1 and rows[0].split()[:2] == ["0", "8"], out
    assert "--resume" in err
    saved = json.loads(out_json.read_text())
    assert saved["complete"] is False and len(saved["results"]) == 1

    done = run_tune(*tune_cmd("--resume", str(out_json), "--yes"))  # --yes: no terminal to ask on
    assert done.returncode == 0, done.stderr
    assert "resuming with 1 done" in done.stderr
    res = results_of(out_json)
    assert set(res) == {(0, 8), (1, 8)} and {r["outcome"] for r in res.values()} == {"ok"}
    assert json.loads(out_json.read_text())["complete"] is True


@pytest.mark.slow
def test_a_batch_sampler_loader_is_swept_over_workers_only(tmp_path: Path) -> None:
    out_json = tmp_path / "sweep.json"
    done = run_tune(
        *tune_cmd("--workers", "0,1", "--seconds-per-config", "1", "--json", str(out_json)),
        *script("sampler_batches.py"),
    )
    assert done.returncode == 0, done.stderr
    res = results_of(out_json)
    assert sorted(res) == [(0, 32), (1, 32)]  # its own batch size, from the batch_sampler
    assert all("batch_size is not tunable" in r["detail"] for r in res.values())
    assert {r["outcome"] for r in res.values()} == {"ok"}
    assert "batch_size is not tunable: the loader is built with a batch_sampler" in done.stdout


@pytest.mark.slow
def test_loader_only_shows_the_input_pipelines_ceiling_above_the_training(tmp_path: Path) -> None:
    speeds = {}
    for mode in ((), ("--loader-only",)):
        out_json = tmp_path / f"sweep{len(mode)}.json"
        done = run_tune(
            *tune_cmd(
                *mode,
                "--workers",
                "0",
                "--batch-sizes",
                "16",
                "--seconds-per-config",
                "2",
                "--json",
                str(out_json),
            ),
            *script("trivial.py"),
        )
        assert done.returncode == 0, done.stderr
        speeds[mode] = results_of(out_json)[(0, 16)]["samples_per_s"]
    assert "input pipeline's ceiling" in done.stdout
    # the trivial loader is far faster than the ~5 ms training step lets the training go
    assert speeds[("--loader-only",)] > 5 * speeds[()], speeds


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--warmup-timeout", "8", *script("no_loader.py")), "no DataLoader was created within 8 s"),
        (
            ("--", sys.executable, "-c", "print('bye'); raise SystemExit(3)"),
            "exited with status 3 before building a DataLoader: bye",
        ),
        (("--batch-sizes", "0,16", *script("trivial.py")), "--batch-sizes: 0 is not allowed"),
        (("--json", "/nonexistent/dir/sweep.json", *script("trivial.py")), "cannot write /nonexistent/dir"),
        (("--", "/nonexistent/train"), "cannot start /nonexistent/train"),
        ((), "no command to tune"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    out_json = tmp_path / "sweep.json"
    if "--json" in args:
        out_json = Path(args[args.index("--json") + 1])
        json_args: tuple[str, ...] = ()
    else:
        json_args = ("--json", str(out_json))
    done = run_tune(
        *tune_cmd("--workers", "0", "--batch-sizes", "8", "--seconds-per-config", "1", *json_args), *args
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("dlmon: error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not out_json.exists()
    assert done.stdout == ""


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _tune_one_long_config(name: str) -> tuple[subprocess.Popen[str], list[int]]:
    """dlmon tune on one 60-s configuration of tune_scripts/NAME: its process and the training's pids."""
    cmd = tune_cmd("--workers", "0", "--batch-sizes", "8", "--seconds-per-config", "60") + script(name)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    read_until(proc.stderr.fileno(), f"[1/1] 0 workers {X} batch 8", 180)
    deadline = time.monotonic() + 60
    while not _children(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    trainings = _children(proc.pid)
    assert trainings
    return proc, trainings


def _left_alive(trainings: list[int], within_s: float) -> list[int]:
    """The trainings still alive after ``within_s`` (killed then, so no test leaves one behind)."""
    deadline = time.monotonic() + within_s
    while any(_alive(t) for t in trainings) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [t for t in trainings if _alive(t)]
    for t in left:
        os.kill(t, signal.SIGKILL)
    return left


@pytest.mark.slow
def test_a_hangup_stops_the_training_in_progress(tmp_path: Path) -> None:
    """The terminal closes (SIGHUP): the training, in a session of its own, must not run on forever."""
    proc, trainings = _tune_one_long_config("trivial.py")
    proc.send_signal(signal.SIGHUP)
    proc.communicate(timeout=60)
    assert not _left_alive(trainings, 60), "the training outlived dlmon tune"


@pytest.mark.slow
def test_a_second_ctrl_c_kills_a_training_whose_clean_up_is_slow(tmp_path: Path) -> None:
    """Ctrl-C once asks the training to stop (SIGINT, its clean-up may take a minute); Ctrl-C again
    must end it at once: a training in its own session would otherwise outlive dlmon tune."""
    proc, trainings = _tune_one_long_config("slow_cleanup.py")
    time.sleep(3)  # past the import of torch: the training's KeyboardInterrupt handler is in place
    for _ in range(3):  # an impatient user
        proc.send_signal(signal.SIGINT)
        time.sleep(1)
    proc.communicate(timeout=60)
    assert not _left_alive(trainings, 20), "the training outlived a second Ctrl-C"  # well under its 60 s


def test_a_cgroup_limit_above_the_machines_memory_is_not_the_limit_that_kills(tmp_path: Path) -> None:
    """A container allowed more than the host has: the host's OOM killer acts first, so the safety
    stop must use what the machine has, not the cgroup's larger figure."""
    from dlmon.collect.sampler import Sampler
    from dlmon.collect.system import read_meminfo
    from dlmon.tune.runner import _memory_limit

    if os.geteuid() != 0 or not (CGROUP_V1 / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and a cgroup v1 memory hierarchy")
    total = read_meminfo().total_bytes
    assert total
    path = CGROUP_V1 / f"dlmon-tune-big-{os.getpid()}"
    path.mkdir()
    proc = subprocess.Popen(["sleep", "60"])
    try:
        (path / "memory.limit_in_bytes").write_text(str(4 * total))
        (path / "cgroup.procs").write_text(str(proc.pid))
        sampler = Sampler(proc.pid)
        snap = sampler.sample()
        sampler.close()
        assert snap.cgroup is not None and snap.cgroup.limit_bytes is not None
        assert snap.cgroup.limit_bytes > total  # the cgroup's own figure is above the machine's
        limit, source = _memory_limit(snap)
        assert limit is not None and limit <= total, (limit, source)
    finally:
        proc.kill()
        proc.wait()
        for _ in range(100):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@pytest.mark.parametrize(
    "plan",
    [{}, {"workers": ["a"], "batch_sizes": [8]}, {"workers": 3}, {"workers": [], "batch_sizes": None}],
    ids=["empty", "word", "number", "no-workers"],
)
def test_resume_from_a_file_with_a_broken_plan_is_one_line_exit_2(
    tmp_path: Path, plan: dict[str, object]
) -> None:
    from dlmon.tune.report import FORMAT

    saved = tmp_path / "sweep.json"
    saved.write_text(json.dumps({"format": FORMAT, "command": ["true"], "plan": plan, "results": []}))
    done = run_tune(*tune_cmd("--resume", str(saved)), timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("dlmon: error: cannot resume from") and done.stderr.count("\n") == 1


@pytest.mark.parametrize("way_out", ["interrupted", "exited"])
def test_every_way_out_of_a_trial_closes_its_sampler(monkeypatch: pytest.MonkeyPatch, way_out: str) -> None:
    """Review finding 7: the stop paths skipped sampler.close(), so each trial left its GPU
    sweep thread running."""
    import threading
    from types import SimpleNamespace

    from dlmon.tune import runner
    from dlmon.tune.plan import Config

    closed: list[bool] = []

    class Spy:
        def __init__(self, pid: int, **kwargs: object) -> None:
            pass

        def sample(self) -> None:
            raise OSError("no /proc here")

        def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(runner, "Sampler", Spy)
    interrupted = threading.Event()
    if way_out == "interrupted":
        interrupted.set()
    training = SimpleNamespace(
        pid=os.getpid(),
        exit_code=lambda: 1 if way_out == "exited" else None,
        stop=lambda grace: None,
        log_path=None,
    )
    result = runner._measure(
        training,  # type: ignore[arg-type]
        Config(workers=2, batch_size=None),
        runner.RunOptions(),
        interrupted,
        "/nonexistent/status.json",
        time.monotonic(),
        lambda line: None,
    )
    assert result.outcome in (runner.INTERRUPTED, runner.CRASHED)
    assert closed == [True]
