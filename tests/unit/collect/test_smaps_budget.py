"""The PSS refresh schedule keeps to its CPU budget and favours processes whose memory moved."""

from __future__ import annotations

import pytest
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
    # allowance + the first tick's allowance and the read it overran by + at most one read in debt
    assert spent <= policy.cpu_fraction * ticks + policy.initial_s + 2 * max(costs) + 1e-9


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


def test_the_trainer_is_read_first_then_the_biggest_never_read() -> None:
    budget = SmapsBudget(BudgetPolicy())
    trainer = SmapsCandidate("trainer", 900 * MiB, None, None, is_main=True, first_seen=100.0)
    big = SmapsCandidate("big", 900 * MiB, None, None, first_seen=100.0)
    small = SmapsCandidate("small", 5 * MiB, None, None, first_seen=100.0)
    assert [c.key for c in budget.order([small, big, trainer], now=100.0)] == ["trainer", "big", "small"]


def respawn_simulation(epoch_s: int, ticks: int) -> tuple[list[float], float]:
    """A 16 GiB trainer and 32 x 2 GiB workers respawned every ``epoch_s``, smaps cost ~5 ms/GiB,
    the default budget with nothing else to pay for. Returns the times the trainer was read and
    the worst PSS age (time since the last read, or since first seen if never read) of any
    process at any tick."""
    budget = SmapsBudget(BudgetPolicy())
    cost = {"trainer": 0.08, "worker": 0.01}
    first_seen: dict[tuple[str, int], float] = {("trainer", 0): 0.0}
    last: dict[tuple[str, int], float] = {}
    trainer_reads: list[float] = []
    worst = 0.0
    for tick in range(ticks):
        now = float(tick)
        epoch = tick // epoch_s
        if tick % epoch_s == 0:  # the old workers exit, 32 new ones start
            for key in [k for k in first_seen if k[0] == "worker"]:
                first_seen.pop(key)
                last.pop(key, None)
            first_seen.update({("worker", epoch * 100 + i): now for i in range(32)})
        budget.refill(now, cheap_cost_per_s=0.0)
        candidates = [
            SmapsCandidate(
                key,
                (16 if key[0] == "trainer" else 2) * 1024 * MiB,
                last.get(key),
                (16 if key[0] == "trainer" else 2) * 1024 * MiB if key in last else None,
                is_main=key[0] == "trainer",
                first_seen=seen,
            )
            for key, seen in first_seen.items()
        ]
        for c in budget.order(candidates, now):
            if not budget.can_spend():
                break
            key = c.key
            assert isinstance(key, tuple)
            budget.charge(cost[key[0]])
            last[key] = now
            if key[0] == "trainer":
                trainer_reads.append(now)
        for key, seen in first_seen.items():
            worst = max(worst, now - last.get(key, seen))
    return trainer_reads, worst


def test_respawned_workers_never_starve_the_trainer_and_every_age_stays_bounded() -> None:
    """Issue 15: never-read workers went first, smallest first, so a trainer among workers
    respawned each epoch stayed unread for good."""
    trainer_reads, worst = respawn_simulation(epoch_s=30, ticks=900)
    assert trainer_reads and trainer_reads[0] <= 1.0  # within the first ticks
    gaps = [b - a for a, b in zip([0.0, *trainer_reads], [*trainer_reads, 899.0], strict=True)]
    assert max(gaps) <= 60.0
    assert worst <= 60.0


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


def test_a_process_is_not_read_again_before_its_last_read_could_stall_it_more_than_two_percent() -> None:
    """Issue 15: each read holds the target's mmap lock for a VMA walk; a 50 ms walk spaces
    that process's reads at least 2.5 s apart even while it moves."""
    budget = SmapsBudget(BudgetPolicy())
    slow = SmapsCandidate(
        "slow", 4096 * MiB, last_read=10.0, rss_at_last_read=3000 * MiB, last_read_wall_s=0.05
    )
    fast = SmapsCandidate(
        "fast", 4096 * MiB, last_read=10.0, rss_at_last_read=3000 * MiB, last_read_wall_s=0.005
    )
    assert [c.key for c in budget.order([slow, fast], now=11.5)] == ["fast"]
    assert {c.key for c in budget.order([slow, fast], now=12.6)} == {"fast", "slow"}


def test_what_the_first_tick_leaves_of_its_allowance_is_not_spent_on_later_ticks() -> None:
    """A small tree read whole on the first tick left most of the 0.25 s start allowance, which
    then paid for reads far above the budget for the next minute."""
    budget = SmapsBudget(BudgetPolicy())
    budget.refill(0.0, cheap_cost_per_s=0.0)
    budget.charge(0.01)  # every process read, 10 ms
    budget.refill(1.0, cheap_cost_per_s=0.0)
    assert budget.tokens <= budget.policy.burst_s


def test_the_read_the_first_tick_overran_by_is_not_repaid_by_the_steady_ticks() -> None:
    """The first tick reads until its 0.25 s is spent, so its last read overruns it: a 4 GiB
    worker's ~50 ms debt held every PSS read back for the next ~8 s of a 0.9% budget."""
    budget = SmapsBudget(BudgetPolicy())
    budget.refill(0.0, cheap_cost_per_s=0.003)
    budget.charge(0.30)  # the allowance and a 50 ms read past it
    budget.refill(1.0, cheap_cost_per_s=0.003)
    assert budget.can_spend()  # the first steady second buys a read
    assert budget.tokens == pytest.approx(0.006)


def test_a_new_worker_is_read_within_seconds_while_a_moving_trainer_takes_the_whole_budget() -> None:
    """On a loaded box the cheap reads leave the floor (0.1% of a core): about one read a second.
    The trainer moves every second and was read each time it was due; a new worker (a respawn)
    waited ~75 s for its first PSS, past its whole life in a short epoch (CI: no worker series)."""
    budget = SmapsBudget(BudgetPolicy())
    trainer_rss = 300 * MiB
    trainer_last: float | None = None
    trainer_rss_at_read: int | None = None
    worker_read_at: float | None = None
    ticks = [i * 0.5 for i in range(120)]
    for now in ticks:
        budget.refill(now, cheap_cost_per_s=0.009)  # everything but the floor went to cheap reads
        trainer_rss += 8 * MiB  # a leak or a growing cache: moved past 2% every second
        trainer = SmapsCandidate("trainer", trainer_rss, trainer_last, trainer_rss_at_read, is_main=True)
        candidates = [trainer]
        if now >= 10.0 and worker_read_at is None:
            candidates.append(SmapsCandidate("worker", 150 * MiB, None, None, first_seen=10.0))
        for c in budget.order(candidates, now):
            if not budget.can_spend():
                break
            budget.charge(0.0015)
            if c.key == "trainer":
                trainer_last, trainer_rss_at_read = now, trainer_rss
            else:
                worker_read_at = now
    assert worker_read_at is not None and worker_read_at - 10.0 <= 5.0, worker_read_at
    assert trainer_last is not None and ticks[-1] - trainer_last <= 5.0  # the trainer is still read


def test_a_reading_of_a_still_tree_is_due_only_every_still_refresh() -> None:
    """Issue 12: while the tree stood still since a reading, it is due every still_refresh_s,
    not every steady_refresh_s; its own movement still makes it due at the moved cadence."""
    policy = BudgetPolicy(max_stall_fraction=0.0)
    budget = SmapsBudget(policy)

    def due(age: float, still: bool, rss: int = 1000 * MiB) -> bool:
        c = SmapsCandidate("p", rss, 0.0, 1000 * MiB, tree_still_since_read=still)
        return budget.order([c], age) == [c]

    assert due(policy.steady_refresh_s, still=False)
    assert not due(policy.steady_refresh_s, still=True)
    assert not due(policy.still_refresh_s - 1, still=True)
    assert due(policy.still_refresh_s, still=True)
    assert due(policy.moved_refresh_s, still=True, rss=1100 * MiB)  # its own RSS moved 10%
