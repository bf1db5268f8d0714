"""Second-reader regressions for issue 23 (the agent loaded into a running job): each one failed
before its fix. Training-like code runs in child processes with a private XDG_RUNTIME_DIR."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent_support import private_agent_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, str]]:
    """The children import this tree's dlmon, and start no agent of their own."""
    with private_agent_env("dlmon-inject-review-") as e:
        e = dict(e)
        e["PYTHONPATH"] = str(ROOT)
        yield e


def run_script(code: str, env: dict[str, str], tmp_path: Path) -> Any:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(code))
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_batch_taken_while_the_load_thread_patches_still_gets_the_sigchld_observer(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The load thread patched ``__next__`` first and found torch's SIGCHLD handler (and so set
    the deferral) last: a batch of the running iterator in between attached its state without the
    deferral, no later batch of it passes through ``_late_attach`` again, and the observer never
    went in for the job's whole life. The batch is placed in that window here by holding the load
    thread right after ``__next__`` is patched."""
    pytest.importorskip("torch")
    code = """
        import json, signal, threading
        from torch.utils.data import DataLoader
        dl = DataLoader(list(range(4000)), batch_size=2, num_workers=2, persistent_workers=True)
        it = iter(dl)
        next(it)  # torch's SIGCHLD handler is in: a job running before any agent
        import dlmon.agent
        from dlmon.agent import _hooks
        patched, resume = threading.Event(), threading.Event()
        real_ok = _hooks._ok
        def ok(hook):
            real_ok(hook)
            if hook == "iter_next" and threading.current_thread() is not threading.main_thread():
                patched.set()  # __next__ is patched; hold the load thread here
                resume.wait(30)
        _hooks._ok = ok
        load = threading.Thread(target=dlmon.agent.start_injected)
        load.start()
        assert patched.wait(30)
        next(it)  # the training's batch, in the middle of the load
        resume.set()
        load.join(30)
        for _ in range(3):
            next(it)
        handler = signal.getsignal(signal.SIGCHLD)
        print(json.dumps({
            "observer": bool(getattr(handler, "__dlmon_observer__", False)),
            "degraded": dlmon.agent.counters()["degraded"].get("sigchld"),
        }))
    """
    got = run_script(code, env, tmp_path)
    assert got == {"observer": True, "degraded": None}, got


def test_an_iterator_built_in_a_thread_does_not_unsay_an_observer_already_in(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A DataLoader iterated in a thread of its own (a prefetcher) after the observer went in from
    the main thread: the observer is still there, so the agent must not say it is not installed
    and deaths are only polled (it said so, for the rest of the job)."""
    pytest.importorskip("torch")
    code = """
        import json, signal, threading
        import dlmon.agent
        dlmon.agent.start()
        from torch.utils.data import DataLoader
        list(DataLoader(list(range(8)), batch_size=2, num_workers=1))  # the observer goes in here
        t = threading.Thread(target=lambda: list(DataLoader(list(range(8)), batch_size=2, num_workers=1)))
        t.start()
        t.join(60)
        handler = signal.getsignal(signal.SIGCHLD)
        print(json.dumps({
            "observer": bool(getattr(handler, "__dlmon_observer__", False)),
            "degraded": dlmon.agent.counters()["degraded"].get("sigchld"),
        }))
    """
    got = run_script(code, env, tmp_path)
    assert got == {"observer": True, "degraded": None}, got
