"""The worker detail screen: one process's figures, its death and the stack it is stuck in."""

from __future__ import annotations

import time

from dlmon.analysis.kinds import STALL, TRAINER_DIED, WORKER_DIED
from dlmon.model import Snapshot
from dlmon.ui.columns import pss_stale, row_state
from dlmon.ui.fmt import NA, cpct, duration, human_bytes, mbps
from dlmon.ui.state import ProcessRow
from dlmon.ui.text import Line, Lines, clip, fit


def detail_lines(row: ProcessRow, snapshot: Snapshot | None, width: int) -> Lines:
    p = row.process
    interval = snapshot.interval_s if snapshot is not None else None
    st, st_style = row_state(row)
    age = p.pss_age_s
    lines: list[Line] = [
        fit(
            [
                [("role ", "dim"), (p.role, "b")],
                [("worker id ", "dim"), (str(p.worker_id) if p.worker_id is not None else NA, "")],
                [("pid ", "dim"), (str(p.pid), "b")],
                [("ppid ", "dim"), (str(p.ppid) if p.ppid is not None else NA, "")],
                [("comm ", "dim"), (p.comm, "")],
                [("state ", "dim"), (st, st_style)],
            ],
            width,
        ),
        fit(
            [
                [("pids under this row ", "dim"), (str(row.pids_seen), "")],
                [("seen for ", "dim"), (duration(row.last_seen - row.first_seen), "")],
                [("loader ", "dim"), (row.loader_id or NA, "")],
                [("batch share ", "dim"), (f"{row.batch_share * 100:.0f}%" if row.batch_share else NA, "")],
                [("start_time ", "dim"), (f"{p.start_time} ticks after boot", "")],
            ],
            width,
        ),
        (),
        fit(
            [
                [("RSS ", "dim"), (human_bytes(p.rss_bytes), "b")],
                [("anon ", "dim"), (human_bytes(p.rss_anon_bytes), "")],
                [("file ", "dim"), (human_bytes(p.rss_file_bytes), "")],
                [("shmem ", "dim"), (human_bytes(p.shmem_bytes), "")],
            ],
            width,
        ),
        fit(
            [
                [("PSS ", "dim"), (human_bytes(p.pss_bytes), "b")],
                [("USS ", "dim"), (human_bytes(p.uss_bytes), "b")],
                [("PSS shmem ", "dim"), (human_bytes(p.pss_shmem_bytes), "")],
                [("swap ", "dim"), (human_bytes(p.swap_bytes), "")],
                [
                    ("read ", "dim"),
                    (
                        (f"{duration(age)} ago" + (", nothing moved since" if p.pss_still else ""))
                        if age is not None
                        else NA,
                        "stale" if pss_stale(p, interval) else "",
                    ),
                ],
            ],
            width,
        ),
        fit(
            [
                # VmLck and VmPin: CUDA pinned memory is in neither (it is shm; see the memory panel)
                [("mlocked ", "dim"), (human_bytes(p.locked_bytes), "")],
                [("RDMA pins ", "dim"), (human_bytes(p.pinned_bytes), "")],
                [("GPU ", "dim"), (human_bytes(p.gpu_memory_bytes), "")],
            ],
            width,
        ),
        fit(
            [
                [("CPU ", "dim"), (f"{cpct(p.cpu_percent, NA, 1)}%", "b")],
                [("threads ", "dim"), (str(p.num_threads) if p.num_threads is not None else NA, "")],
                [("fds ", "dim"), (str(p.num_fds) if p.num_fds is not None else NA, "")],
                [("invol. switches ", "dim"), (_per_s(p.nonvoluntary_ctxt_switches_per_s), "")],
            ],
            width,
        ),
        fit(
            [
                [("read ", "dim"), (f"{mbps(p.read_bytes_per_s, NA)} MB/s", "b")],
                [("write ", "dim"), (f"{mbps(p.write_bytes_per_s, NA)} MB/s", "")],
                [("read total ", "dim"), (human_bytes(p.read_bytes), "")],
                [("written ", "dim"), (human_bytes(p.write_bytes), "")],
            ],
            width,
        ),
    ]
    if p.unavailable:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(p.unavailable.items()))
        lines.append(((clip("unavailable: " + reasons, width), "warn"),))
    if row.death is not None:
        d = row.death
        how = f"signal {d.signal}" if d.signal is not None else f"exit code {d.exit_code}"
        lines.append(((f"died: {how} at {time.strftime('%H:%M:%S', time.localtime(d.time))}", "crit"),))
    lines.extend(stack_lines(row, snapshot, width))
    return tuple(lines)


def stack_lines(row: ProcessRow, snapshot: Snapshot | None, width: int) -> Lines:
    """Where this process is stuck or crashed: the whole stack behind its stall / death alert."""
    alerts = snapshot.alerts if snapshot is not None else ()
    for a in alerts:
        if a.evidence.get("pid") != row.process.pid or a.kind not in (STALL, WORKER_DIED, TRAINER_DIED):
            continue
        stack = a.evidence.get("stack")
        taken = a.evidence.get("stack_taken")
        if (not isinstance(stack, str) or not stack) and not isinstance(taken, str):
            continue
        head = "stuck" if a.kind == STALL else "died"
        extra = [f"{k} {a.evidence[k]}" for k in ("state", "wchan", "reading") if a.evidence.get(k)]
        title = f"{head}: " + "  ".join(extra) if extra else head + ":"
        out: list[Line] = [(), ((clip(title, width), "crit"),)]
        if isinstance(taken, str):  # read from outside (py-spy, gdb), or how to get it
            out.append(((clip("  " + taken, width), "dim"),))
        stack = stack if isinstance(stack, str) else ""
        out.extend(((clip("  " + ln, width), ""),) for ln in stack.splitlines())
        return tuple(out)
    return ()


def _per_s(v: float | None) -> str:
    return NA if v is None else f"{v:.0f}/s"
