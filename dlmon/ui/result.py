"""How a dashboard session ended (no UI imports: the CLI reads it after the terminal is restored)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DashboardResult:
    quit_by_user: bool  # False when the app ended some other way (an error, a signal)
    target_exited: bool  # the watched process had exited when the dashboard closed
    exit_code: int | None  # the target's exit code, when dlmon started it and it exited
    stop_training: bool  # `dlmon run`: the user asked, on quitting, to stop the training too
    end_reason: str | None = None  # why the source stopped delivering (recording END_*), if it did
    screenshots: tuple[str, ...] = ()  # SVG files saved during the session
