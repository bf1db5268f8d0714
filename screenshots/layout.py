"""The dashboard's layout as the code defines it, for telling whether the screenshots are older.

Not a timestamp and not the pixels: the panels (key, id, title, which sit at the top), the
workers table's columns (key, title), the main screen's widget tree (its ``compose``, read as a
syntax tree so comments and formatting do not count) and the stylesheet's rules (without
comments and blank space). ``regenerate.py`` writes it to ``layout.json`` beside the set it
made; tests/ui/test_screenshots.py fails when the code's layout is no longer the one stored.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import re
import textwrap
from pathlib import Path
from typing import Any

STORED = Path(__file__).resolve().parent / "layout.json"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def code_digest(source: str) -> str:
    """The code's digest without its comments and formatting, the same on every Python dlmon
    supports: ``ast.unparse``, not ``ast.dump``, whose output grows with each version's new node
    fields (3.12's ``type_params``, 3.13's omitted defaults) and would fail CI on another Python."""
    return _digest(ast.unparse(ast.parse(textwrap.dedent(source))))


def current_layout() -> dict[str, Any]:
    from dlmon.ui import app, views

    css_path = Path(app.__file__).with_name("dlmon.tcss")
    css = re.sub(r"/\*.*?\*/", "", css_path.read_text(), flags=re.S)
    return {
        "panels": [list(p) for p in app.PANELS],
        "top_panels": sorted(app.TOP_PANELS),
        "workers_columns": [[c.key, c.title] for c in views.COLUMNS],
        "main_screen": code_digest(inspect.getsource(app.MainScreen.compose)),
        "stylesheet": _digest(" ".join(css.split())),
    }


def stored_layout() -> dict[str, Any] | None:
    try:
        raw = json.loads(STORED.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def changed_parts(stored: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """The parts of the layout that differ (all of them when nothing is stored)."""
    if stored is None:
        return sorted(current)
    return sorted(k for k in set(current) | set(stored) if current.get(k) != stored.get(k))


def store(current: dict[str, Any]) -> None:
    STORED.write_text(json.dumps(current, indent=1) + "\n")
