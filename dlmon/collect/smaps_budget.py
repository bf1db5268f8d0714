"""Which processes get their (expensive) smaps_rollup read this tick.

Reading /proc/PID/smaps_rollup walks the process's page tables under its mmap lock: ~1 ms for
a 218 MiB process, ~24 ms at 4.3 GiB. Reading it for 32 large workers every second would burn
most of a core and could stall the training. So PSS/USS are refreshed under an explicit CPU
budget: a token bucket filled at ``cpu_fraction`` CPU-seconds per wall second (minus what the
cheap per-tick reads cost), spent on the processes that need a fresh value most. The bucket may
go into debt by one read, so a process that costs more than the burst is still read, and the
long-run average stays within the budget.
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


@dataclass(frozen=True, slots=True)
class BudgetPolicy:
    # Of one core, for the whole sampler. 0.9% so that estimation lag and the one read the
    # bucket may owe keep the measured total under the 1% target (docs/performance.md).
    cpu_fraction: float = 0.009
    min_smaps_fraction: float = 0.002  # PSS is never starved by the cheap reads
    burst_s: float = 0.05  # most CPU-seconds saved up while idle
    initial_s: float = 0.25  # first tick: fill the screen quickly
    steady_refresh_s: float = 10.0  # re-read a process whose RSS did not move at most this often
    moved_refresh_s: float = 1.0  # ... and one whose RSS moved by more than moved_fraction
    moved_fraction: float = 0.02  # of RSS: changed by RSS or by pages faulted in


class SmapsBudget:
    """A token bucket of CPU-seconds for smaps_rollup reads."""

    def __init__(self, policy: BudgetPolicy | None = None, unlimited: bool = False) -> None:
        self.policy = policy or BudgetPolicy()
        self.unlimited = unlimited
        self.tokens = self.policy.initial_s
        self._last_refill: float | None = None

    def refill(self, now: float, cheap_cost_per_s: float) -> None:
        """Add this interval's allowance; ``cheap_cost_per_s`` is what the every-tick reads cost."""
        if self._last_refill is not None:
            elapsed = max(0.0, now - self._last_refill)
            fraction = max(self.policy.min_smaps_fraction, self.policy.cpu_fraction - cheap_cost_per_s)
            self.tokens = min(self.tokens + fraction * elapsed, max(self.policy.burst_s, self.tokens))
        self._last_refill = now

    def can_spend(self) -> bool:
        return self.unlimited or self.tokens > 0

    def charge(self, cpu_seconds: float) -> None:
        if not self.unlimited:
            self.tokens -= cpu_seconds

    def order(self, candidates: Iterable[SmapsCandidate], now: float) -> list[SmapsCandidate]:
        """Candidates that are due, most urgent first: never read (smallest first, so most rows
        fill soonest), then by how stale they are, weighted by how much their RSS moved."""
        due: list[tuple[tuple[int, float], SmapsCandidate]] = []
        for c in candidates:
            if c.last_read is None or c.rss_at_last_read is None:
                due.append(((0, float(c.rss_bytes)), c))
                continue
            age = now - c.last_read
            changed = max(abs(c.rss_bytes - c.rss_at_last_read), c.faulted_bytes_since_read)
            moved = changed / max(c.rss_at_last_read, 1)
            limit = (
                self.policy.moved_refresh_s
                if moved > self.policy.moved_fraction
                else self.policy.steady_refresh_s
            )
            if self.unlimited or age >= limit:
                urgency = age * (1.0 + 10.0 * moved)
                due.append(((1, -urgency), c))
        due.sort(key=lambda item: item[0])
        return [c for _, c in due]
