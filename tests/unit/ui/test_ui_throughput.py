"""The Throughput panel says why DataLoader figures are missing: a rank's agent of another
version (above the other ranks' loaders), a training that has exited (not the hint to start it
under ``dlmon run``, which it was), a job that never had an agent."""

from __future__ import annotations

import dataclasses

from dlmon.ui.state import DashboardState
from dlmon.ui.views import AGENT_HINT, text_of, throughput_lines
from support.ui import make_snapshot


def _screen(state: DashboardState, compact: bool = False) -> str:
    return "\n".join(text_of(x) for x in throughput_lines(state, 160, compact))


def test_the_note_of_a_ranks_agent_shows_above_the_other_ranks_loaders() -> None:
    """Rank 0 answers, rank 1's agent speaks another version: rank 0's loaders are on the panel
    and the note saying why rank 1's are missing is above them, not only on stderr."""
    import dataclasses

    from dlmon.ui.state import DashboardState
    from dlmon.ui.views import text_of, throughput_lines
    from support.ui import make_snapshot

    snap = dataclasses.replace(make_snapshot(), agent_note="agent of pid 43 speaks wire protocol version 2")
    assert snap.loaders
    state = DashboardState()
    state.ingest(snap)
    lines = [text_of(x) for x in throughput_lines(state, 160, False)]
    assert "speaks wire protocol version 2" in lines[0] and len(lines) >= 2, lines


def test_the_final_frame_of_a_run_says_the_training_exited_not_how_to_start_it() -> None:
    """``dlmon run`` of a job whose worker was killed: the last frame has no loaders (the
    trainer is gone); it once said "Start the job with `dlmon run`"."""
    state = DashboardState()
    live = make_snapshot()
    state.ingest(live)
    ended = dataclasses.replace(
        live,
        time=live.time + 3.0,
        loaders=(),
        target=dataclasses.replace(live.target, alive=False, exit_code=1),
    )
    state.ingest(ended)
    for compact in (False, True):
        screen = _screen(state, compact)
        assert "the training has exited (last figures 3s ago)" in screen, screen
        assert "dlmon run" not in screen, screen


def test_a_job_that_never_had_an_agent_gets_the_hint() -> None:
    state = DashboardState()
    state.ingest(dataclasses.replace(make_snapshot(), loaders=()))
    assert AGENT_HINT.split("`")[0].strip() in _screen(state)


def test_an_agent_loaded_into_the_running_job_says_from_when_it_counts() -> None:
    """``attach --inject``: the counts begin at the load, not at the job's start; the panel says so
    (local time), and a job whose agent started with it says nothing of the kind."""
    import time

    loaded = 1_796_000_000.0
    state = DashboardState()
    state.ingest(dataclasses.replace(make_snapshot(), agent_loaded_unix_time=loaded))
    clock = time.strftime("%H:%M:%S", time.localtime(loaded))
    assert f"agent loaded at {clock}; counts from then" in _screen(state)
    assert f"since {clock}" in _screen(state, compact=True)
    plain = DashboardState()
    plain.ingest(make_snapshot())
    assert "agent loaded" not in _screen(plain) and "since" not in _screen(plain, compact=True)


def test_the_offer_to_load_the_agent_takes_the_hints_place_while_the_job_runs() -> None:
    state = DashboardState()
    state.agent_offer = "no agent in this job: press i to load the agent into pid 42 (gdb; ~60 ms pause)"
    live = dataclasses.replace(make_snapshot(), loaders=())
    state.ingest(live)
    for compact in (False, True):
        screen = _screen(state, compact)
        assert "press i to load the agent into pid 42" in screen and "dlmon run" not in screen, screen
    ended = dataclasses.replace(live, target=dataclasses.replace(live.target, alive=False, exit_code=0))
    state.ingest(ended)
    assert "press i" not in _screen(state) and "press i" not in _screen(state, compact=True)
