"""What ``dlmon tune`` prints and saves: the table, the recommendation, CSV and JSON."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from dlmon.tune.model import GIB, SKIPPED, WOULD_OOM, Recommendation, Result, outcome_text, recommend
from dlmon.tune.plan import Config

FORMAT = "dlmon-tune/1"
NONE = "-"
LR_NOTE = (
    "note: batch size changes optimisation (scale the learning rate with it, or keep the batch and "
    "accumulate gradients); tune reports speed and memory only."
)


class ReportError(OSError):
    """A file that cannot be written or read back: one line for the user."""


def _gib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / GIB:.2f} GiB"


def _pin(c: Config) -> str:
    return "own" if c.pin_memory is None else ("on" if c.pin_memory else "off")


def table(results: Sequence[Result]) -> str:
    header = (
        "workers",
        "batch",
        "pin",
        "samples/s",
        "±",
        "data-wait",
        "start-up",
        "RAM peak",
        "VRAM peak",
        "outcome",
    )
    rows: list[tuple[str, ...]] = [header]
    for r in results:
        c = r.config
        outcome = outcome_text(r.outcome, r.detail)
        rows.append(
            (
                str(c.workers),
                str(c.batch_size) if c.batch_size else "own",
                _pin(c),
                f"{r.samples_per_s:.1f}" if r.samples_per_s is not None else NONE,
                f"{r.samples_per_s_spread:.1f}" if r.samples_per_s_spread is not None else NONE,
                f"{r.data_wait:.0%}" if r.data_wait is not None else NONE,
                f"{r.startup_s:.1f} s" if r.startup_s is not None else NONE,
                _gib(r.peak_pss_bytes) if r.outcome != "skipped" else NONE,
                _gib(r.peak_vram_bytes) if r.outcome != "skipped" else NONE,
                outcome,
            )
        )
    if any(r.config.prefetch_factor is not None for r in results):  # a column only when swept
        prefetch = ["prefetch"] + [str(r.config.prefetch_factor or NONE) for r in results]
        rows = [(*row[:3], pf, *row[3:]) for row, pf in zip(rows, prefetch, strict=True)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [cell.rjust(widths[i]) for i, cell in enumerate(row[:-1])]
        lines.append("  ".join([*cells, row[-1]]))
    return "\n".join(lines)


def paste_arguments(c: Config) -> str:
    args = [f"num_workers={c.workers}"]
    if c.batch_size:
        args.insert(0, f"batch_size={c.batch_size}")
    if c.pin_memory is not None:
        args.append(f"pin_memory={c.pin_memory}")
    if c.workers > 0:
        if c.prefetch_factor is not None:
            args.append(f"prefetch_factor={c.prefetch_factor}")
        args.append("persistent_workers=True")
    return "DataLoader(dataset, " + ", ".join(args) + ")"


def projection_notes(results: Sequence[Result], rec: Recommendation | None) -> list[str]:
    """A configuration stopped on a projection ('would OOM') was never seen to run out: it does not
    outrank what was measured silently. Each one that may have been faster is named."""
    top = (rec.best.samples_per_s or 0.0) if rec is not None else 0.0
    notes = []
    for r in results:
        if r.outcome != WOULD_OOM:
            continue
        if r.samples_per_s is not None and r.samples_per_s <= top:
            continue  # measured slower before the stop: the recommendation stands either way
        seen = f" ({r.samples_per_s:.0f} samples/s before the stop)" if r.samples_per_s else ""
        skipped = sum(1 for o in results if o.outcome == SKIPPED and f"of {r.config.label()}," in o.detail)
        # --force runs what was skipped; it does not turn the memory watch off, so the stopped
        # configuration itself would be stopped again on the same readings
        then = (
            f"rerun with --force to run the {skipped} skipped on it"
            if skipped
            else "the recommendation leaves it out"
        )
        notes.append(
            f"note: {r.config.label()} stopped on a projection ({outcome_text(r.outcome, r.detail)}), "
            f"not a measured OOM{seen}: {then}"
        )
    return notes


def recommendation_lines(results: Sequence[Result]) -> list[str]:
    rec: Recommendation | None = recommend(results)
    if rec is None:
        none = "no configuration was measured to the end: no recommendation"
        return [none, *projection_notes(results, rec)]
    lines = [f"recommended: {rec.reason}", f"paste: {paste_arguments(rec.choice.config)}"]
    lines += projection_notes(results, rec)
    if rec.choice.loader:
        lines.append(f"(for the DataLoader built at {rec.choice.loader})")
    lines.append(LR_NOTE)
    return lines


# ------------------------------------------------------------------ files


def result_to_dict(r: Result) -> dict[str, Any]:
    return dataclasses.asdict(r)


def result_from_dict(d: dict[str, Any]) -> Result:
    cfg = Config(**{f.name: d["config"][f.name] for f in dataclasses.fields(Config)})
    known = {f.name for f in dataclasses.fields(Result)} - {"config"}
    return Result(config=cfg, **{k: v for k, v in d.items() if k in known})


def atomic_write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename:
    a reader (or a crash) never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".dlmon-tune-", dir=directory)
    except OSError as exc:
        raise ReportError(f"cannot write {path}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ReportError(f"cannot write {path}: {exc.strerror or exc}") from exc


def check_writable(path: str) -> None:
    """Fail early (before any run) when ``path`` cannot be written; leaves nothing behind."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ReportError(f"cannot write {path}: it is a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".dlmon-tune-", dir=directory)
    except OSError as exc:
        raise ReportError(f"cannot write {path}: {exc.strerror or exc}") from exc
    os.close(fd)
    os.unlink(tmp)


def sweep_json(command: Sequence[str], plan: dict[str, Any], results: Sequence[Result], done: bool) -> str:
    return json.dumps(
        {
            "format": FORMAT,
            "command": list(command),
            "plan": plan,
            "complete": done,
            "results": [result_to_dict(r) for r in results],
        },
        indent=1,
    )


def load_sweep(path: str) -> tuple[list[str], dict[str, Any], list[Result]]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a dlmon tune file")
        results = [result_from_dict(d) for d in data["results"]]
        return list(data["command"]), dict(data["plan"]), results
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise ReportError(f"cannot resume from {path}: {exc}") from exc


CSV_FIELDS = [f.name for f in dataclasses.fields(Result) if f.name != "config"]


def sweep_csv(results: Sequence[Result]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["workers", "batch_size", "pin_memory", "prefetch_factor", *CSV_FIELDS])
    for r in results:
        d = result_to_dict(r)
        c = r.config
        writer.writerow(
            [c.workers, c.batch_size, c.pin_memory, c.prefetch_factor, *(d[k] for k in CSV_FIELDS)]
        )
    return out.getvalue()
