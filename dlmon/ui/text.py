"""Fitting styled text into a width: the one place the dashboard cuts, joins and wraps text.

A panel line is a tuple of ``(text, style)`` spans; a *part* is a few spans that belong together
(``PSS 1.2G``) and are never split. Everything here answers one question — which parts go on
which line of ``width`` cells — with :func:`flow`:

- :func:`flow` joins whole parts with a separator over as many lines as they need (or at most
  ``max_lines``), every line cut to the width with an ellipsis;
- :func:`fit` is one line of it: the parts that fit, the rest left out;
- :func:`fit_with_more` is one line that says how many parts it left out (``+2 more GPUs``);
- :func:`collapse` keeps at most ``rows`` lines and sums up the rest on a ``+N more`` line.

Two cutters below them differ only in what they cut: :func:`truncate` cuts spans, :func:`clip`
a plain string. :func:`wrap` breaks running text (a message, a hint) at spaces.
No UI imports: pure functions, unit-tested in ``tests/unit/ui/test_ui_text.py``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

Span = tuple[str, str]
Line = tuple[Span, ...]
Lines = tuple[Line, ...]

ELLIPSIS = "…"
SEP: Span = (" · ", "dim")
BAR: Span = (" │ ", "dim")


def text_of(line: Line) -> str:
    return "".join(text for text, _ in line)


def width_of(spans: Sequence[Span]) -> int:
    return sum(len(text) for text, _ in spans)


def clip(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, ending with an ellipsis when something was cut."""
    if width <= 0:
        return ""
    return text if len(text) <= width else text[: max(0, width - 1)] + ELLIPSIS


def truncate(spans: Sequence[Span], width: int) -> Line:
    """Spans cut to ``width`` cells, ending with a dim ellipsis when something was cut."""
    if width_of(spans) <= width:
        return tuple(spans)
    out: list[Span] = []
    room = max(0, width - 1)
    for text, style in spans:
        if room <= 0:
            break
        out.append((text[:room], style))
        room -= len(text[:room])
    out.append((ELLIPSIS, "dim"))
    return tuple(out)


def flow(
    parts: Sequence[Sequence[Span]],
    width: int,
    sep: Span = SEP,
    lead: Sequence[Span] = (),
    max_lines: int | None = None,
) -> Lines:
    """Whole parts joined with ``sep``, each line starting with ``lead``, over as many lines as
    they need (at most ``max_lines``: the parts after it are left out). A part wider than a
    line gets a line of its own, cut with an ellipsis."""
    lines: list[Line] = []
    current: list[Span] = list(lead)
    used = width_of(current)
    start = used
    for part in parts:
        need = width_of(part) + (len(sep[0]) if used > start else 0)
        if used > start and used + need > width:
            lines.append(tuple(current))
            if max_lines is not None and len(lines) >= max_lines:
                return tuple(truncate(line, width) for line in lines)
            current, used = list(lead), start
            need = width_of(part)
        if used > start:
            current.append(sep)
        current.extend(part)
        used += need
    if used > start:
        lines.append(tuple(current))
    return tuple(truncate(line, width) for line in lines)


def fit(parts: Sequence[Sequence[Span]], width: int, sep: Span = SEP, lead: Sequence[Span] = ()) -> Line:
    """One line of :func:`flow`: the whole parts that fit in ``width``; the rest is left out (a
    first part too long for the line is cut with an ellipsis)."""
    lines = flow(parts, width, sep, lead, max_lines=1)
    return lines[0] if lines else truncate(lead, width)


def fit_with_more(
    parts: Sequence[Sequence[Span]], width: int, sep: Span, lead: Sequence[Span], noun: str
) -> Line:
    """As :func:`fit`, ending with ``+N more GPUs`` when parts were left out."""
    for k in range(len(parts), 0, -1):
        more: list[list[Span]] = [[(f"+{len(parts) - k} more {noun}", "key")]] if k < len(parts) else []
        line = [*lead, *(span for part in _joined([*parts[:k], *more], sep) for span in part)]
        if width_of(line) <= width:
            return tuple(line)
    return fit(parts, width, sep, lead)


def collapse(lines: Sequence[Line], rows: int | None, summary: Sequence[Sequence[Span]], width: int) -> Lines:
    """At most ``rows`` lines: the first ``rows - 1`` and a summary line ``+N more: ...`` built
    from the ``summary`` parts of the lines left out (one per line, in the same order)."""
    if rows is None or len(lines) <= rows:
        return tuple(lines)
    keep = max(0, rows - 1)
    rest = len(lines) - keep
    return (*lines[:keep], fit(summary[keep:], width, SEP, lead=[(f"+{rest} more: ", "key")]))


def wrap(text: str, width: int, style: str = "") -> Lines:
    """Running text over as many lines as it needs (at spaces where it can)."""
    return tuple(((chunk, style),) for chunk in textwrap.wrap(text, max(8, width)) or [""])


def _joined(parts: Sequence[Sequence[Span]], sep: Span) -> list[Sequence[Span]]:
    out: list[Sequence[Span]] = []
    for i, part in enumerate(parts):
        if i:
            out.append((sep,))
        out.append(part)
    return out
