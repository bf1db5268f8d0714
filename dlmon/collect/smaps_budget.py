"""Which processes get their (expensive) smaps_rollup read this tick.

Reading /proc/PID/smaps_rollup walks the process's page tables under its mmap lock: ~1 ms for
a 218 MiB process, ~24 ms at 4.3 GiB. Reading it for 32 large workers every second would burn
most of a core and could stall the training. So PSS/USS are refreshed under an explicit CPU
budget: a token bucket filled at ``cpu_fraction`` CPU-seconds per wall second (minus what the
cheap per-tick reads cost), spent on the processes that need a fresh value most. The bucket may
go into debt by one read, so a process that costs more than the burst is still read, and the
long-run average stays within the budget.

What a reading is worth decides the order (``order``): the trainer first (largest, likeliest to
leak), then by growth evidence (RSS movement, pages faulted in), size and age. Urgency grows with
age for every process and the weights are bounded, so no process's PSS age grows without bound:
never-read processes do not starve the trainer when a DataLoader respawns its workers every epoch.

A process's PSS moves when its own pages do (a fault, RSS up or down) or when a sharer of its
pages maps or drops them: in a forked tree, mostly another process of the tree. So while the
whole tree stands still since a process's last read (no change in any member's minor or major
faults or RSS pages in /proc/PID/stat, no process in or out) its reading is due again only
after ``still_refresh_s``: a paused, hung or idle job costs next to nothing, and a change
anywhere in the tree brings every process back to the steady cadence. What this misses, for up
to ``still_refresh_s``: a sharer outside the tree (another job mapping the same library or
dataset file, a /dev/shm segment another process fills); the kernel changing sharing with no
fault and no RSS change (khugepaged collapsing copy-on-write pages into a huge page where THP is
"always", KSM merging); an RSS change smaller than the kernel's batching of the counter stat
shows (tens of pages); and a worker resting in rotation, whose movement shows at its turn. The
row says which readings stood still (``pss_still``); the others age visibly.

A read also stalls the target: the kernel holds its mmap lock across the walk of each VMA, so an
mmap/munmap in the training waits for it. A process is therefore never read more often than its
last read's wall time divided by ``max_stall_fraction`` (docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SmapsCandidate:
    key: Hashable
    rss_bytes: int
    last_read: float | None  # monotonic time of the last smaps read, None if never
    rss_at_last_read: int | None
    # Pages faulted in since the last read (minor faults x page size). Copy-on-read growth in a
    # forked worker leaves RSS flat (the page was resident, shared) but every copy is a fault.
    faulted_bytes_since_read: int = 0
    is_main: bool = False  # the trainer: read first, weighted up
    first_seen: float | None = None  # monotonic time the process joined the tree
    last_read_wall_s: float | None = None  # how long its last read held its mmap lock
    # No process of the tree faulted a page in, changed its RSS, joined or left since this one's
    # last read: its PSS can have moved only through sharers outside the tree.
    tree_still_since_read: bool = False


@dataclass(frozen=True, slots=True)
class BudgetPolicy:
    # Of one core, for the whole sampler. 0.9% so that estimation lag and the one read the
    # bucket may owe keep the measured total under the 1% target (docs/performance.md).
    cpu_fraction: float = 0.009
    min_smaps_fraction: float = 0.001  # PSS is never starved by the rest of the tick
    burst_s: float = 0.05  # most CPU-seconds saved up while idle
    initial_s: float = 0.25  # first tick: fill the screen quickly
    steady_refresh_s: float = 10.0  # re-read a process whose RSS did not move at most this often
    moved_refresh_s: float = 1.0  # ... and one whose RSS moved by more than moved_fraction
    # ... and one whose whole tree stood still since its read (see the module docstring)
    still_refresh_s: float = 300.0
    moved_fraction: float = 0.02  # of RSS: changed by RSS or by pages faulted in
    # At most this fraction of a process's wall time under dlmon's smaps read (its mmap lock).
    max_stall_fraction: float = 0.02
    main_weight: float = 4.0  # the trainer's reading is worth this many workers'
    never_read_growth: float = 2.0  # a never-read process counts as having moved this many thresholds


class SmapsBudget:
    """A token bucket of CPU-seconds for smaps_rollup reads."""

    def __init__(self, policy: BudgetPolicy | None = None, unlimited: bool = False) -> None:
        self.policy = policy or BudgetPolicy()
        self.unlimited = unlimited
        self.tokens = self.policy.initial_s
        self._last_refill: float | None = None
        self._first_refill = True

    def refill(self, now: float, cheap_cost_per_s: float) -> None:
        """Add this interval's allowance; ``cheap_cost_per_s`` is what the every-tick reads cost."""
        if self._last_refill is not None:
            elapsed = max(0.0, now - self._last_refill)
            fraction = max(self.policy.min_smaps_fraction, self.policy.cpu_fraction - cheap_cost_per_s)
            if self._first_refill:
                # The first tick's allowance is its own, for filling the screen at once: what it
                # left is not spent later (it showed as ~50 ms over the next ticks), and the one
                # read it overran by is not repaid (a 4 GiB worker's ~50 ms held every PSS read
                # back for the next ~8 s).
                self.tokens = 0.0
                self._first_refill = False
            self.tokens = min(self.tokens + fraction * elapsed, self.policy.burst_s)
        self._last_refill = now

    def can_spend(self) -> bool:
        return self.unlimited or self.tokens > 0

    def charge(self, cpu_seconds: float) -> None:
        if not self.unlimited:
            self.tokens -= cpu_seconds

    def order(self, candidates: Iterable[SmapsCandidate], now: float) -> list[SmapsCandidate]:
        """Candidates that are due, most valuable first.

        urgency = age x worth. A never-read process counts as one steady period overdue plus the
        time since it was first seen, and as grown by ``never_read_growth`` thresholds; worth =
        trainer weight x (1 + 4 x growth) x (1 + its share of the largest RSS), growth =
        movement / moved_fraction capped at 5 (a process that moved past the threshold outranks
        idle ones up to ~21x staler). Every weight is bounded, so a process passed over keeps
        gaining until it is read.
        """
        pool = list(candidates)
        largest = max((c.rss_bytes for c in pool), default=0) or 1
        policy = self.policy
        due: list[tuple[float, int, SmapsCandidate]] = []
        for c in pool:
            if c.last_read is None or c.rss_at_last_read is None:
                seen = now if c.first_seen is None else c.first_seen
                age = policy.steady_refresh_s + max(0.0, now - seen)
                # nothing known yet is worth a moved process's re-read: at one read a tick (a
                # loaded box) a moving trainer otherwise kept a new worker unread for ~75 s
                moved = policy.never_read_growth * policy.moved_fraction
            else:
                age = now - c.last_read
                changed = max(abs(c.rss_bytes - c.rss_at_last_read), c.faulted_bytes_since_read)
                moved = changed / max(c.rss_at_last_read, 1)
                if moved > policy.moved_fraction:
                    limit = policy.moved_refresh_s
                elif c.tree_still_since_read:
                    limit = policy.still_refresh_s
                else:
                    limit = policy.steady_refresh_s
                if c.last_read_wall_s is not None and policy.max_stall_fraction > 0:
                    limit = max(limit, c.last_read_wall_s / policy.max_stall_fraction)
                if not self.unlimited and age < limit:
                    continue
            growth = min(moved / policy.moved_fraction, 5.0) if policy.moved_fraction > 0 else 0.0
            worth = (
                (policy.main_weight if c.is_main else 1.0)
                * (1.0 + 4.0 * growth)
                * (1.0 + c.rss_bytes / largest)
            )
            due.append((-(max(age, 1e-3) * worth), len(due), c))
        due.sort(key=lambda item: item[:2])
        return [c for _, _, c in due]
