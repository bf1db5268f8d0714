"""The report's content as sections of rows, rendered as plain text (terminal, CI log) or Markdown
(a PR comment). The HTML report renders the same sections, so the three never disagree."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from dlmon.analysis.startup import LARGE_SHARE
from dlmon.flow.summary import PEAKS, Distribution, RunSummary
from dlmon.model import WorkerDeath
from dlmon.model.format import human_bytes

# What a worker's death usually means; a death-cause field from the agent, when it exists,
# would take precedence (one line here per cause).
CAUSE_HINTS: Mapping[str, str] = {
    "SIGKILL": "killed outright: usually the OOM killer",
    "SIGBUS": "bus error: usually /dev/shm too small for the batches",
    "SIGSEGV": "segmentation fault in native code (a decoder, an extension)",
    "SIGABRT": "aborted by native code",
    "SIGTERM": "terminated by someone",
}


@dataclass(frozen=True, slots=True)
class Section:
    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str | None = None


def clock(t: float | None) -> str:
    return "n/a" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def span(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    whole = round(seconds)
    h, rest = divmod(whole, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def offset(summary: RunSummary, t: float | None) -> str:
    return "n/a" if t is None or summary.start is None else "+" + span(t - summary.start)


def figure(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "bytes":
        return human_bytes(value)
    if unit == "bytes_per_s":
        return human_bytes(value) + "/s"
    if unit == "ratio":
        return f"{value * 100:.1f}%"
    if unit == "per_s":
        return f"{value:,.1f}/s"
    return f"{value:,.0f}"


def death_cause(death: WorkerDeath, oom_kills: int | None) -> str:
    name = death.signal_name or (f"signal {death.signal}" if death.signal else None)
    if name is None:
        return f"exit code {death.exit_code}" if death.exit_code is not None else "unknown"
    hint = CAUSE_HINTS.get(name, "")
    if name == "SIGKILL" and oom_kills:
        hint = f"the OOM killer ({oom_kills} OOM kill(s) during the run)"
    elif name == "SIGKILL" and oom_kills == 0:
        hint = "killed outright, not by the OOM killer (no OOM kill counted during the run)"
    return f"{name}: {hint}" if hint else name


def _distribution(name: str, d: Distribution | None, unit: str) -> tuple[str, ...]:
    if d is None:
        return (name, "n/a", "n/a", "n/a", "0")
    return (name, figure(d.mean, unit), figure(d.p5, unit), figure(d.p95, unit), str(d.samples))


# A recording that began this long after its job did: the agent's cumulative counters (epochs,
# start-up) cover time the recording does not, and the report says from when it counts.
LATE_START_S = 10.0


def counted_since(summary: RunSummary) -> str | None:
    """'counted from the job's start at HH:MM:SS, 0:42:00 before this recording began', or None.

    An agent loaded into the running job (attach --inject) counts from its load instead: said
    when that is away from the recording's start (loaded long before it, or during it)."""
    job, start, loaded = summary.job_start, summary.start, summary.agent_loaded
    if loaded is not None and start is not None:
        gap = loaded - start
        if abs(gap) < LATE_START_S:
            return None
        when = "after" if gap > 0 else "before"
        return (
            f"counted from the agent's load into the running job at {clock(loaded)}, "
            f"{span(abs(gap))} {when} this recording began"
        )
    if job is None or start is None or start - job < LATE_START_S:
        return None
    return f"counted from the job's start at {clock(job)}, {span(start - job)} before this recording began"


def _startup_section(summary: RunSummary) -> Section:
    """Per loader: epochs started, start-up seconds, seconds per epoch, share of wall time."""
    rows = tuple(
        (
            loader_id,
            str(s.epochs),
            f"{s.seconds_total:.1f} s",
            "n/a" if s.seconds_per_epoch is None else f"{s.seconds_per_epoch:.2f} s",
            "n/a" if s.share is None else f"{s.share:.1%}",
        )
        for loader_id, s in summary.startups.items()
    )
    if not rows:
        return Section(
            "Worker start-up per epoch",
            (),
            (),
            "n/a: this recording holds no worker start-up figures (no agent, or no loader with workers).",
        )
    large = [loader_id for loader_id, s in summary.startups.items() if s.large]
    note = (
        f"Start-up above {LARGE_SHARE:.0%} of wall time ({', '.join(large)}): workers restart every epoch; "
        "persistent_workers=True keeps them."
        if large
        else None
    )
    since = counted_since(summary)
    if since is not None:
        note = " ".join(x for x in (f"Epochs and start-up are {since}.", note) if x)
    return Section(
        "Worker start-up per epoch",
        ("loader", "epochs started", "start-up total", "per epoch", "share of wall time"),
        rows,
        note,
    )


ORIGINS = {
    "next": "left the DataLoader",
    "main": "uncaught (main thread)",
    "thread": "uncaught (its thread ended)",
}


def _exceptions_section(summary: RunSummary) -> Section:
    """Every exception the agent's journal told of: the one the run died of, and caught ones."""
    rows = []
    uncaught = {(e.reported_by, e.type, e.message) for e in summary.exceptions if e.origin == "main"}
    left = {(e.reported_by, e.type, e.message) for e in summary.exceptions if e.origin == "next"}
    for e in summary.exceptions:
        same = (e.reported_by, e.type, e.message)
        if e.origin == "main" and same in left:
            continue  # shown once, as it left the DataLoader
        how = ORIGINS.get(e.origin, e.origin)
        if e.origin == "next" and same in uncaught:
            how += ", then uncaught"
        who = (
            f"worker {e.worker_id}"
            if e.worker_id is not None
            else f"thread {e.thread}"
            if e.origin == "thread"
            else f"trainer (pid {e.reported_by})"
        )
        kind = e.worker_type or e.type
        text = e.worker_message if e.worker_type else e.message
        where = f"{e.file}:{e.line} in {e.function}" if e.file else "n/a"
        shown = f"{kind}: {text}" if text else kind
        rows.append((offset(summary, e.time), who, how, shown[:200], where))
    return Section(
        f"Exceptions ({len(rows)})",
        ("at", "raised in", "how", "exception", "user's frame"),
        tuple(rows),
        None if rows else "none seen by the agent",
    )


def sections(summary: RunSummary) -> list[Section]:
    out: list[Section] = []
    overview: list[tuple[str, ...]] = [
        ("recording", summary.path),
        ("command", summary.command or "n/a"),
        ("host", summary.host or "n/a"),
        ("from", f"{clock(summary.start)} to {clock(summary.end)}"),
        ("duration", f"{span(summary.duration_s)} ({summary.snapshots} snapshots)"),
        ("ended", (summary.end_reason or "no end marker (cut short?)").replace("_", " ")),
    ]
    if summary.verdict:
        overview.append(("verdict", summary.verdict))
    overview += [("loader", text) for text in summary.loaders]
    if summary.epochs is not None:
        since = counted_since(summary)
        overview.append(("epochs finished", str(summary.epochs) + (f" ({since})" if since else "")))
    out.append(Section("Run", ("", ""), tuple(overview)))

    peaks = [
        (fig.label, figure(p.value, fig.unit), offset(summary, p.time))
        for fig in PEAKS
        if (p := summary.peaks.get(fig.key)) is not None
    ]
    pss, rss = summary.peaks.get("job_pss"), summary.peaks.get("rss_sum")
    note = None
    if pss is not None and rss is not None and rss.value > 0:
        note = (
            f"Peak job PSS is {pss.value / rss.value:.0%} of the peak RSS sum: the rest is pages the "
            "processes share, counted once per process by RSS."
        )
    out.append(Section("Memory peaks", ("figure", "peak", "at"), tuple(peaks), note))

    slots = sorted(summary.slot_peaks.items(), key=lambda kv: (not kv[0].startswith("main"), kv[0]))
    out.append(
        Section(
            "Peak memory per process (PSS)",
            ("process", "peak", "at"),
            tuple(
                (
                    name,
                    human_bytes(p.value) + ("" if p.basis == "PSS" else f" ({p.basis})"),
                    offset(summary, p.time),
                )
                for name, p in slots
            ),
        )
    )

    d = summary.distributions
    out.append(
        Section(
            "Throughput and data-wait",
            ("figure", "mean", "p5", "p95", "samples"),
            (
                _distribution("throughput (samples/s)", d.get("throughput"), "per_s"),
                _distribution("data-wait (share of time)", d.get("data_wait"), "ratio"),
            ),
            None if d else "n/a: no DataLoader figures in this recording (was the agent loaded?)",
        )
    )
    out.append(_startup_section(summary))
    deaths = tuple(
        (
            offset(summary, death.time),
            f"worker {death.worker_id if death.worker_id is not None else '?'} (pid {death.pid})",
            death.loader_id or "n/a",
            death_cause(death, summary.oom_kills),
        )
        for death in summary.deaths
    )
    out.append(
        Section(
            f"Worker deaths ({len(deaths)})",
            ("at", "worker", "loader", "cause"),
            deaths,
            None if deaths else "none",
        )
    )
    out.append(_exceptions_section(summary))
    alerts = tuple(
        (
            offset(summary, w.start),
            offset(summary, w.end) + (" (still active)" if w.open_at_end else ""),
            span(w.end - w.start),
            w.severity,
            w.kind,
            w.subject,
            w.message,
        )
        for w in summary.alerts
    )
    out.append(
        Section(
            f"Alerts ({len(alerts)})",
            ("from", "to", "lasted", "severity", "kind", "subject", "message"),
            alerts,
            None if alerts else "none",
        )
    )
    if summary.problems_total or summary.left_out:
        rows = tuple((f"line {p.line}", p.reason) for p in summary.problems)
        more = summary.problems_total - len(summary.problems)
        notes = [f"{summary.problems_total} line(s) skipped; the rest of the recording is reported."]
        if more > 0:
            notes.append(f"{more} more not listed.")
        notes += [
            f"{n} {what} beyond the report's limits not listed." for what, n in summary.left_out.items()
        ]
        out.append(Section("Skipped", ("line", "why"), rows, " ".join(notes)))
    return out


def format_text(summary: RunSummary) -> str:
    lines = [f"dlmon report: {summary.path}"]
    for section in sections(summary):
        lines += ["", section.title]
        rows = [section.header, *section.rows] if any(section.header) else list(section.rows)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))] if rows else []
        for row in rows:
            cells = [cell.ljust(widths[i]) if i < len(row) - 1 else cell for i, cell in enumerate(row)]
            lines.append("  " + "  ".join(cells).rstrip())
        if section.note:
            lines.append(f"  {section.note}")
    return "\n".join(lines) + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_markdown(summary: RunSummary) -> str:
    lines = [f"## dlmon report: `{summary.path}`"]
    for section in sections(summary):
        lines += ["", f"### {section.title}", ""]
        if section.rows:
            header = section.header if any(section.header) else tuple("" for _ in section.rows[0])
            lines.append("| " + " | ".join(_md_cell(h) for h in header) + " |")
            lines.append("|" + "---|" * len(header))
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in section.rows]
        if section.note:
            lines += ["", section.note]
    return "\n".join(lines) + "\n"
