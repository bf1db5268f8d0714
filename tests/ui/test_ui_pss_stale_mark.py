"""The ~ mark on a PSS cell says "old, and memory moved since": a real tree that stands still
shows its old readings plain, and the same readings get the mark once the tree moves (issue 12:
readings of a still tree are re-taken only every few minutes, so without this every idle job
would show ~ on every row)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from conftest import Spawn
from dlmon.collect.procfs import parse_stat
from dlmon.collect.sampler import Sampler
from dlmon.collect.smaps_budget import BudgetPolicy
from dlmon.flow.sources import LiveSource
from dlmon.ui import create_app
from dlmon.ui.app import DlmonApp, MainScreen
from dlmon.ui.views import detail_lines, pss_stale
from dlmon.ui.widgets import WorkerTable
from integration.collect.test_sampler_cost import STILL_TREE, MiB
from support.ui import make_snapshot


def _settled(pids: list[int]) -> None:
    """Until three reads of the tree's faults and RSS, 0.1 s apart, agree: the first readings are
    then taken after the last movement (a child's start-up, the main's first read of stdin)."""
    seen: list[list[tuple[int, int, int]]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = [parse_stat(Path(f"/proc/{pid}/stat").read_bytes()) for pid in pids]
        seen = [*seen[-2:], [(st.minor_faults, st.major_faults, st.rss_pages) for st in stats]]
        if len(seen) == 3 and seen[0] == seen[1] == seen[2]:
            return
        time.sleep(0.1)
    raise AssertionError("the tree never stood still")


def _pss_cells(app: DlmonApp) -> list[str]:
    table = app.main_screen.query_one("#table", WorkerTable)
    rows = table.text.splitlines()
    at = rows[0].split().index("PSS")
    return [row.split()[at] for row in rows[1:] if row.split()]


def test_old_readings_of_a_still_tree_are_plain_and_marked_once_it_moves(spawn: Spawn) -> None:
    proc = spawn(STILL_TREE)
    assert proc.stdin is not None and proc.stdout is not None
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as fh:
        _settled([proc.pid, *map(int, fh.read().split())])
    # Workers are due again only after a minute once the tree moves, so their marked readings
    # stay on screen long enough to be seen on a loaded machine; the mark shows past 5 s.
    sampler = Sampler(proc.pid, policy=BudgetPolicy(steady_refresh_s=60.0, initial_s=10.0))
    seen: dict[str, list[str]] = {}

    async def main() -> None:
        app: DlmonApp = create_app(LiveSource(proc.pid, 0.5, sampler=sampler))
        async with app.run_test(size=(160, 50)) as pilot:
            assert isinstance(app.main_screen, MainScreen)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # every reading older than the mark's 5 s
                latest = app.state.latest
                ages = [p.pss_age_s for p in latest.processes] if latest is not None else []
                still = latest is not None and all(p.pss_still for p in latest.processes)
                if len(ages) == 3 and all(a is not None and a > 6.0 for a in ages) and still:
                    break
                await pilot.pause(0.2)
            app.refresh_view(True)
            await pilot.pause()
            seen["still"] = _pss_cells(app)
            latest = app.state.latest
            assert latest is not None
            seen["still_flags"] = [str(p.pss_still) for p in latest.processes]
            worker = next(r for r in app.state.rows.values() if r.process.role == "worker")
            seen["detail"] = [text for line in detail_lines(worker, latest, 160) for text, _ in line]
            proc.stdin.write(f"{16 * MiB}\n")  # type: ignore[union-attr]  # faulted in: it moved
            proc.stdin.flush()  # type: ignore[union-attr]
            assert proc.stdout.readline().strip() == "DONE"  # type: ignore[union-attr]
            while time.monotonic() < deadline:
                cells = _pss_cells(app)
                if sum(c.startswith("~") for c in cells) >= 2:
                    break
                await pilot.pause(0.2)
            seen["moved"] = _pss_cells(app)
            await pilot.press("q")

    asyncio.run(main())  # the spawn fixture ends the whole tree
    assert len(seen["still"]) == 3 and seen["still_flags"] == ["True"] * 3, seen
    assert not any(cell.startswith("~") for cell in seen["still"]), seen
    assert any("ago, nothing moved since" in text for text in seen["detail"]), seen  # the detail says why
    # the workers' readings are as old as before, but the tree moved since: marked
    assert sum(cell.startswith("~") for cell in seen["moved"]) >= 2, seen


def test_an_old_pss_reading_is_marked_only_when_the_tree_moved_since() -> None:
    worker = make_snapshot().processes[1]
    old = dataclasses.replace(worker, pss_age_s=120.0)
    assert pss_stale(old, 1.0)
    assert not pss_stale(dataclasses.replace(old, pss_still=True), 1.0)
    assert not pss_stale(dataclasses.replace(worker, pss_age_s=1.0), 1.0)
