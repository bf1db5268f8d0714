"""The screenshot key of the dashboard and of the cluster screen: an SVG of what the app shows."""

from __future__ import annotations

import os
import time
from typing import Any

from textual.app import App


def save_svg(app: App[Any], prefix: str, now: float) -> str | None:
    """``<prefix>-<local time of now>.svg`` in screenshots/ (when the current directory has one) or
    here, numbered ``-2``, ``-3`` ... rather than over one saved in the same second; said on the
    screen. None when it could not be written."""
    directory = "screenshots" if os.path.isdir("screenshots") else "."
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    name = f"{prefix}-{stamp}.svg"
    n = 1
    while os.path.exists(os.path.join(directory, name)):
        n += 1
        name = f"{prefix}-{stamp}-{n}.svg"
    try:
        path = app.save_screenshot(name, directory)
    except OSError as exc:
        app.notify(f"could not save the screenshot: {exc}", severity="error")
        return None
    app.notify(f"screenshot saved: {path}")
    return path
