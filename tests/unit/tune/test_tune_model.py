"""dlmon tune's pure parts (plan, memory model, knee, skip rules, recommendation, files) and the
agent's override of a real DataLoader's arguments in a real Python process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlmon.tune.model import (
    CUDA_OOM,
    GIB,
    OK,
    WOULD_OOM,
    MemoryModel,
    OomWatch,
    Result,
    fit_memory,
    knee,
    projected_peak,
    recommend,
    skip_reason,
)
from dlmon.tune.plan import TIMES as X
from dlmon.tune.plan import Config, Plan, PlanError, default_batch_sizes, default_workers, parse_int_list
from dlmon.tune.report import (
    ReportError,
    atomic_write,
    load_sweep,
    paste_arguments,
    recommendation_lines,
    sweep_json,
    table,
)

MIB = 2**20


def ok(w: int, b: int, sps: float, peak: float = 1 * GIB, limit: int = 10 * GIB) -> Result:
    return Result(Config(w, b), OK, samples_per_s=sps, peak_pss_bytes=int(peak), limit_bytes=limit)


def test_lists_defaults_and_grid_order() -> None:
    assert parse_int_list("4, 0,2,2", "--workers", 0) == (0, 2, 4)
    with pytest.raises(PlanError, match="0 is not allowed"):
        parse_int_list("0,16", "--batch-sizes", 1)
    with pytest.raises(PlanError, match="not a whole number"):
        parse_int_list("8,x", "--batch-sizes", 1)
    assert default_workers(8) == (0, 1, 2, 4, 8)
    assert default_workers(6) == (0, 1, 2, 4, 6)
    assert default_batch_sizes(64) == (32, 64, 128)
    grid = Plan(workers=(2, 0), batch_sizes=None).grid((64, 32))
    assert [(c.workers, c.batch_size) for c in grid] == [(0, 32), (2, 32), (0, 64), (2, 64)]


def test_memory_model_recovers_a_per_worker_and_per_sample_cost() -> None:
    def peak(w: int, b: int) -> float:
        return 0.5 * GIB + w * 300 * MIB + (w * 2 + 1) * b * 2 * MIB

    points = [ok(w, b, 100.0, peak(w, b)) for w, b in ((0, 32), (2, 32), (4, 32), (2, 64))]
    model = fit_memory(points)
    assert model is not None
    assert model.per_worker_bytes == pytest.approx(300 * MIB, rel=0.01)
    assert model.per_sample_bytes == pytest.approx(2 * MIB, rel=0.01)
    assert model.predict(Config(8, 128)) == pytest.approx(peak(8, 128), rel=0.01)
    assert fit_memory(points[:2]) is None  # two points cannot fit three terms


def test_projection_follows_growth_and_never_promises_shrinking() -> None:
    assert projected_peak([0, 1, 2, 3], [100, 200, 300, 400], 5) == pytest.approx(900)
    assert projected_peak([0, 1, 2, 3], [400, 300, 200, 100], 5) == pytest.approx(100)


def test_knee_is_the_fewest_workers_near_the_best() -> None:
    assert knee([(0, 100), (2, 280), (4, 300), (8, 310)]) == 4
    assert knee([(0, 100), (1, 98), (2, 97)]) == 0


def test_skip_rules_say_why() -> None:
    oom = Result(Config(2, 64), WOULD_OOM, "at ~9 GiB")
    assert f"2 workers {X} batch 64" in (skip_reason(Config(4, 128), [oom], None, None, False) or "")
    assert skip_reason(Config(0, 128), [oom], None, None, False) is None  # fewer workers may fit
    assert skip_reason(Config(4, 128), [oom], None, None, True) is None  # --force
    cuda = Result(Config(0, 64), CUDA_OOM)
    assert "batch 64 already ran out of GPU memory" in (
        skip_reason(Config(8, 128), [cuda], None, None, False) or ""
    )
    model = MemoryModel(1 * GIB, 1 * GIB, 0.0, 4)
    reason = skip_reason(Config(8, 32), [], 4 * GIB, model, False) or ""
    assert "cannot fit by the memory model: ~9.00 GiB" in reason
    flat = [ok(0, 32, 100), ok(1, 32, 101), ok(2, 32, 102)]
    assert "past the knee" in (skip_reason(Config(4, 32), flat, None, None, False) or "")
    rising = [ok(0, 32, 100), ok(1, 32, 180), ok(2, 32, 250)]
    assert skip_reason(Config(4, 32), rising, None, None, False) is None


def test_recommendation_trades_speed_for_memory_and_says_so() -> None:
    results = [ok(0, 64, 100, 2 * GIB), ok(4, 64, 291, 5.9 * GIB), ok(8, 64, 300, 8 * GIB)]
    rec = recommend(results)
    assert rec is not None and rec.choice.config.workers == 4
    assert rec.reason == (
        f"4 workers {X} batch 64: 97% of the best speed, 41% memory headroom; "
        f"8 workers {X} batch 64 adds 3% for +2.10 GiB"
    )
    lines = recommendation_lines(results)
    assert "paste: DataLoader(dataset, batch_size=64, num_workers=4, persistent_workers=True)" in lines
    assert any("learning rate" in line for line in lines)
    assert paste_arguments(Config(0, 32)) == "DataLoader(dataset, batch_size=32, num_workers=0)"
    assert "4 workers" not in table([]) and "samples/s" in table(results)


def test_sweep_file_round_trips_and_a_failed_write_leaves_nothing(tmp_path: Path) -> None:
    results = [ok(0, 64, 100), Result(Config(2, 64), WOULD_OOM, "at ~3 GiB", peak_pss_bytes=3 * GIB)]
    path = tmp_path / "sweep.json"
    atomic_write(str(path), sweep_json(["python", "t.py"], {"workers": [0, 2]}, results, False))
    command, plan, back = load_sweep(str(path))
    assert command == ["python", "t.py"] and plan == {"workers": [0, 2]} and back == results
    with pytest.raises(ReportError, match="cannot write"):
        atomic_write(str(tmp_path / "missing" / "x.json"), "{}")
    assert sorted(os.listdir(tmp_path)) == ["sweep.json"]
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ReportError, match="cannot resume"):
        load_sweep(str(tmp_path / "bad.json"))


OVERRIDE_SCRIPT = """
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset
data = TensorDataset(torch.randn(64, 2))
first = DataLoader(data, 4, num_workers=0)  # batch_size positionally
second = DataLoader(data, batch_size=4)
fixed = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 5, False))
import json
print(json.dumps([[x.num_workers, x.batch_size, x.pin_memory, x.prefetch_factor]
                  for x in (first, second, fixed)]))
"""


def run_with_tune(
    tmp_path: Path, config: dict[str, object], script: str = OVERRIDE_SCRIPT
) -> tuple[list, dict]:
    from dlmon.agent.sitecustomize_hook import env_with_agent

    path = tmp_path / "loaders.py"
    path.write_text(script)
    status = tmp_path / "status.json"
    env = env_with_agent({**os.environ, "DLMON_TUNE": json.dumps(config), "DLMON_TUNE_STATUS": str(status)})
    out = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), json.loads(status.read_text())


def test_the_agent_overrides_the_first_loader_even_a_positional_batch_size(tmp_path: Path) -> None:
    loaders, status = run_with_tune(
        tmp_path, {"num_workers": 2, "batch_size": 8, "pin_memory": True, "prefetch_factor": 3}
    )
    assert loaders[0] == [2, 8, True, 3]
    assert loaders[1] == [0, 4, False, None]  # only one loader is tuned
    assert status["loader"].endswith("loaders.py:5")
    assert status["original"]["batch_size"] == 4 and status["original"]["num_workers"] == 0
    assert status["not_tunable"] is None


def test_the_agent_picks_the_loader_by_file_and_line(tmp_path: Path) -> None:
    loaders, status = run_with_tune(tmp_path, {"num_workers": 1, "batch_size": 16, "loader": "loaders.py:6"})
    assert loaders[0] == [0, 4, False, None]
    assert loaders[1][:2] == [1, 16]
    assert status["loader"].endswith("loaders.py:6")


def test_a_batch_sampler_loader_gets_its_workers_but_its_batch_size_is_not_tunable(tmp_path: Path) -> None:
    loaders, status = run_with_tune(tmp_path, {"num_workers": 1, "batch_size": 16, "loader": "loaders.py:7"})
    assert loaders[2][0] == 1 and loaders[2][1] is None
    assert "not tunable" in status["not_tunable"]


def test_a_loader_built_every_epoch_is_tuned_every_time(tmp_path: Path) -> None:
    script = """
import torch, json
from torch.utils.data import DataLoader, TensorDataset
data = TensorDataset(torch.randn(8, 2))
other = DataLoader(data, batch_size=2)
seen = []
for epoch in range(3):
    loader = DataLoader(data, batch_size=2)
    seen.append([loader.num_workers, loader.batch_size])
print(json.dumps(seen + [[other.num_workers, other.batch_size]]))
"""
    loaders, status = run_with_tune(
        tmp_path, {"num_workers": 1, "batch_size": 4, "loader": "loaders.py:8"}, script
    )
    assert loaders == [[1, 4], [1, 4], [1, 4], [0, 2]]
    assert status["loader"].endswith("loaders.py:8")


def test_zero_workers_drops_the_options_torch_refuses_without_workers(tmp_path: Path) -> None:
    script = """
import torch, json
from torch.utils.data import DataLoader, TensorDataset
l = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2, num_workers=4, prefetch_factor=4,
               persistent_workers=True)
print(json.dumps([l.num_workers, l.prefetch_factor, l.persistent_workers]))
"""
    loaders, _ = run_with_tune(tmp_path, {"num_workers": 0}, script)
    assert loaders == [0, None, False]


def test_tune_keeps_the_layers_apart() -> None:
    """dlmon.tune never loads plotext (only dlmon.ui.tune_plot does); the agent's part is stdlib only."""
    code = (
        "import json, sys\n"
        "import dlmon.tune.cli, dlmon.tune.sweep, dlmon.tune.runner\n"
        "before = set(sys.modules)\n"
        "import dlmon.agent._tune\n"
        "print(json.dumps([sorted(before), sorted(set(sys.modules) - before)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    tune_modules, agent_new = json.loads(out.stdout)
    assert "dlmon.tune.runner" in tune_modules
    assert not [m for m in tune_modules if m.split(".")[0] in ("plotext", "textual", "rich", "torch")]
    assert [m for m in agent_new if not m.startswith("dlmon")] == []


CPU_V1 = Path("/sys/fs/cgroup/cpu")


def usable_cores_in(shell: str) -> int:
    code = "from dlmon.tune.plan import usable_cores; print(usable_cores())"
    out = subprocess.run(
        ["sh", "-c", shell, "sh", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(out.stdout)


@pytest.mark.skipif(os.cpu_count() == 1, reason="one core: nothing to cap")
def test_default_workers_follow_the_affinity_and_the_cgroup_cpu_quota() -> None:
    assert usable_cores_in('exec taskset -c 0 "$@"') == 1
    if os.geteuid() != 0 or not (CPU_V1 / "cpu.cfs_quota_us").exists():
        pytest.skip("needs root and a cgroup v1 cpu hierarchy")
    group = CPU_V1 / f"dlmon-tune-cpu-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")  # one core
        assert usable_cores_in(f'echo $$ > {group}/cgroup.procs && exec "$@"') == 1
        assert usable_cores_in('exec "$@"') == len(os.sched_getaffinity(0))
    finally:
        group.rmdir()


def feed(watch: OomWatch, readings: list[tuple[int, int]], step: float = 0.25) -> int | None:
    """Readings of (total, anon) MiB a tick apart; the index of the reading that said stop."""
    for i, (total, anon) in enumerate(readings):
        if watch.add(i * step, total * MIB, anon * MIB, horizon_s=3.5) is not None:
            return i
    return None


def test_a_fork_burst_of_a_tick_or_two_does_not_stop_a_healthy_configuration() -> None:
    """CI: a healthy 1 worker x batch 8 (0.2 GiB) was stopped as 'would OOM' under a 0.62 GiB cap:
    one worker's fork and copy-on-write, a burst over a tick or two, extrapolated over 3.5 s."""
    burst = [(200, 180), (200, 180), (290, 270), (330, 310), (332, 312), (333, 313), (333, 313)]
    assert feed(OomWatch(640 * MIB), burst + [(333, 313)] * 12) is None


def test_a_sustained_ramp_is_stopped_long_before_the_cap() -> None:
    """batch 256: ~340 MiB/s of anonymous memory from 0.25 GiB: stopped within a few ticks and
    while the total is still well under the 0.62 GiB cap (the kernel would kill at the cap)."""
    ramp = [(250 + 85 * i, 230 + 85 * i) for i in range(10)]
    stopped = feed(OomWatch(640 * MIB), ramp)
    assert stopped is not None and stopped <= 4 and ramp[stopped][0] < 0.9 * 640


def test_file_pages_swinging_under_reclaim_are_not_growth() -> None:
    swings = [(200 + (120 if i % 3 == 1 else 0), 180) for i in range(20)]
    assert feed(OomWatch(640 * MIB), swings) is None


def test_a_total_already_past_the_line_stops_at_once() -> None:
    assert feed(OomWatch(640 * MIB), [(300, 280), (590, 300)]) == 1


def test_a_ramp_that_reaches_the_line_within_the_confirming_tick_is_stopped_at_once() -> None:
    """A batch-256 ramp (85 MiB a tick) from 385 MiB: the slope is known at the third reading
    (555 MiB) and the next one is past the line (640 MiB, the cap itself): waiting for a second
    reading to confirm let the kernel's OOM killer come first."""
    ramp = [(385 + 85 * i, 365 + 85 * i) for i in range(6)]
    stopped = feed(OomWatch(640 * MIB), ramp)
    assert stopped == 2 and ramp[stopped][0] < 0.9 * 640, stopped


def test_a_wall_clock_step_back_does_not_hide_a_ramp() -> None:
    """Readings a tick apart, the clock set back an hour at the fourth: the fit starts over
    instead of fitting a ramp against times that go backwards (no growth seen until the line)."""
    watch = OomWatch(640 * MIB)
    stopped_at: int | None = None
    for i in range(14):
        t = i * 0.25 - (3600.0 if i >= 3 else 0.0)
        total = 200 + 40 * i
        if watch.add(t, total * MIB, (total - 20) * MIB, horizon_s=3.5) is not None:
            stopped_at = total
            break
    assert stopped_at is not None and stopped_at < 0.9 * 640, stopped_at


def test_a_ramp_after_seconds_of_flat_memory_is_stopped_before_the_line() -> None:
    """Memory flat for 3 s after the loader is built (a warm-up), then a batch-256 ramp: fitted over
    all 3 s of readings the slope was a quarter of the ramp's, and the stop came at ~625 MiB of a
    640 MiB cap (review); over the last second it is the ramp's own."""
    readings = [(250, 230)] * 12 + [(250 + 85 * i, 230 + 85 * i) for i in range(1, 8)]
    stopped = feed(OomWatch(640 * MIB), readings)
    assert stopped is not None and readings[stopped][0] < 0.9 * 640, stopped


def test_a_ramp_sampled_slower_than_every_half_second_is_still_fitted() -> None:
    """The sampler reads every process's smaps each tick; under load a tick can take 0.55 s, and a
    1 s window then held two readings, to which no slope is fitted: a ramp of 88 MiB a tick was
    stopped only at the 640 MiB cap itself (the kernel's OOM killer first)."""
    readings = [(200 + 88 * i, 180 + 88 * i) for i in range(10)]
    stopped = feed(OomWatch(640 * MIB), readings, step=0.55)
    assert stopped is not None and readings[stopped][0] < 0.9 * 640, stopped


def test_a_staircase_ramp_is_stopped_before_a_step_reaches_the_cap() -> None:
    """A batch's 150 MiB every 0.5 s (a 4 Hz reading flat every other tick): only one reading in
    two rises, so the rising readings alone never confirmed twice in a row, and the one past the
    line by the next reading came only with the step that reached the 640 MiB cap itself."""
    stairs = [(200 + 150 * (i // 2), 180 + 150 * (i // 2)) for i in range(10)]
    stopped = feed(OomWatch(640 * MIB), [(200, 180)] * 4 + stairs)
    assert stopped is not None and ([(200, 180)] * 4 + stairs)[stopped][0] < 640, stopped
    slower = [(220 + 110 * (i // 4), 200 + 110 * (i // 4)) for i in range(20)]  # a step a second
    stopped = feed(OomWatch(640 * MIB), [(220, 200)] * 4 + slower)
    assert stopped is not None and ([(220, 200)] * 4 + slower)[stopped][0] < 640, stopped


def test_a_one_time_jump_then_flat_memory_is_not_stopped() -> None:
    """Issue 26: a script that allocates batch x 4 MiB once (batch 64: 256 MiB in a tick) and then
    stays flat was stopped as 'would OOM at ~1.62 GiB' at 0.43 GiB of a 700 MiB cgroup, although it
    runs for good at 409 MiB: the jump's slope was taken for growth and 'confirmed' by the flat
    reading after it. Readings after the jump show no growth: no stop."""
    jump = [(184, 164)] * 8 + [(440, 420)] + [(440, 420)] * 20
    assert feed(OomWatch(700 * MIB), jump) is None
    near = [(184, 164)] * 8 + [(560, 540)] + [(560, 540)] * 20  # a jump to 80% of the cap, then flat
    assert feed(OomWatch(700 * MIB), near) is None
    after = [(184, 164)] * 8 + [(440, 420)] * 3 + [(440 + 60 * i, 420 + 60 * i) for i in range(1, 8)]
    stopped = feed(OomWatch(700 * MIB), after)  # growth after the jump is still growth
    assert stopped is not None and after[stopped][0] < 0.9 * 700, stopped


def test_a_one_time_jump_split_over_two_readings_is_one_jump() -> None:
    split = [(184, 164)] * 8 + [(312, 292), (440, 420)] + [(440, 420)] * 20
    assert feed(OomWatch(700 * MIB), split) is None


def test_a_projection_never_outranks_a_measured_result_silently() -> None:
    """Issue 26: batch 64 stopped on a projection, batch 256 skipped on that verdict, and batch 8
    recommended at a seventh of batch 64's real speed, without a word."""
    stopped = Result(Config(0, 64), WOULD_OOM, "at ~1.62 GiB (stopped at 0.43 GiB)", samples_per_s=700.0)
    why = f"needs at least the memory of 0 workers {X} batch 64, which ran out (would OOM)"
    skipped = Result(Config(0, 256), "skipped", why)
    lines = recommendation_lines([ok(0, 8, 100), stopped, skipped])
    note = next(x for x in lines if "stopped on a projection" in x)
    assert f"0 workers {X} batch 64" in note and "rerun with --force" in note and "1 skipped on it" in note
    # Review: --force runs the skipped; it never turns the memory watch off, so promising that it
    # measures the stopped configuration itself was false advice
    alone = next(x for x in recommendation_lines([ok(0, 8, 100), stopped]) if "projection" in x)
    assert "--force" not in alone, alone
    slower = Result(Config(0, 64), WOULD_OOM, "at ~1.62 GiB", samples_per_s=50.0)
    assert not any("projection" in x for x in recommendation_lines([ok(0, 8, 100), slower]))


def test_a_staircase_of_steps_seconds_apart_is_stopped_before_a_step_reaches_the_cap() -> None:
    """Review: jumps were forgotten after 3 s, so a batch every 3 s or more (each step taken for a
    one-time allocation) was only stopped past the line: 550 -> 660 MiB in a 640 MiB cgroup was the
    kernel's OOM kill, not a stop. A second jump, however far after the first, makes a staircase."""
    for per in (12, 16, 40):  # a step every 3 s, 4 s, 10 s
        steps = [(220 + 110 * (i // per), 200 + 110 * (i // per)) for i in range(6 * per)]
        readings = [(220, 200)] * 4 + steps
        stopped = feed(OomWatch(640 * MIB), readings)
        assert stopped is not None and readings[stopped][0] < 640, (per, stopped)
