"""The screenshots in screenshots/ (and README.md's) show the dashboard as it is laid out now.

screenshots/regenerate.py stores the layout it made the set from (screenshots/layout.json: the
panels, the workers columns, the main screen's widget tree, the stylesheet, as the code defines
them); a change to any of them without a new set fails here.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHOTS_DIR = ROOT / "screenshots"
sys.path.insert(0, str(SHOTS_DIR))

from layout import changed_parts, current_layout, stored_layout  # noqa: E402

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
