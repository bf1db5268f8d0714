"""``dlmon report --html``: one self-contained HTML file (inline CSS and SVG, no script, no
network at view time) with the report's sections and a chart per series group."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from dlmon.export.text import Section, figure, sections, span
from dlmon.flow.summary import CHARTS, SERIES, RunSummary

WIDTH, HEIGHT = 760, 200
LEFT, RIGHT, TOP, BOTTOM = 78, 12, 12, 26
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
SEVERITY_FILL = {"critical": "#d6272833", "warning": "#ff7f0e2e", "info": "#1f77b41f"}
UNITS = {fig.key: fig.unit for fig in SERIES}
LABELS = {fig.key: fig.label for fig in SERIES}

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px auto;max-width:820px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 8px} h2{font-size:16px;margin:22px 0 6px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;width:100%;font-size:13px} td,th{padding:3px 6px;text-align:left;
vertical-align:top;border-bottom:1px solid #eee} th{color:#555;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums} .note{color:#555;font-size:13px;margin:4px 0}
.legend span{display:inline-block;margin-right:14px;font-size:12px} .legend i{display:inline-block;
width:12px;height:3px;margin-right:4px;vertical-align:middle} svg{display:block}
.crit{color:#b00;font-weight:600} .warn{color:#b60}
"""


def _table(section: Section) -> str:
    parts = [f"<h2>{escape(section.title)}</h2>"]
    if section.rows:
        parts.append("<table>")
        if any(section.header):
            parts.append("<tr>" + "".join(f"<th>{escape(h)}</th>" for h in section.header) + "</tr>")
        for row in section.rows:
            cells = []
            for cell in row:
                cls = {"critical": ' class="crit"', "warning": ' class="warn"'}.get(cell, "")
                cells.append(f"<td{cls}>{escape(cell)}</td>")
            parts.append("<tr>" + "".join(cells) + "</tr>")
        parts.append("</table>")
    if section.note:
        parts.append(f'<p class="note">{escape(section.note)}</p>')
    return "\n".join(parts)


def _ticks(low: float, high: float, count: int = 4) -> list[float]:
    if high <= low:
        return [low]
    return [low + (high - low) * i / count for i in range(count + 1)]


def chart(summary: RunSummary, title: str, keys: Sequence[str]) -> str:
    """One SVG line chart; alert windows shaded behind the lines."""
    lines = [(key, summary.series.get(key, ())) for key in keys]
    lines = [(key, points) for key, points in lines if points]
    if not lines or summary.start is None or summary.end is None:
        return f"<h2>{escape(title)}</h2><p class='note'>n/a: no readings in this recording.</p>"
    t0, t1 = summary.start, max(summary.end, summary.start + 1e-9)
    values = [v for _, points in lines for _, v in points]
    v0, v1 = min(0.0, min(values)), max(values)
    if v1 <= v0:
        v1 = v0 + 1.0
    unit = UNITS[lines[0][0]]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(t: float) -> float:
        return LEFT + (t - t0) / (t1 - t0) * plot_w

    def y(v: float) -> float:
        return TOP + plot_h - (v - v0) / (v1 - v0) * plot_h

    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#ccc"/>',
    ]
    for window in summary.alerts:
        fill = SEVERITY_FILL.get(window.severity, "#8881")
        left, right = x(window.start), max(x(window.end), x(window.start) + 2)
        svg.append(
            f'<rect x="{left:.1f}" y="{TOP}" width="{right - left:.1f}" height="{plot_h}" fill="{fill}">'
            f"<title>{escape(window.severity)} {escape(window.kind)}: {escape(window.subject)}</title></rect>"
        )
    for v in _ticks(v0, v1):
        svg.append(
            f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e4e4e4"/>'
            f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end" fill="#555">'
            f"{escape(figure(v, unit))}</text>"
        )
    ticks = _ticks(t0, t1)
    for i, t in enumerate(ticks):
        anchor = "start" if i == 0 else "end" if i == len(ticks) - 1 else "middle"
        svg.append(
            f'<text x="{x(t):.1f}" y="{HEIGHT - 8}" font-size="11" text-anchor="{anchor}" fill="#555">'
            f"+{span(t - t0)}</text>"
        )
    for colour, (_key, points) in zip(COLOURS, lines, strict=False):
        path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in points)
        svg.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.6"/>')
    svg.append("</svg>")
    legend = "".join(
        f'<span><i style="background:{c}"></i>{escape(LABELS[key])}</span>'
        for c, (key, _) in zip(COLOURS, lines, strict=False)
    )
    return f'<h2>{escape(title)}</h2>\n<div class="legend">{legend}</div>\n' + "\n".join(svg)


def format_html(summary: RunSummary) -> str:
    body = [f"<h1>dlmon report: {escape(summary.path)}</h1>"]
    all_sections = sections(summary)
    body.append(_table(all_sections[0]))
    body += [chart(summary, title, keys) for title, keys in CHARTS]
    if summary.alerts:
        body.append('<p class="note">Shaded: alert windows (red critical, orange warning, blue info).</p>')
    body += [_table(section) for section in all_sections[1:]]
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>dlmon report: {escape(summary.path)}</title><style>{STYLE}</style></head>\n<body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
