"""``dlmon diff A B``: two recordings of the same job (before/after a change) side by side, a
verdict, and limits for CI (``--fail-on memory+10% --fail-on throughput-5%``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dlmon.analysis.detectors.registry import ENDINGS
from dlmon.export.text import figure
from dlmon.flow.summary import Peak, RunSummary

NOISE = 0.05  # changes within 5% (or 5 percentage points of data-wait) count as "the same"


class SpecError(ValueError):
    """A --fail-on value that is not NAME+N% / NAME-N% (data-wait also in pp)."""


def _peak(key: str) -> Callable[[RunSummary], float | None]:
    def read(s: RunSummary) -> float | None:
        peak = s.peaks.get(key)
        return peak.value if peak is not None else None

    return read


def _throughput(s: RunSummary) -> float | None:
    """Mean samples/s; 0 for a recording whose DataLoaders never delivered a batch (a hang in
    start-up is the worst regression, not a figure missing from it)."""
    d = s.distributions.get("throughput")
    return d.mean if d is not None else 0.0 if s.loaders else None


def _mean(key: str) -> Callable[[RunSummary], float | None]:
    def read(s: RunSummary) -> float | None:
        d = s.distributions.get(key)
        return d.mean if d is not None else None

    return read


MEMORY = "memory"


@dataclass(frozen=True, slots=True)
class Measure:
    name: str  # as written in --fail-on
    label: str
    unit: str
    read: Callable[[RunSummary], float | None]
    higher_is_better: bool


# One line per figure that diff compares and --fail-on can name.
MEASURES: tuple[Measure, ...] = (
    Measure("throughput", "throughput (mean samples/s)", "per_s", _throughput, True),
    Measure("data-wait", "data-wait (mean)", "ratio", _mean("data_wait"), False),
    Measure(MEMORY, "peak job PSS", "bytes", _peak("job_pss"), False),
    Measure("rss", "peak RSS sum", "bytes", _peak("rss_sum"), False),
    Measure("anon", "peak anonymous RSS", "bytes", _peak("rss_anon"), False),
    Measure("shm", "peak /dev/shm used", "bytes", _peak("shm_used"), False),
    Measure("vram", "peak VRAM", "bytes", _peak("vram"), False),
)
BY_NAME = {m.name: m for m in MEASURES}
WORKER_MEMORY = "worker-memory"  # the largest per-process peak change
ALERTS = "alerts"  # alert kinds in B that A did not have
NAMES = (*BY_NAME, WORKER_MEMORY, ALERTS)

_SPEC = re.compile(r"^\s*([a-z][a-z-]*?)\s*([+-])\s*(\d+(?:\.\d+)?)\s*(%|pp)?\s*$")


@dataclass(frozen=True, slots=True)
class Limit:
    """Fail when ``name`` moves in ``direction`` (+1 up, -1 down) by more than ``amount``."""

    name: str
    direction: int
    amount: float
    unit: str  # "%" (relative), "pp" (percentage points, ratios only), "" (a count: alerts)
    text: str


def parse_limit(text: str) -> Limit:
    match = _SPEC.match(text)
    if match is None:
        raise SpecError(f"--fail-on {text!r}: write NAME+N% or NAME-N% (e.g. memory+10%, throughput-5%)")
    name, sign, number, unit = match.group(1), match.group(2), float(match.group(3)), match.group(4) or ""
    if name not in NAMES:
        raise SpecError(f"--fail-on {text!r}: unknown figure {name!r} (one of: {', '.join(NAMES)})")
    if name == ALERTS:
        if unit or sign != "+":
            raise SpecError(f"--fail-on {text!r}: alerts takes a count of new alert kinds, e.g. alerts+0")
    elif unit == "pp" and name != "data-wait":
        raise SpecError(f"--fail-on {text!r}: pp (percentage points) applies to data-wait only")
    elif not unit:
        raise SpecError(
            f"--fail-on {text!r}: say % (or pp for data-wait), e.g. {name}{sign}{match.group(3)}%"
        )
    return Limit(name, 1 if sign == "+" else -1, number, unit, text.strip())


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    a: str
    b: str
    change: str
    verdict: str  # "better" | "worse" | "same" | "n/a"


@dataclass(frozen=True, slots=True)
class Comparison:
    rows: tuple[Row, ...]
    worker_rows: tuple[Row, ...]
    new_alerts: tuple[str, ...]  # kinds in B only
    gone_alerts: tuple[str, ...]  # kinds in A only
    breaches: tuple[str, ...]  # one line per --fail-on limit exceeded
    verdict: str


def _values(measure: Measure, a: RunSummary, b: RunSummary) -> tuple[str, float | None, float | None]:
    """The measure's label and its value in A and in B. Memory is the job's PSS where both
    recordings read it, else the RSS sum in both: never one's PSS against the other's RSS sum
    (which counts shared pages once per process, +100% and more with forked workers)."""
    va, vb = measure.read(a), measure.read(b)
    if measure.name == MEMORY and (va is None or vb is None):
        return "peak RSS sum (PSS not read in both)", _peak("rss_sum")(a), _peak("rss_sum")(b)
    return measure.label, va, vb


def _relative(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return (b - a) / abs(a)


def _judge(change: float | None, higher_is_better: bool) -> str:
    if change is None:
        return "n/a"
    if abs(change) <= NOISE:
        return "same"
    return "better" if (change > 0) == higher_is_better else "worse"


def _row(label: str, unit: str, a: float | None, b: float | None, higher_is_better: bool) -> Row:
    if unit == "ratio":  # shares of time: the change in percentage points
        change = None if a is None or b is None else b - a
        text = "n/a" if change is None else f"{change * 100:+.1f} pp"
    else:
        change = _relative(a, b)
        text = "n/a" if change is None else f"{change * 100:+.1f}%"
    return Row(label, figure(a, unit), figure(b, unit), text, _judge(change, higher_is_better))


def _kinds(s: RunSummary) -> set[str]:
    """The alert kinds of a run; a kind that says how the training ended counts once per cause
    (``worker_died:oom``): a new cause of it is a new kind ("died of X")."""
    return {f"{w.kind}:{w.cause}" if w.kind in ENDINGS and w.cause else w.kind for w in s.alerts}


def _measured(limit: Limit, a: RunSummary, b: RunSummary) -> float | None:
    """The change the limit is about: relative (%), in points (pp) or a count (alerts)."""
    if limit.name == ALERTS:
        return float(len(_kinds(b) - _kinds(a)))
    if limit.name == WORKER_MEMORY:
        changes = [
            c
            for name in a.slot_peaks.keys() & b.slot_peaks.keys()
            if a.slot_peaks[name].basis == b.slot_peaks[name].basis
            and (c := _relative(a.slot_peaks[name].value, b.slot_peaks[name].value)) is not None
        ]
        return (max(changes) if limit.direction > 0 else min(changes)) if changes else None
    _, va, vb = _values(BY_NAME[limit.name], a, b)
    if limit.unit == "pp":
        return None if va is None or vb is None else vb - va
    return _relative(va, vb)


def breach(limit: Limit, a: RunSummary, b: RunSummary) -> str | None:
    """A line saying how the limit was exceeded, or None. A figure missing from either recording
    breaches nothing but says so, so a CI job does not pass silently on an empty recording."""
    change = _measured(limit, a, b)
    if change is None:
        return f"{limit.text}: n/a (not measured in both recordings; not counted as a failure)"
    if limit.name == ALERTS:
        return f"{limit.text}: {change:.0f} new alert kind(s)" if change > limit.amount else None
    scale = 100.0
    moved = change * scale * limit.direction
    if moved > limit.amount:
        unit = " pp" if limit.unit == "pp" else "%"
        return f"{limit.text}: {limit.name} changed {change * scale:+.1f}{unit}"
    return None


def _slot_row(name: str, a: Peak | None, b: Peak | None) -> Row:
    """One process's peak in A and B; a PSS peak is never compared with an RSS or USS one."""
    if a is not None and b is not None and a.basis != b.basis:
        return Row(
            f"{name} (A {a.basis}, B {b.basis})",
            f"{figure(a.value, 'bytes')} {a.basis}",
            f"{figure(b.value, 'bytes')} {b.basis}",
            "n/a (not the same measure)",
            "n/a",
        )
    basis = next((p.basis for p in (a, b) if p is not None and p.basis != "PSS"), None)
    label = name if basis is None else f"{name} ({basis})"
    return _row(label, "bytes", a.value if a else None, b.value if b else None, False)


def compare(a: RunSummary, b: RunSummary, limits: Sequence[Limit] = ()) -> Comparison:
    rows = []
    for m in MEASURES:
        label, va, vb = _values(m, a, b)
        rows.append(_row(label, m.unit, va, vb, m.higher_is_better))
    names = sorted(a.slot_peaks.keys() | b.slot_peaks.keys(), key=lambda n: (n != "main", n))
    worker_rows = tuple(_slot_row(name, a.slot_peaks.get(name), b.slot_peaks.get(name)) for name in names)
    lines = [line for limit in limits if (line := breach(limit, a, b)) is not None]
    failures = tuple(line for line in lines if ": n/a" not in line)
    new, gone = tuple(sorted(_kinds(b) - _kinds(a))), tuple(sorted(_kinds(a) - _kinds(b)))
    judged = [r.verdict for r in rows if r.verdict != "n/a"]
    if failures:
        verdict = "FAIL"
    elif "worse" in judged or new:
        verdict = "worse" if "better" not in judged else "mixed"
    elif "better" in judged or gone:
        verdict = "better"
    else:
        verdict = "same"
    return Comparison(tuple(rows), worker_rows, new, gone, tuple(lines), verdict)


def format_diff(a: RunSummary, b: RunSummary, result: Comparison) -> str:
    table = [
        ("figure", "A", "B", "change", ""),
        *((r.label, r.a, r.b, r.change, r.verdict) for r in result.rows),
    ]
    if result.worker_rows:
        table.append(("peak memory per process", "", "", "", ""))
        table += [("  " + r.label, r.a, r.b, r.change, r.verdict) for r in result.worker_rows]
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    lines = [
        f"dlmon diff: A = {a.path} ({a.snapshots} snapshots), B = {b.path} ({b.snapshots} snapshots)",
        "",
    ]
    lines += ["  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in table]
    lines.append("")
    if b.verdict and any(k.split(":")[0] in ENDINGS for k in result.new_alerts):
        lines.append(f"  B ended as A did not: {b.verdict}")
    lines.append(f"  alerts new in B: {', '.join(result.new_alerts) or 'none'}")
    lines.append(f"  alerts gone in B: {', '.join(result.gone_alerts) or 'none'}")
    lines += [f"  limit: {line}" for line in result.breaches]
    explain = {
        "FAIL": "a --fail-on limit was exceeded",
        "worse": f"worse beyond {NOISE:.0%} noise, nothing better",
        "mixed": "some figures better, some worse",
        "better": "better, nothing worse",
        "same": f"within {NOISE:.0%} noise",
    }[result.verdict]
    lines.append(f"verdict: {result.verdict} ({explain})")
    return "\n".join(lines) + "\n"
