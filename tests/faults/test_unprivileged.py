"""dlmon as an unprivileged user (nobody) against root's job: every figure that needs privilege says
why it is missing, in the snapshot JSON and on the screen; nothing crashes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from conftest import Spawn

from .support import ROOT, tree_of_sleepers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"),
]

SCREEN = """
import asyncio, sys
from dlmon.flow.sources import LiveSource
from dlmon.ui import create_app
from dlmon.ui.widgets import LinesView, WorkerTable

async def main():
    app = create_app(LiveSource(int(sys.argv[1]), interval=0.3))
    async with app.run_test(size=(160, 50)) as pilot:
        for _ in range(100):
            await pilot.pause(0.2)
            if f"pid {sys.argv[1]}" in app.main_screen.query_one("#header", LinesView).text:
                break
        await pilot.pause(1.5)
        s = app.main_screen
        print("\\n".join([v.text for v in s.query(LinesView)] + [t.text for t in s.query(WorkerTable)]))
        await pilot.press("q")

asyncio.run(main())
"""


def as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
    """Run this Python as uid/gid 65534. /root is 0700 here and this Python lives under it: a private
    mount namespace puts an open /root over it with only the interpreter bound back in."""
    prefix = sys.prefix
    if not prefix.startswith("/root/"):
        command = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=_env())
    hold = tempfile.mkdtemp(prefix="dlmon-nobody-")
    inner = (
        f"mount --make-rprivate / && mount --bind {prefix} {hold} && mount -t tmpfs -o mode=0755 tmpfs /root "
        f"&& mkdir -p {prefix} && mount --bind {hold} {prefix} && exec setpriv --reuid 65534 --regid 65534 "
        f'--clear-groups "$@"'
    )
    command = ["unshare", "-m", "sh", "-c", inner, "sh", sys.executable, *args]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=_env())
    finally:
        os.rmdir(hold)


def _env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), "HOME": "/tmp", "TZ": "UTC"}


def test_nobody_watching_roots_job_sees_why_figures_are_missing(spawn: Spawn) -> None:
    tree = spawn(tree_of_sleepers(2))
    got = as_nobody("-m", "dlmon", "attach", str(tree.pid), "--once", "--json")
    assert got.returncode == 0, got.stderr
    assert "Traceback" not in got.stderr
    snapshot = json.loads(got.stdout)
    assert len(snapshot["processes"]) == 3
    for p in snapshot["processes"]:
        assert p["pss_bytes"] is None and p["read_bytes"] is None and p["num_fds"] is None
        assert p["unavailable"] == {
            "io": "permission denied",
            "fd": "permission denied",
            "smaps": "permission denied",
        }
        assert p["rss_bytes"]  # what needs no privilege is still there

    screen = as_nobody("-c", textwrap.dedent(SCREEN), str(tree.pid))
    assert screen.returncode == 0, screen.stderr[-2000:]
    assert "Traceback" not in screen.stderr
    text = screen.stdout
    assert f"pid {tree.pid}" in text
    assert "permission" in text or "denied" in text or "root" in text, text
