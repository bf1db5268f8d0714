"""The PSS refresh schedule keeps to its CPU budget and favours processes whose memory moved."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dlmon.collect.smaps_budget import BudgetPolicy, SmapsBudget, SmapsCandidate

MiB = 1024 * 1024


def simulate(costs: list[float], ticks: int, policy: BudgetPolicy) -> tuple[float, list[int]]:
    """Run the budget over ``ticks`` one-second ticks; returns CPU spent and reads per process."""
    budget = SmapsBudget(policy)
    last: dict[int, float | None] = dict.fromkeys(range(len(costs)))
    reads = [0] * len(costs)
    spent = 0.0
    for now in range(ticks):
        budget.refill(float(now), cheap_cost_per_s=0.0)
        candidates = [
            SmapsCandidate(i, 1000 * MiB, last[i], 1000 * MiB if last[i] is not None else None) for i in last
        ]
        for c in budget.order(candidates, float(now)):
            if not budget.can_spend():
                break
            budget.charge(costs[c.key])  # type: ignore[index]
            spent += costs[c.key]  # type: ignore[index]
            last[c.key] = float(now)  # type: ignore[index]
            reads[c.key] += 1  # type: ignore[index]
    return spent, reads


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.floats(min_value=0.0005, max_value=0.05), min_size=1, max_size=40),
    ticks=st.integers(min_value=30, max_value=400),
)
def test_long_run_spend_stays_within_budget(costs: list[float], ticks: int) -> None:
    policy = BudgetPolicy(cpu_fraction=0.01, steady_refresh_s=0.0, moved_refresh_s=0.0)
    spent, _ = simulate(costs, ticks, policy)
    # allowance + the first-tick allowance + at most one read in debt
    assert spent <= policy.cpu_fraction * ticks + policy.initial_s + max(costs) + 1e-9


def test_thirty_two_big_workers_are_all_refreshed_in_turn() -> None:
    """33 processes costing 6 ms each (about 1 GiB each): every one is read, round robin."""
    policy = BudgetPolicy(cpu_fraction=0.01, steady_refresh_s=0.0)
    spent, reads = simulate([0.006] * 33, 600, policy)
    assert min(reads) >= 25 and max(reads) - min(reads) <= 2
    assert spent / 600 <= 0.0105


def test_a_process_whose_rss_moved_is_read_before_a_staler_quiet_one() -> None:
    budget = SmapsBudget(BudgetPolicy())
    quiet = SmapsCandidate("quiet", 100 * MiB, last_read=1.0, rss_at_last_read=100 * MiB)
    moving = SmapsCandidate("moving", 150 * MiB, last_read=8.0, rss_at_last_read=100 * MiB)
    order = budget.order([quiet, moving], now=10.0)
    assert [c.key for c in order] == ["moving"]  # the quiet one is not even due yet
    order = budget.order([quiet, moving], now=12.0)
    assert [c.key for c in order] == ["moving", "quiet"]


def test_never_read_processes_come_first_smallest_first() -> None:
    budget = SmapsBudget(BudgetPolicy())
    old = SmapsCandidate("old", 10 * MiB, last_read=0.0, rss_at_last_read=1 * MiB)
    big = SmapsCandidate("big", 900 * MiB, None, None)
    small = SmapsCandidate("small", 5 * MiB, None, None)
    assert [c.key for c in budget.order([old, big, small], now=100.0)] == ["small", "big", "old"]


def test_unlimited_reads_everything_every_time() -> None:
    budget = SmapsBudget(unlimited=True)
    fresh = SmapsCandidate("fresh", MiB, last_read=10.0, rss_at_last_read=MiB)
    budget.charge(100.0)
    assert budget.can_spend()
    assert [c.key for c in budget.order([fresh], now=10.0)] == ["fresh"]


def test_copy_on_read_faults_count_as_movement_although_rss_is_flat() -> None:
    """A forked worker copying shared pages keeps its RSS; its minor faults give it away."""
    budget = SmapsBudget(BudgetPolicy())
    flat = SmapsCandidate("flat", 500 * MiB, last_read=8.0, rss_at_last_read=500 * MiB)
    copying = SmapsCandidate(
        "copying", 500 * MiB, last_read=8.0, rss_at_last_read=500 * MiB, faulted_bytes_since_read=40 * MiB
    )
    assert [c.key for c in budget.order([flat, copying], now=10.0)] == ["copying"]
