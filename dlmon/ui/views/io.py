"""The IO panel: the whole disks, pressure (PSI) and processes in D state."""

from __future__ import annotations

from dlmon.ui.fmt import DASH, NA, cpct, mbps
from dlmon.ui.state import DashboardState
from dlmon.ui.text import BAR, SEP, Line, Lines, Span, collapse, fit
from dlmon.ui.views.common import label


def io_lines(state: DashboardState, width: int, compact: bool, rows: int | None = None) -> Lines:
    s = state.latest
    if s is None:
        return ((("waiting for data…", "dim"),),)
    d_count = state.d_state_count()
    pr = s.cgroup.pressure if s.cgroup is not None and s.cgroup.pressure is not None else s.pressure
    psi: list[Span] = [("PSI io ", "dim")]
    if pr is None or (pr.io_some_avg10 is None and pr.io_full_avg10 is None):
        psi.append((NA, "dim"))
    else:
        psi += [
            ("some ", "dim"),
            (f"{cpct(pr.io_some_avg10, NA, 1)}%", _psi_style(pr.io_some_avg10)),
            (" full ", "dim"),
            (f"{cpct(pr.io_full_avg10, NA, 1)}%", _psi_style(pr.io_full_avg10)),
        ]
    dstate: list[Span] = [
        (
            f"{d_count} in D state"
            if compact
            else f"{d_count} process{'es' if d_count != 1 else ''} in D state",
            "warn" if d_count else "",
        )
    ]
    disks = sorted(s.disks, key=lambda d: -(d.util_percent or 0.0))
    if compact:
        parts: list[list[Span]] = []
        if disks:
            d = disks[0]
            parts.append(
                [
                    (f"{d.name} ", "b"),
                    ("r ", "dim"),
                    (f"{mbps(d.read_bytes_per_s)}MB/s ", ""),
                    (f"{cpct(d.util_percent)}%", _util_disk(d.util_percent)),
                    (f" {_ms(d.r_await_ms)}", ""),
                    (f" q{_q(d.queue_depth)}", ""),
                ]
            )
            if len(disks) > 1:
                parts.append([(f"+{len(disks) - 1} disks", "dim")])
        else:
            parts.append([("no disks", "dim")])
        parts += [psi, dstate]
        return (fit(parts, width, BAR, lead=[label("IO", 5)]),)
    out: list[Line] = []
    for d in disks:
        out.append(
            fit(
                [
                    [(d.name.ljust(8), "b")],
                    [("read ", "dim"), (f"{mbps(d.read_bytes_per_s, NA)} MB/s", "")],
                    [("write ", "dim"), (f"{mbps(d.write_bytes_per_s, NA)} MB/s", "")],
                    [("util ", "dim"), (f"{cpct(d.util_percent, NA)}%", _util_disk(d.util_percent))],
                    [("await ", "dim"), (_ms(d.r_await_ms), "")],
                    [("queue ", "dim"), (_q(d.queue_depth), "")],
                ],
                width,
                (" ", ""),
            )
        )
    out = list(
        collapse(
            out,
            rows,
            [
                [(f"{d.name} ", "b"), (f"{cpct(u, NA)}%", _util_disk(u))]
                for d, u in ((d, d.util_percent) for d in disks)
            ],
            width,
        )
    )
    if not disks:
        out.append((("no whole disks found", "dim"),))
    out.append(fit([psi, dstate], width, SEP))
    return tuple(out)


def _ms(v: float | None) -> str:
    return DASH if v is None else f"{v:.1f}ms"


def _q(v: float | None) -> str:
    return DASH if v is None else f"{v:.2f}"


def _psi_style(v: float | None) -> str:
    return "" if v is None else "crit" if v > 20 else "warn" if v > 5 else ""


def _util_disk(v: float | None) -> str:
    return "" if v is None else "warn" if v > 80 else ""
