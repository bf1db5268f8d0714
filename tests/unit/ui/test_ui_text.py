"""The one text-fitting module of the dashboard: every line within its width, whole parts kept."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dlmon.ui.text import (
    BAR,
    SEP,
    Span,
    clip,
    collapse,
    fit,
    fit_with_more,
    flow,
    text_of,
    truncate,
    width_of,
    wrap,
)

PARTS: list[list[Span]] = [
    [("PSS ", "dim"), ("1.2G", "b")],
    [("RSS ", "dim"), ("3.4G", "b")],
    [("swap 0B", "")],
]

words = st.text(alphabet="abcdef xyz", min_size=0, max_size=12)
part = st.lists(st.tuples(words, st.sampled_from(["", "dim", "b"])), min_size=1, max_size=3)


def test_clip_cuts_a_string_with_an_ellipsis() -> None:
    assert clip("abcdef", 10) == "abcdef"
    assert clip("abcdef", 4) == "abc…"
    assert clip("abcdef", 0) == ""


def test_truncate_cuts_spans_and_keeps_their_styles() -> None:
    line = truncate([("abc", "b"), ("defgh", "dim")], 6)
    assert text_of(line) == "abcde…" and line[0] == ("abc", "b") and line[-1] == ("…", "dim")
    assert truncate([("ab", "b")], 5) == (("ab", "b"),)


def test_fit_keeps_whole_parts_and_leaves_the_rest_out() -> None:
    assert text_of(fit(PARTS, 80)) == "PSS 1.2G · RSS 3.4G · swap 0B"
    assert text_of(fit(PARTS, 20)) == "PSS 1.2G · RSS 3.4G"  # "swap 0B" does not fit: left out whole
    assert text_of(fit(PARTS, 20, BAR, lead=[("MEM ", "label")])) == "MEM PSS 1.2G"
    assert text_of(fit(PARTS, 5)) == "PSS …"  # a first part too long is cut
    assert fit([], 10, lead=[("MEM", "label")]) == (("MEM", "label"),)


def test_flow_puts_the_parts_left_over_on_the_next_lines() -> None:
    lines = flow(PARTS, 21, SEP, lead=[("  ", "")])
    assert [text_of(line) for line in lines] == ["  PSS 1.2G · RSS 3.4G", "  swap 0B"]
    lines = flow(PARTS, 20, SEP, lead=[("  ", "")])
    assert [text_of(line) for line in lines] == ["  PSS 1.2G", "  RSS 3.4G · swap 0B"]
    assert [text_of(line) for line in flow(PARTS, 20, max_lines=1)] == ["PSS 1.2G · RSS 3.4G"]


def test_fit_with_more_counts_what_it_left_out() -> None:
    gpus = [[(f"GPU{i} 12.0G", "")] for i in range(6)]
    line = text_of(fit_with_more(gpus, 40, SEP, [], "GPUs"))
    assert line.startswith("GPU0 12.0G") and line.endswith("more GPUs") and len(line) <= 40


def test_collapse_sums_up_the_rows_it_drops() -> None:
    lines = tuple(((f"disk{i}", ""),) for i in range(5))
    out = collapse(lines, 3, [[(f"disk{i}", "")] for i in range(5)], 80)
    assert [text_of(x) for x in out] == ["disk0", "disk1", "+3 more: disk2 · disk3 · disk4"]
    assert collapse(lines, None, [], 80) == lines


def test_wrap_breaks_running_text_at_spaces() -> None:
    assert [text_of(x) for x in wrap("one two three four", 9, "dim")] == ["one two", "three", "four"]
    assert wrap("", 20) == ((("", ""),),)


@given(st.lists(part, max_size=6), st.integers(min_value=1, max_value=60))
def test_every_line_fits_its_width_and_fit_is_the_first_line_of_flow(
    parts: list[list[Span]], width: int
) -> None:
    lines = flow(parts, width)
    assert all(width_of(line) <= width for line in lines)
    first = fit(parts, width)
    assert width_of(first) <= width
    if lines:
        assert first == lines[0]
