"""Why the in-process agent is unreachable, on the snapshot (and once on stderr, headless).

A job started with the agent whose socket directory is another user's is silently without
DataLoader figures otherwise: the dashboard would tell the user to start it with ``dlmon run``,
which they did.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from dlmon.collect.agent_client import agent_unreachable_reason
from dlmon.model import Snapshot

CHECK_EVERY_S = 10.0  # a few /proc reads and lstat()s: cheap, but not every tick


class AgentNote:
    """Adds ``agent_note`` to snapshots without agent data when a socket directory is unsafe."""

    def __init__(
        self,
        report: Callable[[str], None] | None = None,
        *,
        check: Callable[[int], str | None] = agent_unreachable_reason,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._report = report
        self._check = check
        self._clock = clock
        self._next = float("-inf")
        self._said: str | None = None
        self.note: str | None = None

    def __call__(self, snapshot: Snapshot) -> Snapshot:
        if snapshot.agent_note:  # the sampler's own (an agent that stopped answering): said once
            if snapshot.agent_note != self._said and self._report is not None:
                self._said = snapshot.agent_note
                self._report(snapshot.agent_note)
            return snapshot
        if snapshot.loaders or snapshot.pinned is not None or not snapshot.target.alive:
            self.note = None
            return snapshot
        now = self._clock()
        if now >= self._next:
            self._next = now + CHECK_EVERY_S
            self.note = self._check(snapshot.target.pid)
            if self.note and self.note != self._said and self._report is not None:
                self._said = self.note
                self._report(self.note)
        return dataclasses.replace(snapshot, agent_note=self.note) if self.note else snapshot
