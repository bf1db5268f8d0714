"""The stall rule is written once (dlmon.model.stall_rule) and the probe and the detector share it."""

from __future__ import annotations

import inspect
import math

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
