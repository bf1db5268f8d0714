"""The GPU sweep on its own thread: a hung NVML call never freezes the sampler.

A GPU falling off the bus or a GSP RPC timing out blocks NVML calls for tens of seconds. The
sampler asks :class:`GpuSweep` for a reading once per tick and waits at most until the sweep's
deadline (counted from when that sweep started, so a sweep hung for many ticks costs them no
wait); past it the last finished reading stands in, its devices marked stale with their age.

One thread, started on first use, runs one sweep at a time: a request while a sweep is in
flight starts none, and a new sweep starts no sooner after one ends than its healthy devices took
to answer (capped at the first back-off), so GPUs are never refreshed faster than NVML answers,
and one hung device (backed off by the collector) does not hold the others' refresh back.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from dlmon.collect.gpu import FIRST_BACKOFF_S, GpuCollector
from dlmon.model.snapshot import GpuDevice, GpuStatus

__all__ = ["DEFAULT_DEADLINE_S", "FIRST_DEADLINE_S", "GpuReading", "GpuSource", "GpuSweep", "SharedGpuSweep"]

#: How long a tick waits for its GPU sweep (NVML answers a device in ~1 ms when healthy).
DEFAULT_DEADLINE_S: Final = 0.25
#: The first sweep starts NVML (``nvmlInit`` takes seconds on a machine without persistence mode).
FIRST_DEADLINE_S: Final = 2.0


@dataclass(frozen=True, slots=True)
class GpuReading:
    """What one tick gets: the GPUs, and what asking cost the sampler thread."""

    status: GpuStatus
    devices: tuple[GpuDevice, ...]
    wall_s: float  # how long the sampler waited
    cpu_s: float  # CPU seconds of the sweep that finished for this tick (0.0: none did)


class GpuSource(Protocol):
    """What a Sampler reads its GPUs from: its own :class:`GpuSweep`, or a shared one."""

    def sample(self) -> GpuReading: ...

    def close(self) -> None: ...


def _stale(devices: tuple[GpuDevice, ...], age: float) -> tuple[GpuDevice, ...]:
    """The reading ``age`` s on: a device already stale in it (backed off) was that much older."""
    return tuple(dataclasses.replace(d, stale_age_s=round((d.stale_age_s or 0.0) + age, 3)) for d in devices)


class GpuSweep:
    """Runs ``collector.sample()`` on one daemon thread, under a per-tick deadline."""

    def __init__(
        self,
        collector: GpuCollector,
        *,
        deadline_s: float = DEFAULT_DEADLINE_S,
        first_deadline_s: float = FIRST_DEADLINE_S,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[threading.Condition, float], object] | None = None,
    ) -> None:
        """``clock`` and ``wait`` (how the sampler thread waits ``s`` seconds on the condition
        it holds) are for tests, which drive the sweep without the wall clock."""
        self._collector = collector
        self._deadline_s = deadline_s
        self._first_deadline_s = first_deadline_s
        self._clock = clock
        self._wait = wait if wait is not None else (lambda cond, seconds: cond.wait(seconds))
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._requested = 0  # sweeps asked for
        self._done = 0  # sweeps finished
        self._started_at: float | None = None  # of the sweep in flight
        self._not_before = float("-inf")
        # The last finished sweep: its result, when it ended, its CPU seconds, and whether a
        # tick has had it already.
        self._last: tuple[GpuStatus, tuple[GpuDevice, ...]] | None = None
        self._last_end = 0.0
        self._last_cpu = 0.0
        self._last_taken = True
        self._error: BaseException | None = None
        self._first_request_at: float | None = None

    def sample(self) -> GpuReading:
        """The GPUs now, or the last reading marked stale. Never blocks past the deadline."""
        start = self._clock()
        with self._cond:
            self._raise_error()
            self._start_thread()
            in_flight = self._requested > self._done
            if not in_flight and not self._stopping and start >= self._not_before:
                self._requested += 1
                self._started_at = start
                in_flight = True
                self._cond.notify_all()
            if in_flight and self._started_at is not None:
                first = self._last is None and self._done == 0
                limit = self._started_at + (self._first_deadline_s if first else self._deadline_s)
                target = self._requested
                while self._done < target and self._error is None:
                    left = limit - self._clock()
                    if left <= 0:
                        break
                    self._wait(self._cond, left)
            self._raise_error()
            fresh = not self._last_taken
            self._last_taken = True
            last, last_end, cpu = self._last, self._last_end, self._last_cpu
        now = self._clock()
        wall = now - start
        if last is None:
            waiting = 0.0 if self._first_request_at is None else now - self._first_request_at
            reason = f"NVML has not answered for {waiting:.0f} s (a hung GPU call, or NVML still starting)."
            return GpuReading(GpuStatus(available=False, reason=reason), (), wall, 0.0)
        status, devices = last
        if fresh and now - last_end <= self._deadline_s:
            return GpuReading(status, devices, wall, cpu)
        return GpuReading(status, _stale(devices, now - last_end), wall, cpu if fresh else 0.0)

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread; it shuts NVML down once its sweep returns. A hung one is left to
        return later (or never: the thread is a daemon and never holds the process up), and is
        not replaced: a later :meth:`sample` only repeats the last reading, stale."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            self._collector.close()
            with self._cond:
                self._stopping = False
            return
        thread.join(timeout_s)
        if not thread.is_alive():
            with self._cond:  # a later sample() starts afresh
                self._thread = None
                self._stopping = False
                self._requested = self._done

    def idle(self, timeout_s: float) -> bool:
        """Wait until no sweep is in flight, up to ``timeout_s``; whether none is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._requested <= self._done, timeout_s)

    def _raise_error(self) -> None:
        """Re-raise, on the sampler thread, what the collector raised: a bug, not NVML trouble
        (the collector turns all of that into None figures), so it is not swallowed."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    # -- the thread ------------------------------------------------------------------------------

    def _start_thread(self) -> None:
        if self._thread is not None:
            return
        if self._first_request_at is None:
            self._first_request_at = self._clock()
        self._thread = threading.Thread(target=self._run, name="dlmon-gpu", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._requested <= self._done and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
            cpu = time.thread_time()
            try:
                result = self._collector.sample()
            except BaseException as error:  # handed to the sampler thread, which raises it
                with self._cond:
                    self._error = error
                    self._done = self._requested
                    self._started_at = None
                    self._cond.notify_all()
                continue
            end = self._clock()
            with self._cond:
                self._last = result
                self._last_end = end
                self._last_cpu = time.thread_time() - cpu
                self._last_taken = False
                self._done = self._requested
                self._started_at = None
                # Paced on what answering took: not a device newly backed off (its hang is
                # over for now), not NVML's start, and never more than a back-off.
                self._not_before = end + min(self._collector.pace_s, FIRST_BACKOFF_S)
                self._cond.notify_all()
        self._collector.close()


class SharedGpuSweep:
    """One :class:`GpuSweep` for the samplers of several jobs (``export --all-jobs``): the first
    sampler to ask in a tick gets a reading, the others that same reading at no cost, so NVML is
    swept once per tick however many jobs there are. The owner calls :meth:`next_tick` before
    each tick and :meth:`close_shared` at the end; a sampler's :meth:`close` leaves it open."""

    def __init__(self, sweep: GpuSweep) -> None:
        self._sweep = sweep
        self._reading: GpuReading | None = None
        self.sweeps = 0  # readings taken from the sweep

    def next_tick(self) -> None:
        self._reading = None

    def sample(self) -> GpuReading:
        if self._reading is None:
            self._reading = self._sweep.sample()
            self.sweeps += 1
            return self._reading
        return dataclasses.replace(self._reading, wall_s=0.0, cpu_s=0.0)  # counted once, by the first

    def close(self) -> None:
        """A job's sampler is done with it: the other jobs are not."""

    def close_shared(self) -> None:
        self._sweep.close()
