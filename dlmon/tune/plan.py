"""The sweep's grid: configurations, their defaults and the lists the command line gives."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from dlmon.collect.cgroup import UsableCores

TIMES = "\N{MULTIPLICATION SIGN}"


class PlanError(ValueError):
    """A bad list or option: one line for the user."""


@dataclass(frozen=True, slots=True)
class Config:
    """One point of the sweep. ``None`` keeps the script's own value."""

    workers: int
    batch_size: int | None
    pin_memory: bool | None = None
    prefetch_factor: int | None = None

    def key(self) -> str:
        return f"w={self.workers},b={self.batch_size},pin={self.pin_memory},pf={self.prefetch_factor}"

    def label(self) -> str:
        parts = [
            f"{self.workers} worker{'' if self.workers == 1 else 's'}",
            f"batch {self.batch_size if self.batch_size else 'own'}",
        ]
        if self.pin_memory is not None:
            parts.append(f"pin {'on' if self.pin_memory else 'off'}")
        if self.prefetch_factor is not None:
            parts.append(f"prefetch {self.prefetch_factor}")
        return f" {TIMES} ".join(parts[:2]) + ("" if len(parts) == 2 else ", " + ", ".join(parts[2:]))

    def agent_json(self, loader: str | None, loader_only: bool = False) -> str:
        """The DLMON_TUNE value for the agent (JSON, never pickle)."""
        return json.dumps(
            {
                "num_workers": self.workers,
                "batch_size": self.batch_size,
                "pin_memory": self.pin_memory,
                "prefetch_factor": self.prefetch_factor if self.workers > 0 else None,
                "loader": loader,
                "loader_only": loader_only,
            }
        )


@dataclass(frozen=True, slots=True)
class Plan:
    workers: tuple[int, ...]
    batch_sizes: tuple[int | None, ...] | None  # None: the script's own and its neighbours x1/2 x2
    pin_memory: tuple[bool | None, ...] = (None,)
    prefetch_factors: tuple[int | None, ...] = (None,)

    def grid(self, batch_sizes: tuple[int | None, ...]) -> list[Config]:
        """Batch sizes ascending, then pin, prefetch, and workers ascending: the order the skip
        rules need (a smaller configuration is always measured before a larger one)."""
        return [
            Config(w, b, pin, pf if w > 0 else None)
            for b in sorted(set(batch_sizes), key=lambda b: b or 0)
            for pin in self.pin_memory
            for pf in self.prefetch_factors
            for w in sorted(set(self.workers))
            if w > 0 or pf == self.prefetch_factors[0]  # prefetch means nothing without workers
        ]


def parse_int_list(text: str, what: str, minimum: int) -> tuple[int, ...]:
    """``"0,2,4"`` -> (0, 2, 4); every value at least ``minimum``; raises :class:`PlanError`."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise PlanError(f"{what}: {part!r} is not a whole number") from None
        if value < minimum:
            raise PlanError(f"{what}: {value} is not allowed (the smallest is {minimum})")
        values.append(value)
    if not values:
        raise PlanError(f"{what}: the list is empty")
    return tuple(sorted(set(values)))


def parse_pin(text: str) -> tuple[bool | None, ...]:
    choices: dict[str, tuple[bool | None, ...]] = {
        "on": (True,),
        "off": (False,),
        "both": (False, True),
        "own": (None,),
    }
    if text not in choices:
        raise PlanError(f"--pin-memory: {text!r} is not one of on, off, both, own")
    return choices[text]


def usable_cores() -> int:
    """The cores a launched training may use: this process's affinity (inherited), capped by the
    CPU quota of its cgroup and its ancestors (collect's reading of the target's cores)."""
    cores = UsableCores(os.getpid()).read_now()
    if cores is None:
        return max(1, os.cpu_count() or 1)
    return max(1, int(cores))


def default_workers(cores: int) -> tuple[int, ...]:
    """0, then powers of two up to the usable cores, and the core count itself."""
    values = {0, cores}
    w = 1
    while w < cores:
        values.add(w)
        w *= 2
    return tuple(sorted(values))


def default_batch_sizes(script_batch: int) -> tuple[int, ...]:
    """The script's own batch size and its neighbours x1/2 and x2."""
    return tuple(sorted({max(1, script_batch // 2), script_batch, script_batch * 2}))
