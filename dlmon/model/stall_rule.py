"""When a loader's wait is a stall: the one rule the stack probe (``dlmon.collect.stacks``, to have
the stacks when the alert comes) and the stall detector (to raise it) both apply. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from dlmon.model.snapshot import LoaderSample


@dataclass(frozen=True, slots=True)
class StallRule:
    """How long a wait must last to be a stall, given the loader's usual seconds per batch."""

    min_s: float = 10.0  # never call a wait shorter than this a stall ...
    intervals: float = 20.0  # ... nor one shorter than this many usual batch intervals
    startup_s: float = 60.0  # a loader that never delivered steadily (workers starting): only this long
    lone_min_s: float = 30.0  # a worker that finished nothing this long while the loader went on

    def threshold_s(self, interval_s: float | None) -> float:
        """The wait that is a stall; ``interval_s`` None: start-up, or never delivered."""
        if interval_s is None:
            return self.startup_s
        return max(self.min_s, self.intervals * interval_s)

    def lone_threshold_s(self, interval_s: float | None, num_workers: int) -> float:
        """A worker that finished nothing this long while the others delivered is stuck."""
        if interval_s is None:
            return 2 * self.lone_min_s
        return max(self.lone_min_s, self.intervals * max(1, num_workers) * interval_s)


STALL_RULE = StallRule()


def pace_reading(ls: LoaderSample) -> float | None:
    """The sample's batches/s when it tells the loader's usual pace: it delivered, and not from
    inside a long call (a stall's own slow reading would stretch the pace it is judged by)."""
    rate = ls.batches_per_s
    if rate is None or not rate > 0 or (ls.in_call_s or 0.0) > 1.0:  # NaN is no pace
        return None
    return rate
