"""The sweep: the script's own batch size first when none is given, then the grid in order,
skipping what the measurements already rule out, saving after every configuration."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dlmon.tune.model import CRASHED, OK, SKIPPED, TIMED_OUT, Result, fit_memory, outcome_text, skip_reason
from dlmon.tune.plan import Config, Plan, default_batch_sizes
from dlmon.tune.runner import INTERRUPTED

RunOne = Callable[[Config], Result]
Save = Callable[[Sequence[Result], bool], None]
NOT_TUNABLE = "batch_size is not tunable"


class SweepAborted(Exception):
    """The command cannot be tuned at all (no DataLoader, exits at once): one line, nothing saved."""


@dataclass(frozen=True, slots=True)
class SweepEnd:
    results: list[Result]
    complete: bool


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return {
        "workers": list(plan.workers),
        "batch_sizes": list(plan.batch_sizes) if plan.batch_sizes is not None else None,
        "pin_memory": list(plan.pin_memory),
        "prefetch_factors": list(plan.prefetch_factors),
    }


def plan_from_dict(d: dict[str, Any]) -> Plan:
    workers = tuple(int(w) for w in d["workers"])
    if not workers or min(workers) < 0:
        raise ValueError(f"workers must be counts of 0 or more, not {d['workers']!r}")
    return Plan(
        workers=workers,
        batch_sizes=tuple(int(b) for b in d["batch_sizes"]) if d.get("batch_sizes") is not None else None,
        pin_memory=tuple(d.get("pin_memory") or (None,)),
        prefetch_factors=tuple(d.get("prefetch_factors") or (None,)),
    )


def _fmt_s(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def _abort_if_untunable(r: Result, results: Sequence[Result]) -> None:
    """The first run tells whether the command can be tuned at all."""
    if any(p.loader for p in results) or r.loader:
        return
    if r.outcome in (CRASHED, TIMED_OUT, OK):
        raise SweepAborted(r.detail or "the command never iterated a DataLoader")


def _summary(r: Result) -> str:
    if r.outcome == OK and r.samples_per_s is not None:
        ram = f", RAM peak {r.peak_pss_bytes / 2**30:.2f} GiB" if r.peak_pss_bytes else ""
        return f"{r.samples_per_s:.1f} samples/s{ram}"
    return outcome_text(r.outcome, r.detail)


def run_sweep(
    plan: Plan,
    run_one: RunOne,
    prior: Sequence[Result],
    save: Save,
    say: Callable[[str], None],
    interrupted: Callable[[], bool],
    force: bool = False,
) -> SweepEnd:
    results = list(prior)
    durations: list[float] = []

    def measure(c: Config, index: int, total: int) -> Result | None:
        eta = ""
        if durations:
            eta = f" (ETA {_fmt_s(sum(durations) / len(durations) * (total - index + 1))})"
        say(f"[{index}/{total}] {c.label()}{eta}")
        t0 = time.monotonic()
        r = run_one(c)
        if r.outcome == INTERRUPTED:
            return None
        durations.append(time.monotonic() - t0)
        _abort_if_untunable(r, results)
        say(f"[{index}/{total}] {r.config.label()}: {_summary(r)} ({_fmt_s(time.monotonic() - t0)})")
        return r

    batches = plan.batch_sizes
    if batches is None:
        own = next((r.script_batch_size for r in results if r.script_batch_size), None)
        if own is None:
            w0 = plan.workers[0]
            first = Config(w0, None, plan.pin_memory[0], plan.prefetch_factors[0] if w0 > 0 else None)
            r = measure(first, 1, 1 + len(plan.workers) * 3 - 1)
            if r is None:
                return SweepEnd(results, False)
            results.append(r)
            save(results, False)
            own = r.script_batch_size or r.config.batch_size
        if any(NOT_TUNABLE in r.detail for r in results):
            batches = (own,)
        elif own is None:
            raise SweepAborted("cannot tell the script's batch size; give --batch-sizes")
        else:
            batches = default_batch_sizes(own)

    done = {r.config.key() for r in results}
    todo = [c for c in plan.grid(batches) if c.key() not in done]
    total = len(todo) + len(results)
    for index, c in enumerate(todo, start=len(results) + 1):
        if interrupted():
            return SweepEnd(results, False)
        untunable = next((r for r in results if NOT_TUNABLE in r.detail), None)
        limit = next((r.limit_bytes for r in reversed(results) if r.limit_bytes), None)
        reason = skip_reason(c, results, limit, fit_memory(results), force)
        if untunable is not None and c.batch_size != untunable.config.batch_size:
            reason = untunable.detail
        if reason is not None:
            results.append(Result(c, SKIPPED, reason))
            say(f"[{index}/{total}] {c.label()}: skipped, {reason}")
            save(results, False)
            continue
        r = measure(c, index, total)
        if r is None:
            return SweepEnd(results, False)
        if r.config.batch_size is None:
            r = replace(r, config=c)
        results.append(r)
        save(results, False)
    save(results, True)
    return SweepEnd(results, True)
