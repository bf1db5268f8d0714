"""Worker start-up as its own figure: seconds per epoch and share of wall time.

Building a DataLoader iterator starts the workers (fork or spawn, a copy of the Dataset,
``worker_init_fn``) and the first batch of an epoch waits for all of that. Without
``persistent_workers=True`` it happens every epoch (and every validation pass). The agent counts it
apart from the steady-state data wait (``LoaderSample.startup_s_total``), so a job with a slow
start-up is not called input-bound between epochs; this module turns the counter into the numbers
the advice and the dashboard show.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlmon.model import LoaderSample, Snapshot

LARGE_SHARE = 0.05  # start-up above 5% of wall time is worth persistent_workers=True


@dataclass(frozen=True, slots=True)
class Startup:
    seconds_total: float
    epochs: int  # epochs started (each started one start-up)
    seconds_per_epoch: float | None
    share: float | None  # of the wall time since the target started (None: start time unknown)

    @property
    def large(self) -> bool:
        return self.share is not None and self.share >= LARGE_SHARE

    def describe(self) -> str:
        """``3.1 s per epoch over 12 epochs, 58% of wall time``."""
        per = "unknown" if self.seconds_per_epoch is None else f"{self.seconds_per_epoch:.1f} s per epoch"
        text = f"{per} over {self.epochs} epoch{'s' if self.epochs != 1 else ''}"
        return text + (f", {self.share:.0%} of wall time" if self.share is not None else "")


def startup_of(s: Snapshot, loader: LoaderSample) -> Startup | None:
    """The loader's worker start-up so far; None without the agent's counter or before an epoch."""
    return startup_from(
        loader.startup_s_total, loader.num_workers, loader.epochs_started, s.target.start_unix_time, s.time
    )


def startup_from(
    total: float | None, workers: int | None, epochs_started: int | None, started: float | None, now: float
) -> Startup | None:
    """:func:`startup_of` from the figures themselves (the report reads them from a record line)."""
    if total is None or (workers or 0) == 0:
        return None
    epochs = epochs_started or 0
    wall = None if started is None else now - started
    # a start-up in progress counts before its epoch does
    per_epoch = total / epochs if epochs else None
    share = None if not wall or wall <= 0 else min(1.0, total / wall)
    return Startup(total, epochs, per_epoch, share)
