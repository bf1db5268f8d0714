"""A real terminal for the tests: a tmux server of its own (``-L``), its screen read back as text."""

from __future__ import annotations

import os
import re
import subprocess
import time


class Tmux:
    def __init__(self, name: str) -> None:
        self.socket = f"dlmon-test-{os.getpid()}-{name}"

    def __call__(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=10)
        return out.stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "t")

    def wait_for(self, predicate: str | re.Pattern[str], timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            found = predicate in screen if isinstance(predicate, str) else predicate.search(screen)
            if found:
                return screen
            time.sleep(0.1)
        raise AssertionError(f"never saw {predicate!r} on the screen:\n{screen}")
