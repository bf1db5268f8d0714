"""The screenshots in screenshots/ (and README.md's) show the dashboard as it is laid out now.

screenshots/regenerate.py stores the layout it made the set from (screenshots/layout.json: the
panels, the workers columns, the main screen's widget tree, the stylesheet, as the code defines
them); a change to any of them without a new set fails here.
"""

from __future__ import annotations

import glob
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT

SHOTS_DIR = ROOT / "screenshots"
sys.path.insert(0, str(SHOTS_DIR))

from layout import changed_parts, code_digest, current_layout, stored_layout  # noqa: E402

REGENERATE = "run screenshots/regenerate.py (about five minutes, unattended) and commit the new set"


def regenerate_shots() -> dict[str, str]:
    source = (SHOTS_DIR / "regenerate.py").read_text()
    block = source[source.index("SHOTS = {") : source.index("}", source.index("SHOTS = {"))]
    return dict(re.findall(r'"([^"]+\.svg)": "(\w+)"', block))


def test_the_screenshots_are_as_new_as_the_dashboards_layout() -> None:
    changed = changed_parts(stored_layout(), current_layout())
    assert not changed, (
        f"the screenshots show an older dashboard layout ({', '.join(changed)} changed): {REGENERATE}"
    )


def test_the_layout_fingerprint_sees_a_new_column() -> None:
    """The check is not vacuous: one more workers column is a different layout."""
    current = current_layout()
    moved = {**current, "workers_columns": [*current["workers_columns"], ["rank", "RANK"]]}
    assert changed_parts(current, moved) == ["workers_columns"]
    assert changed_parts(None, current) == sorted(current)


def test_the_layout_fingerprint_is_the_same_on_every_python() -> None:
    """CI may run another Python than the one that made layout.json: the digest of the main
    screen's code must not change with it (``ast.dump`` did, from 3.11 to 3.12 and 3.13)."""
    from dlmon.ui import app

    source = inspect.getsource(app.MainScreen.compose)
    candidates = [shutil.which(f"python3.{minor}") for minor in range(10, 15)]
    candidates += glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3"))
    ran = 0
    probe = (
        f"import sys; sys.path.insert(0, {str(SHOTS_DIR)!r}); from layout import code_digest; "
        "print(code_digest(sys.stdin.read()))"
    )
    for exe in sorted({c for c in candidates if c}):
        out = subprocess.run([exe, "-I", "-c", probe], input=source, capture_output=True, text=True)
        if out.returncode != 0:  # not runnable (a pyenv shim, too old for layout.py): not a digest
            continue
        ran += 1
        assert out.stdout.strip() == code_digest(source), f"{exe} digests the main screen apart"
    if ran < 2:  # this interpreter's own run plus at least one other
        pytest.skip("no other Python interpreter here")


def test_every_screenshot_is_there_and_referenced() -> None:
    shots = regenerate_shots()
    assert {"run-worker-killed-160x50.svg", "run-ddp-160x50.svg"} <= set(shots)  # a death, a DDP job
    listed = (SHOTS_DIR / "README.md").read_text()
    for name in shots:
        assert (SHOTS_DIR / name).is_file(), f"screenshots/{name} is missing: {REGENERATE}"
        assert f"`{name}`" in listed, f"screenshots/README.md does not describe {name}"
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\((screenshots/[^)]+)\)", readme):
        assert (ROOT / target).is_file(), f"README.md shows {target}, which does not exist"
        assert not target.endswith(".svg") or Path(target).name in shots, f"{target} is not regenerated"
