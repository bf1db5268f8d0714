"""The throughput panel: each DataLoader's rates and data wait, from the in-process agent."""

from __future__ import annotations

from dlmon.analysis.startup import startup_of
from dlmon.analysis.wait import by_process, job_wall_wait
from dlmon.model import LoaderSample
from dlmon.ui.fmt import NA, clock, cpct, duration
from dlmon.ui.state import DashboardState
from dlmon.ui.text import BAR, SEP, Line, Lines, Span, clip, fit, wrap
from dlmon.ui.views.common import label, rate_text, wait_style

AGENT_HINT = (
    "No DataLoader figures: they come from the in-process agent. Start the job with "
    "`dlmon run -- python train.py`, or add `import dlmon.agent; dlmon.agent.start()` to it."
)
AGENT_HINT_SHORT = "no loader data: `dlmon run`, or `import dlmon.agent; dlmon.agent.start()`"


def throughput_lines(state: DashboardState, width: int, compact: bool, rows: int | None = None) -> Lines:
    s = state.latest
    if s is None:
        return ((("waiting for data…", "dim"),),)
    lead = [label("DATA", 5)] if compact else []
    if not s.loaders:
        if state.agent_offer is not None and not state.loaders and s.target.alive:
            style = "warn" if "press i to try again" in state.agent_offer else "key"
            if not compact:
                return wrap(state.agent_offer, width, style)
            return (fit([[(state.agent_offer, style)]], width, lead=lead),)
        if state.loaders and not s.agent_note:  # the agent answered before: not a job without one
            last = max(h.last_seen for h in state.loaders.values())
            ended = "the training has exited" if not s.target.alive else "its DataLoaders have ended"
            said = f"no DataLoader running: {ended} (last figures {duration(s.time - last)} ago)"
            return wrap(said, width, "dim") if not compact else (fit([[(said, "dim")]], width, lead=lead),)
        if not compact:
            return wrap(s.agent_note or AGENT_HINT, width, "warn" if s.agent_note else "dim")
        return (fit([[(s.agent_note or AGENT_HINT_SHORT, "dim")]], width, lead=lead),)
    out: list[Line] = []
    if s.agent_loaded_unix_time is not None:  # loaded into the running job: nothing counted before
        if compact:
            lead = [*lead, (f"since {clock(s.agent_loaded_unix_time)} ", "dim")]
        else:
            out.extend(
                wrap(f"agent loaded at {clock(s.agent_loaded_unix_time)}; counts from then", width, "dim")
            )
    if s.agent_note and not compact:  # one rank's agent of another version or silent: its loaders are missing
        out.extend(wrap(s.agent_note, width, "warn"))
    loaders = list(s.loaders) if not compact else list(s.loaders[:1])
    rest: list[LoaderSample] = []
    if rows is not None and len(loaders) > rows:  # the busiest in full, the others summed up
        loaders.sort(key=lambda x: -(x.batches_per_s or 0.0))
        loaders, rest = loaders[: max(0, rows - 1)], loaders[max(0, rows - 1) :]
    groups = by_process(s.loaders)
    for ld in loaders:
        wait = None if ld.data_wait_fraction is None else ld.data_wait_fraction * 100
        wait_part: list[Span] = [("data wait ", "dim"), (f"{cpct(wait, NA)}%", wait_style(wait))]
        if len(groups.get(ld.pid, ())) > 1 and ld.wall_wait_fraction is not None:
            # several loaders: its own share beside what it costs the job (a validation burst)
            wall = ld.wall_wait_fraction * 100
            wait_part += [(" of its own time, ", "dim"), (f"{cpct(wall, NA)}%", wait_style(wall))]
            wait_part.append((" of the job's", "dim"))
        parts: list[list[Span]] = [
            [(rate_text(ld.batches_per_s), "b"), (" batch/s", "dim")],
            [(rate_text(ld.samples_per_s), ""), (" samples/s", "dim")],
            wait_part,
        ]
        startup = startup_of(s, ld)
        if startup is not None and startup.seconds_per_epoch is not None:
            share = "" if startup.share is None else f" ({startup.share:.0%})"
            parts.append(
                [
                    ("start-up " if compact else "worker start-up ", "dim"),
                    (f"{startup.seconds_per_epoch:.1f} s/epoch{share}", "warn" if startup.large else ""),
                ]
            )
        if not compact:
            cfg = [f"{ld.num_workers if ld.num_workers is not None else '?'} workers"]
            if ld.batch_size is not None:
                cfg.append(f"bs {ld.batch_size}")
            if ld.pin_memory:
                cfg.append("pinned")
            if ld.persistent_workers:
                cfg.append("persistent")
            if ld.framework is not None:
                cfg.append(ld.framework)
            name = f"{ld.role} · {clip(ld.label, 28)}" if ld.role else clip(ld.label, 28)
            parts.insert(0, [(name, "b")])
            parts.append([(" ".join(cfg), "dim")])
        else:
            parts.append([(f"{ld.role} · {clip(ld.label, 24)}" if ld.role else clip(ld.label, 24), "dim")])
            if len(s.loaders) > 1:
                parts.append([(f"+{len(s.loaders) - 1} loaders", "dim")])
        out.append(fit(parts, width, BAR if compact else SEP, lead=lead))
    if not compact and (rows is None or len(out) + len(groups) + (1 if rest else 0) <= rows):
        for pid, mine in sorted(groups.items()):
            job = job_wall_wait(mine) if len(mine) > 1 else None
            if job is None:
                continue
            pct = job * 100
            who = f"pid {pid} " if len(groups) > 1 else ""
            out.append(
                fit(
                    [[(f"job {who}data wait ", "dim"), (f"{cpct(pct, NA)}%", wait_style(pct))],
                     [("of wall time, over its loaders", "dim")]],
                    width,
                    SEP,
                )
            )  # fmt: skip
    if rest:
        total = sum(x.batches_per_s or 0.0 for x in rest)
        waits = [x.data_wait_fraction * 100 for x in rest if x.data_wait_fraction is not None]
        worst = max(waits) if waits else None
        out.append(
            fit(
                [
                    [(f"{rate_text(total)}", "b"), (" batch/s in all", "dim")],
                    [("data wait up to ", "dim"), (f"{cpct(worst, NA)}%", wait_style(worst))],
                    [("5 shows each", "dim")],
                ],
                width,
                SEP,
                lead=[(f"+{len(rest)} more loaders: ", "key")],
            )
        )
    return tuple(out)
