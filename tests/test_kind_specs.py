"""Every alert kind has its whole spec in one registry line, and nothing about a kind is missing."""

from __future__ import annotations

import re
from pathlib import Path

from dlmon.analysis.detectors.registry import (
    CAUSE_ORDER,
    DEFAULT_HOLDS,
    DETECTORS,
    ENDINGS,
    SPEC_BY_KIND,
    SPECS,
)
from dlmon.analysis.kinds import KINDS

DOC = Path(__file__).resolve().parent.parent / "docs" / "detectors.md"


def test_every_kind_has_exactly_one_spec_in_the_order_of_kinds() -> None:
    assert tuple(s.name for s in SPECS) == KINDS
    assert len(SPEC_BY_KIND) == len(SPECS)


def test_every_spec_is_complete() -> None:
    for spec in SPECS:
        assert callable(spec.detector), spec.name
        assert spec.hold.raise_after_s >= 0 and spec.hold.clear_after_s >= 0, spec.name
        if spec.silences is not None:
            assert spec.silences.kind in KINDS and spec.silences.kind != spec.name
            assert callable(spec.silences.keys)
        if spec.resumption is not None:
            assert callable(spec.resumption.over)
            assert 0 <= spec.resumption.clear_after_s <= spec.hold.clear_after_s
        # what the exit keeps, or what says how the training ended, is something the verdict can name
        assert not (spec.last_words or spec.ending) or spec.cause is not None, spec.name
    assert DETECTORS.keys() == DEFAULT_HOLDS.keys()


def test_the_exit_verdicts_causes_have_distinct_ranks() -> None:
    ranks = sorted(s.cause for s in SPECS if s.cause is not None)
    assert ranks == list(range(ranks[0], ranks[0] + len(ranks))), ranks  # distinct, no gap
    # a signal's death first: the exception torch raises for a killed worker is its echo
    assert CAUSE_ORDER == (
        "trainer_died",
        "worker_died",
        "stall",
        "exception_death",
        "fd_exhaustion",
        "orphan_worker",
    )
    assert {"exception_death", "worker_died", "trainer_died"} == ENDINGS


def test_every_kind_has_a_section_in_the_detector_docs() -> None:
    headings = set(re.findall(r"^### (\w+)", DOC.read_text(), flags=re.MULTILINE))
    assert set(KINDS) - headings == set()


def test_the_documented_hold_table_is_the_registrys() -> None:
    """docs/detectors.md's table of holds, row by row, against DEFAULT_HOLDS (a kind added
    without its row, or a hold changed without the doc, fails here)."""
    rows = re.findall(r"^\| (\w+) \| (\d+(?:\.\d+)?) s\b[^|]*\| (\d+(?:\.\d+)?) s\b", DOC.read_text(), re.M)
    table = {kind: (float(up), float(down)) for kind, up, down in rows}
    held = {kind: (h.raise_after_s, h.clear_after_s) for kind, h in DEFAULT_HOLDS.items()}
    assert table == held
