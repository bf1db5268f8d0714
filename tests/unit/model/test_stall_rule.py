"""The stall rule is written once (dlmon.model.stall_rule) and the probe and the detector share it."""

from __future__ import annotations

import inspect
import math

import pytest

from dlmon.analysis.detectors import DEFAULT_THRESHOLDS
from dlmon.collect.stacks import StallProbe
from dlmon.model import LoaderSample
from dlmon.model.stall_rule import STALL_RULE, pace_reading


def test_the_rule_waits_20_intervals_10_s_at_least_and_60_s_at_start_up() -> None:
    assert STALL_RULE.threshold_s(None) == 60.0
    assert STALL_RULE.threshold_s(0.1) == 10.0
    assert STALL_RULE.threshold_s(2.0) == 40.0
    assert STALL_RULE.lone_threshold_s(None, 4) == 60.0
    assert STALL_RULE.lone_threshold_s(0.1, 4) == 30.0
    assert STALL_RULE.lone_threshold_s(1.0, 4) == 80.0
    assert STALL_RULE.lone_threshold_s(1.0, 0) == 30.0


def test_a_pace_is_read_only_from_a_loader_that_delivered_outside_a_long_call() -> None:
    def ls(rate: float | None, call: float | None = None) -> LoaderSample:
        return LoaderSample(id="1:0", name="train", pid=1, batches_per_s=rate, in_call_s=call)

    assert pace_reading(ls(4.0)) == 4.0
    assert pace_reading(ls(4.0, 0.5)) == 4.0
    assert pace_reading(ls(4.0, 1.5)) is None
    assert pace_reading(ls(0.0)) is None
    assert pace_reading(ls(None)) is None
    assert pace_reading(ls(math.nan)) is None


def test_the_probe_takes_stacks_by_the_detectors_rule() -> None:
    default = inspect.signature(StallProbe).parameters["rule"].default
    assert default is DEFAULT_THRESHOLDS.stall_rule is STALL_RULE


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _stall_taken_after(monkeypatch: pytest.MonkeyPatch, rate: float, in_startup: bool = False) -> float:
    """Seconds of a loader stuck (no batch, its trainer in ``__next__``) before the probe takes
    the trainer's stack, after 30 s of delivering at ``rate`` batches/s (or in its start-up)."""
    from dlmon.collect import stacks
    from dlmon.collect.agent_client import AgentReading

    clock = _Clock()
    monkeypatch.setattr(stacks, "time", clock)
    probe = StallProbe(agent=None)  # type: ignore[arg-type]  # the stack reads are replaced below
    taken: list[float] = []
    monkeypatch.setattr(probe, "_trainer_stack", lambda pid: taken.append(clock.now) or [])
    monkeypatch.setattr(probe, "_crash_stacks", lambda: ())

    def tick(batches: int, in_call: float | None) -> None:
        ls = LoaderSample(
            id="1:0", name="t", pid=1, batches_total=batches, batches_per_s=None if in_startup else rate,
            in_call_s=in_call, in_startup=in_startup, alive=True,
        )  # fmt: skip
        probe.probe(AgentReading(time=clock.now, pids=(1,), loaders=(ls,)), ())

    batches = 0
    for _ in range(30):  # a steady pace
        batches += 1 if in_startup else max(1, round(rate))
        tick(batches, 0.0)
        clock.now += 1.0
    stuck_at = clock.now - 1.0  # the last batch came at the last tick of the pace
    while not taken and clock.now - stuck_at < 200:
        tick(batches, clock.now - stuck_at - 1.0)
        clock.now += 0.1
    assert taken, "the probe never took a stack"
    return taken[0] - stuck_at


@pytest.mark.parametrize(
    ("rate", "in_startup", "rule_s"),
    [(10.0, False, 10.0), (0.25, False, 80.0), (1.0, True, 60.0)],
)
def test_the_probe_takes_the_stack_at_four_fifths_of_the_rules_limit(
    monkeypatch: pytest.MonkeyPatch, rate: float, in_startup: bool, rule_s: float
) -> None:
    """Taken a little before the detector would call it a stall (0.8 of the limit), so the
    alert has its stack: 10 s at least, 20 batch intervals of a slow loader, 60 s in start-up."""
    after = _stall_taken_after(monkeypatch, rate, in_startup)
    assert 0.8 * rule_s - 0.15 <= after <= 0.8 * rule_s + 0.15, after
