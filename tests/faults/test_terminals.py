"""Terminals: tiny and huge sizes, a resize storm, and a slow reader (a throttled pty, as on a slow
SSH link): frames are dropped, not queued, and ``q`` still answers."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import sys
import time

import pytest
from textual.pilot import Pilot

from conftest import Spawn
from dlmon.flow.sources import LiveSource
from dlmon.ui import DashboardResult
from dlmon.ui.app import DlmonApp

from .screen import run_dashboard, screen_text, wait_for_text
from .support import env_with_dlmon, rss_bytes, tree_of_sleepers

pytestmark = pytest.mark.slow

MiB = 1 << 20


@pytest.mark.parametrize("size", [(40, 12), (300, 100)])
def test_tiny_and_huge_terminals_render_and_quit(spawn: Spawn, size: tuple[int, int]) -> None:
    tree = spawn(tree_of_sleepers(4))
    shown: list[str] = []

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        shown.append(await wait_for_text(app, pilot, "dlmon"))
        await pilot.pause(1.0)  # a few live frames
        await pilot.press("q")

    _, result = run_dashboard(LiveSource(tree.pid, interval=0.2), scenario, size=size)
    assert result is not None, "q did not quit"
    assert shown[0].strip()


def test_a_resize_storm_keeps_the_dashboard_drawing_and_q_quits(spawn: Spawn) -> None:
    tree = spawn(tree_of_sleepers(8))
    sizes = [(40, 12), (300, 100), (80, 24), (120, 40), (41, 13), (160, 50), (60, 20), (250, 80)]
    after: list[str] = []

    async def scenario(app: DlmonApp, pilot: Pilot[DashboardResult]) -> None:
        await wait_for_text(app, pilot, f"pid {tree.pid}")
        for i in range(60):
            await pilot.resize_terminal(*sizes[i % len(sizes)])
            if i % 10 == 0:
                await pilot.pause(0.02)
        await pilot.resize_terminal(160, 50)
        await pilot.pause(1.0)
        after.append(screen_text(app))
        await pilot.press("q")

    _, result = run_dashboard(LiveSource(tree.pid, interval=0.2), scenario, size=(80, 24))
    assert result is not None, "q did not quit after the storm"
    assert f"pid {tree.pid}" in after[0]


def test_a_slow_terminal_reader_drops_frames_and_q_answers(spawn: Spawn) -> None:
    """The dashboard on a real pty read at ~2 KiB/s (a slow SSH link): dlmon's memory stays flat
    (frames are not queued up for the slow reader) and ``q`` is answered."""
    tree = spawn(tree_of_sleepers(8))
    code = (
        "from dlmon.ui import run_dashboard; from dlmon.flow.sources import LiveSource; "
        f"run_dashboard(LiveSource({tree.pid}, interval=0.1))"
    )
    pid, fd = pty.fork()
    if pid == 0:  # the child: dlmon on the pty
        os.environ.update(env_with_dlmon({"TERM": "xterm-256color", "COLUMNS": "160", "LINES": "50"}))
        os.execv(sys.executable, [sys.executable, "-c", code])
    try:
        import fcntl
        import struct
        import termios

        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
        got = b""
        deadline = time.monotonic() + 60
        while b"dlmon" not in got and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.5)[0]:
                got += os.read(fd, 65536)
        assert b"dlmon" in got, got[-500:]
        time.sleep(3.0)  # warm-up, reading nothing: the pty buffer fills, dlmon must not queue
        rss_start = rss_bytes(pid)
        read = 0
        end = time.monotonic() + 12
        while time.monotonic() < end:  # the slow link: 256 bytes every 0.125 s
            if select.select([fd], [], [], 0.125)[0]:
                read += len(os.read(fd, 256))
            time.sleep(0.125)
        rss_end = rss_bytes(pid)
        os.write(fd, b"q")
        asked = time.monotonic()
        exited_after: float | None = None
        while time.monotonic() - asked < 30:  # drain fast now, as a terminal catching up would
            if select.select([fd], [], [], 0.05)[0]:
                with contextlib.suppress(OSError):
                    os.read(fd, 65536)
            done, _status = os.waitpid(pid, os.WNOHANG)
            if done:
                exited_after = time.monotonic() - asked
                break
        print(f"slow reader: dlmon RSS {rss_start / MiB:.1f} -> {rss_end / MiB:.1f} MiB over 12 s, "
              f"{read} bytes read, q answered after {exited_after}")  # fmt: skip
        assert exited_after is not None, "q was not answered"
        assert rss_end - rss_start < 16 * MiB, "frames queued up for the slow terminal"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
