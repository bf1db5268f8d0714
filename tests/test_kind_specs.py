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
    assert set(DETECTORS) == set(DEFAULT_HOLDS) == set(KINDS)


def test_the_exit_verdicts_causes_have_distinct_ranks() -> None:
    ranks = [s.cause for s in SPECS if s.cause is not None]
    assert len(ranks) == len(set(ranks))
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
