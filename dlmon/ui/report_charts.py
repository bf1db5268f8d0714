"""Terminal charts for ``dlmon report`` (plotext lives in dlmon/ui by the layering rule; the
report's numbers and series come from dlmon.flow.summary, which has no UI imports)."""

from __future__ import annotations

import plotext as plt  # type: ignore[import-untyped]

from dlmon.flow.summary import CHARTS, SERIES, RunSummary

LABELS = {fig.key: fig.label for fig in SERIES}
SCALE = {
    "bytes": (1 / 2**20, "MiB"),
    "bytes_per_s": (1 / 2**20, "MiB/s"),
    "ratio": (100.0, "%"),
    "per_s": (1.0, "/s"),
}


def report_charts(summary: RunSummary, width: int = 100, height: int = 15, colour: bool = False) -> str:
    """The CHARTS of the summary as text, one under the other; time since start on x."""
    if summary.start is None:
        return ""
    units = {fig.key: fig.unit for fig in SERIES}
    duration = (summary.end or summary.start) - summary.start
    per, time_unit = (
        (1.0, "seconds")
        if duration < 300
        else (60.0, "minutes")
        if duration < 5 * 3600
        else (3600.0, "hours")
    )
    out: list[str] = []
    for title, keys in CHARTS:
        lines = [(key, summary.series.get(key, ())) for key in keys]
        lines = [(key, points) for key, points in lines if len(points) >= 2]
        if not lines:
            continue
        factor, unit = SCALE.get(units[lines[0][0]], (1.0, ""))
        plt.clear_figure()
        plt.plotsize(width, height)
        if not colour:
            plt.theme("clear")
        for key, points in lines:
            xs = [(t - summary.start) / per for t, _ in points]
            ys = [v * factor for _, v in points]
            plt.plot(xs, ys, label=LABELS[key], marker="braille")
        plt.title(f"{title} [{unit}]")
        plt.xlabel(f"{time_unit} since start")
        out.append(plt.build())
    plt.clear_figure()
    return "\n".join(out)
