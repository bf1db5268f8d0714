"""The workers table's columns are one list (dlmon/ui/columns.py): the table, the sorting, the
key bindings and the help derive from it, so a column cannot lack a cell, a sort key cannot lack
a way to sort and a key cannot sort two ways."""

from __future__ import annotations

import dataclasses

import pytest
from textual.binding import Binding, BindingType

from dlmon.ui.app import DlmonApp, MainScreen
from dlmon.ui.columns import COLUMNS, SORT_ORDER, SORTS, Column
from dlmon.ui.screens import HELP_TEXT
from dlmon.ui.state import DashboardState
from dlmon.ui.views import STYLES, table_cells, table_columns
from dlmon.ui.widgets import WorkerTable
from support.ui import T0, make_snapshot


def _state_with_a_gone_row() -> DashboardState:
    state = DashboardState()
    snap = make_snapshot()
    state.ingest(snap)
    # a live worker goes (the zombie, last, stays a zombie row)
    state.ingest(dataclasses.replace(snap, time=T0 + 1, processes=snap.processes[:-2] + snap.processes[-1:]))
    assert any(r.gone for r in state.rows.values())
    assert any(r.process.state == "Z" and not r.gone for r in state.rows.values())
    return state


def _keys(bindings: list[BindingType]) -> list[str]:
    out: list[str] = []
    for b in bindings:
        key = b.key if isinstance(b, Binding) else b[0]
        out.extend(k.strip() for k in key.split(","))
    return out


def test_a_column_cannot_be_declared_without_its_cell() -> None:
    with pytest.raises(TypeError):
        Column("rank", "RANK", 4, True, 1)  # type: ignore[call-arg]


def test_every_column_renders_every_kind_of_row() -> None:
    """Live, zombie and gone rows: each column says something (a dash when nothing was read)."""
    state = _state_with_a_gone_row()
    for row in state.rows.values():
        for c in COLUMNS:
            cell = c.cell(row, 1.0)
            text, style = (cell, "") if isinstance(cell, str) else cell
            assert text.strip(), f"column {c.key} renders nothing for {row.label}"
            assert style in ("", *STYLES), (c.key, style)
        line = table_cells(row, COLUMNS, 1.0)
        assert len(line) == 2 * len(COLUMNS) - 1  # a span per cell, a space between
        assert sum(len(text) for text, _ in line) == sum(c.width for c in COLUMNS) + len(COLUMNS) - 1


def test_every_sort_key_sorts_every_row_both_ways() -> None:
    state = _state_with_a_gone_row()
    assert SORT_ORDER == ("id", "cpu", "pss", "rss", "uss", "read", "gpu")
    for key in SORT_ORDER:
        for reverse in (False, True):
            rows = state.sorted_rows(key, reverse)
            assert sorted(r.key for r in rows) == sorted(state.rows), (key, reverse)


def test_a_second_column_of_the_same_key_or_an_unlisted_sort_fails_at_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dlmon.ui import columns

    monkeypatch.setattr(columns, "COLUMNS", (*COLUMNS, COLUMNS[3]))
    with pytest.raises(ValueError, match="share a key"):
        columns._sorts()
    extra = dataclasses.replace(COLUMNS[8], key="pss2")  # a sortable column left out of SORT_CYCLE
    monkeypatch.setattr(columns, "COLUMNS", (*COLUMNS, extra))
    with pytest.raises(ValueError, match="SORT_CYCLE"):
        columns._sorts()


def test_the_sort_keys_bindings_and_help_are_what_they_were() -> None:
    """Derived from the columns now, written by hand before: the same, to the character."""
    line = (
        "  sort: [b]n[/b] worker id [b]c[/b] CPU [b]m[/b] PSS [b]r[/b] RSS [b]u[/b] USS [b]d[/b] read "
        "[b]g[/b] GPU"
    )
    assert line in HELP_TEXT.splitlines()
    sorting = [
        (b.key, b.action, b.description)
        for b in MainScreen.BINDINGS
        if isinstance(b, Binding) and b.action.startswith("sort(")
    ]
    assert sorting == [
        ("n", "sort('id')", "Sort by id"),
        ("c", "sort('cpu')", "Sort by CPU"),
        ("m", "sort('pss')", "Sort by PSS"),
        ("r", "sort('rss')", "Sort by RSS"),
        ("u", "sort('uss')", "Sort by USS"),
        ("d", "sort('read')", "Sort by read"),
        ("g", "sort('gpu')", "Sort by GPU memory"),
    ]


def test_sorts_have_their_own_key() -> None:
    sorting = [b for b in MainScreen.BINDINGS if isinstance(b, Binding) and b.action.startswith("sort(")]
    others = [
        *_keys([b for b in MainScreen.BINDINGS if b not in sorting]),
        *_keys(DlmonApp.BINDINGS),
        *_keys(WorkerTable.BINDINGS),
    ]
    bound = [s.binding for s in SORTS.values()]
    assert len(set(bound)) == len(bound) and not set(bound) & set(others)


def test_every_sort_is_bound_and_in_the_help() -> None:
    actions = {b.key: b.action for b in MainScreen.BINDINGS if isinstance(b, Binding)}
    for key, sort in SORTS.items():
        assert actions[sort.binding] == f"sort('{key}')"
        assert f"[b]{sort.binding}[/b] {sort.help}" in HELP_TEXT


def test_columns_shown_only_with_their_figures() -> None:
    keys = {c.key for c in table_columns(500, batches=False, gpu=False)}
    assert {c.key for c in COLUMNS if c.needs is None} == keys
    assert {"batch", "last", "gpu"} <= {c.key for c in table_columns(500, batches=True, gpu=True)}
