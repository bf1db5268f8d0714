"""``dlmon tune``'s terminal plot: samples/s and peak memory against workers, one line per batch size."""

from __future__ import annotations

import re
from collections.abc import Sequence

import plotext as plt  # type: ignore[import-untyped]

from dlmon.tune.model import GIB, OK, Result

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _series(results: Sequence[Result], value: str) -> dict[int, tuple[list[int], list[float]]]:
    out: dict[int, tuple[list[int], list[float]]] = {}
    for r in sorted(results, key=lambda r: r.config.workers):
        if r.outcome != OK or r.config.batch_size is None:
            continue
        y = r.samples_per_s if value == "speed" else (r.peak_pss_bytes or 0) / GIB
        if y is None:
            continue
        xs, ys = out.setdefault(r.config.batch_size, ([], []))
        xs.append(r.config.workers)
        ys.append(float(y))
    return out


def render(results: Sequence[Result], width: int = 100, height: int = 14) -> str:
    """Two plots as text (no colour codes): empty when fewer than two points were measured."""
    if sum(1 for r in results if r.outcome == OK) < 2:
        return ""
    parts = []
    for value, title, unit in (
        ("speed", "samples/s vs workers", "samples/s"),
        ("memory", "peak RAM (job PSS) vs workers", "GiB"),
    ):
        plt.clear_figure()
        plt.plotsize(width, height)
        plt.theme("clear")
        for batch, (xs, ys) in sorted(_series(results, value).items()):
            plt.plot(xs, ys, label=f"batch {batch}", marker="dot")
        plt.title(title)
        plt.xlabel("workers")
        plt.ylabel(unit)
        plt.xticks(sorted({r.config.workers for r in results if r.outcome == OK}))
        parts.append(_ANSI.sub("", plt.build()).rstrip())
    return "\n".join(parts)
