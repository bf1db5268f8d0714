"""The training's last words: real trainings that die of an exception under ``dlmon run --headless
--record``, each of a family users hit, and one that catches an exception and finishes. The line
dlmon prints at exit, the record, the replay, the dashboard's final frame and the report name the
exception with dlmon's figures; the trainings' own tracebacks are torch's, as without dlmon.

Each job is tests/agent_scripts/last_words.py in one mode (a few seconds each). The CUDA one is a
stand-in (no GPU here): its Dataset raises torch's out-of-memory text, through the same path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlmon.agent import _journal
from dlmon.analysis.detectors.exceptions import family
from dlmon.collect.agent_decode import _journal_exception
from dlmon.model import Alert, Snapshot
from dlmon.model.serialize import snapshot_from_dict, snapshot_to_dict
from dlmon.model.snapshot import TrainingException
from integration.deaths.test_real_trainings import Run, _clean_up_runs, replay_alerts
from integration.deaths.test_real_trainings import start_run as start_deaths_run
from support.agent import ROOT, private_agent_env

SCRIPT = ROOT / "tests" / "agent_scripts" / "last_words.py"
DEADLINE_S = 120.0
KIND = "exception_death"

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is None, reason="needs torch")

_RUNS: list[Run] = []


@pytest.fixture
def agent_env() -> Iterator[dict[str, str]]:
    with private_agent_env("dlmon-lastwords-") as env:
        try:
            yield env
        finally:
            while _RUNS:
                run = _RUNS.pop()
                if run.proc.poll() is None:
                    run.proc.kill()
                    run.proc.wait(timeout=30)
            _clean_up_runs()


def start(
    env: dict[str, str],
    tmp_path: Path,
    cfg: dict[str, Any],
    prefix: list[str] | None = None,
    name: str = "run",
) -> Run:
    record = tmp_path / f"{name}.jsonl"
    inner = [sys.executable, str(SCRIPT), json.dumps(cfg)]
    cmd = [sys.executable, "-m", "dlmon", "run", "--headless", "--interval", "0.5", "--record", str(record)]
    cmd += ["--", *(prefix or []), *inner]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(tmp_path)
    )
    run = Run(proc, record)
    run.start_readers()
    _RUNS.append(run)
    return run


def script_line(text: str) -> int:
    """The line of last_words.py holding ``text`` (the user's frame the verdict must name)."""
    for n, line in enumerate(SCRIPT.read_text().splitlines(), 1):
        if text in line:
            return n
    raise AssertionError(text)


def death(run: Run) -> tuple[str, Alert, list[Snapshot]]:
    """(the verdict line, the final snapshot's one exception_death alert, the record)."""
    snaps = run.snapshots()
    assert snaps, "empty record"
    alerts = [a for a in snaps[-1].alerts if a.kind == KIND]
    assert len(alerts) == 1, (alerts, run.stderr())
    return run.verdict(), alerts[0], snaps


def final_frame(snaps: list[Snapshot]) -> str:
    """The dashboard's alerts panel on the last snapshot (what `dlmon run` shows at the end)."""
    from dlmon.ui.state import DashboardState
    from dlmon.ui.views import alert_lines, text_of

    state = DashboardState()
    for snap in snaps:
        state.ingest(snap)
    return " ".join(text_of(line) for line in alert_lines(state, 400, False))


def report(record: Path, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "dlmon", "report", "--no-charts", *args, str(record)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def check_everywhere(run: Run, verdict: str, alert: Alert, snaps: list[Snapshot], lead: str) -> None:
    """The cause reaches the exit line, the replay, the final frame and the report alike."""
    assert verdict.startswith(f"dlmon: training exited 1: {lead}"), verdict
    replayed = replay_alerts(run.record, KIND)
    assert [a.message for a in replayed] == [alert.message], replayed
    assert final_frame(snaps).startswith(f"training exited 1: {lead}"), final_frame(snaps)
    text = report(run.record)
    # the key column is as wide as the longest key, whichever rows the run has
    assert re.search(rf"\n  verdict +training exited 1: {re.escape(lead)}", text), text


# -- the families ----------------------------------------------------------------------------------


def test_dev_shm_exhausted_in_a_worker(agent_env: dict[str, str], tmp_path: Path) -> None:
    """A 24 MiB /dev/shm (a private mount namespace) and a loop that keeps its 2 MiB batches:
    a worker's collate cannot allocate shared memory, torch re-raises it in the trainer."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m not allowed: {probe.stderr.decode().strip()}")
    prefix = [
        "unshare",
        "-m",
        "sh",
        "-c",
        'mount --make-rprivate / && mount -t tmpfs -o size=24m tmpfs /dev/shm && exec "$@"',
        "sh",
    ]
    run = start(agent_env, tmp_path, {"mode": "shm"}, prefix=prefix)
    assert run.wait(DEADLINE_S) == 1
    verdict, alert, snaps = death(run)
    assert re.search(
        r"DataLoader worker \d \(loader last_words\.py:\d+\) raised RuntimeError: unable to allocate "
        r"shared memory\(shm\) for file </torch_[\d_]+>: No space left on device \(28\)",
        verdict,
    ), verdict
    assert re.search(r" — /dev/shm was \d+\.\d MiB of 24\.0 MiB", verdict), verdict
    # measured by the agent on the epoch's first batch (8 x 256 KiB), and the loader's settings
    assert (
        "each batch takes ≈ 2.0 MiB of it, and 2 workers x prefetch_factor 2 keep 4 in flight (8.0 MiB)"
        in verdict
    )
    assert alert.evidence["cause"] == "shm_exhausted"
    used = alert.evidence["shm_used_bytes"]
    assert isinstance(used, int) and used > 16 << 20, alert.evidence
    assert "--shm-size" in alert.advice
    [left] = [e for e in snaps[-1].exceptions if e.origin == "next"]
    assert left.worker_type == "RuntimeError" and left.batch_bytes == 2 << 20
    check_everywhere(run, verdict, alert, snaps, "DataLoader worker")
    text = report(run.record)
    assert re.search(
        r"worker \d +left the DataLoader, then uncaught +RuntimeError: unable to allocate", text
    ), text


def test_too_many_open_files_with_the_file_descriptor_strategy(
    agent_env: dict[str, str], tmp_path: Path
) -> None:
    """RLIMIT_NOFILE 128, every batch of 16 tensors kept: each received tensor holds a descriptor,
    and the trainer runs out of them. The agent's line is written all the same (its reserve fd)."""
    run = start(agent_env, tmp_path, {"mode": "fds", "nofile": 128})
    assert run.wait(DEADLINE_S) == 1
    verdict, alert, snaps = death(run)
    assert alert.evidence["cause"] == "too_many_open_files", verdict
    assert re.search(r"the trainer had \d+ files open of its limit of 128 \(RLIMIT_NOFILE\)", verdict), (
        verdict
    )
    assert "torch's sharing strategy is 'file_descriptor'" in verdict, verdict
    opened = alert.evidence["open_fds"]
    assert isinstance(opened, int) and 64 < opened <= 128, alert.evidence
    assert "ulimit -n" in alert.advice and "set_sharing_strategy('file_system')" in alert.advice
    check_everywhere(run, verdict, alert, snaps, "the trainer (pid")


def test_a_bug_in_the_dataset_names_the_users_frame(agent_env: dict[str, str], tmp_path: Path) -> None:
    run = start(agent_env, tmp_path, {"mode": "key_error", "at": 40})
    assert run.wait(DEADLINE_S) == 1
    verdict, alert, snaps = death(run)
    line = script_line('return item["label"]')
    assert re.search(
        rf"DataLoader worker 0 \(loader last_words\.py:\d+\) raised an exception at last_words\.py:{line} in "
        r"__getitem__: KeyError 'label'\.$",
        verdict,
    ), verdict
    assert alert.evidence["cause"] == "bug" and alert.evidence["worker_id"] == 0
    assert "num_workers=0" in alert.advice
    check_everywhere(run, verdict, alert, snaps, "DataLoader worker 0")
    md = report(run.record, "--md")
    assert "| verdict | training exited 1: DataLoader worker 0" in md, md
    assert "### Exceptions (1)" in md and "left the DataLoader, then uncaught" in md
    html = tmp_path / "report.html"
    report(run.record, "--html", str(html))
    page = html.read_text()
    assert "<h2>Exceptions (1)</h2>" in page and "KeyError" in page


def test_a_real_memory_error_in_a_worker_with_the_hosts_figures(
    agent_env: dict[str, str], tmp_path: Path
) -> None:
    """The workers run under an address-space limit (worker_init_fn): a 1 GiB bytearray fails."""
    run = start(agent_env, tmp_path, {"mode": "memory_error", "at": 40})
    assert run.wait(DEADLINE_S) == 1
    verdict, alert, snaps = death(run)
    line = script_line("bytearray(1 << 30)")
    assert (
        f"raised MemoryError at last_words.py:{line} in __getitem__ — the least headroom dlmon measured"
        in verdict
    )
    assert re.search(r"the machine's available memory \(\d+\.\d GiB left\)", verdict), verdict
    assert "ulimit -v" in verdict  # plenty was left: the process's limit, not the host
    assert alert.evidence["cause"] == "host_memory"
    check_everywhere(run, verdict, alert, snaps, "DataLoader worker 0")


def test_cuda_out_of_memory_stand_in_says_no_vram_was_measured(
    agent_env: dict[str, str], tmp_path: Path
) -> None:
    run = start(agent_env, tmp_path, {"mode": "cuda_oom", "at": 40})
    assert run.wait(DEADLINE_S) == 1
    verdict, alert, snaps = death(run)
    assert "raised RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB." in verdict, verdict
    assert re.search(r" — dlmon measured no VRAM figures \([^)]+\)\.$", verdict), verdict
    assert alert.evidence["cause"] == "cuda_oom"
    assert "batch size" in alert.advice and "expandable_segments" in alert.advice
    check_everywhere(run, verdict, alert, snaps, "DataLoader worker 0")


def test_cuda_in_a_forked_worker_is_named_with_its_fix(agent_env: dict[str, str], tmp_path: Path) -> None:
    """The Dataset calls .cuda() in a fork-started worker: torch's own _lazy_init raises its
    'Cannot re-initialize CUDA in forked subprocess' (the bad-fork flag set in worker_init_fn is
    the seam: no CUDA here)."""
    run = start(agent_env, tmp_path, {"mode": "cuda_fork", "at": 40})
    assert run.wait(DEADLINE_S) == 1
    verdict, alert, snaps = death(run)
    line = script_line('return item["x"].cuda()')
    assert (
        "raised RuntimeError: Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
        f"multiprocessing, you must use the 'spawn' start method at last_words.py:{line} in __getitem__ — "
        "CUDA was used in a DataLoader worker forked from a trainer that had already started CUDA"
    ) in verdict, verdict
    assert alert.evidence["cause"] == "cuda_in_forked_worker" and alert.evidence["worker_id"] is not None
    assert "move the batch to the GPU in the training loop" in alert.advice
    assert "multiprocessing_context='spawn'" in alert.advice
    check_everywhere(run, verdict, alert, snaps, "DataLoader worker")


def test_cuda_in_a_forked_pool_process_is_not_called_a_dataloader_worker(
    agent_env: dict[str, str], tmp_path: Path
) -> None:
    """The same torch error from a fork-started multiprocessing Pool (re-raised in the trainer,
    no DataLoader worker in it) is named for what it is, with the start-method fix that fits."""
    run = start(agent_env, tmp_path, {"mode": "pool_fork"})
    assert run.wait(DEADLINE_S) == 1
    verdict, alert, snaps = death(run)
    assert alert.evidence["cause"] == "cuda_in_forked_worker" and alert.evidence["worker_id"] is None
    assert "Cannot re-initialize CUDA in forked subprocess" in verdict, verdict
    assert "DataLoader worker" not in alert.message and "DataLoader" not in alert.advice, alert
    assert "a process forked from one that had already started CUDA" in alert.message, alert.message
    assert "get_context('spawn')" in alert.advice, alert.advice
    check_everywhere(run, verdict, alert, snaps, "the trainer")


def test_the_trainers_own_uncaught_exception(agent_env: dict[str, str], tmp_path: Path) -> None:
    run = start(agent_env, tmp_path, {"mode": "trainer_bug"})
    ready = run.event("ready")
    assert run.wait(DEADLINE_S) == 1
    verdict, alert, snaps = death(run)
    line = script_line('raise ValueError(f"loss is nan')
    assert verdict.endswith(
        f"the trainer (pid {ready['pid']}) raised an exception at last_words.py:{line} in main: "
        "ValueError: loss is nan at step 20."
    ), verdict
    assert alert.evidence["origin"] == "main"
    assert not [e for e in snaps[-1].exceptions if e.origin == "next"]  # it never left a DataLoader
    check_everywhere(run, verdict, alert, snaps, "the trainer")


def test_a_threads_uncaught_exception_before_the_training_exits_1(
    agent_env: dict[str, str], tmp_path: Path
) -> None:
    run = start(agent_env, tmp_path, {"mode": "thread_bug"})
    ready = run.event("ready")
    run.event("helper_gone")
    assert run.wait(DEADLINE_S) == 1
    verdict, alert, snaps = death(run)
    line = script_line('raise ValueError("the helper thread\'s bug")')
    assert (
        f"Thread 'prefetcher' of the trainer (pid {ready['pid']}) raised an exception at "
        f"last_words.py:{line} in helper_thread: ValueError: the helper thread's bug (uncaught: the "
        "thread ended, and the training exited 1"
    ) in verdict, verdict
    check_everywhere(run, verdict, alert, snaps, "Thread 'prefetcher'")
    assert "uncaught (its thread ended)" in report(run.record)


def test_an_exception_caught_by_the_loop_is_recorded_but_no_death(
    agent_env: dict[str, str], tmp_path: Path
) -> None:
    """The loop catches the KeyError that left the DataLoader, starts over and finishes: exit 0,
    no verdict, no exception_death anywhere; the report still lists the exception."""
    run = start(agent_env, tmp_path, {"mode": "caught", "at": 40, "steps": 30})
    run.event("caught")
    run.event("done")
    assert run.wait(DEADLINE_S) == 0
    assert not [line for line in run.err if line.startswith("dlmon: training")], run.stderr()
    snaps = run.snapshots()
    [left] = snaps[-1].exceptions
    assert left.origin == "next" and left.worker_type == "KeyError"
    assert not [a for s in snaps for a in s.alerts if a.kind == KIND]
    assert not replay_alerts(run.record, KIND)
    text = report(run.record)
    assert "verdict " not in text, text
    assert re.search(r"worker 0 +left the DataLoader +KeyError: 'label'", text), text


def test_an_exception_caught_then_a_new_loader_and_exit_1_is_no_death(
    agent_env: dict[str, str], tmp_path: Path
) -> None:
    """The loop catches the KeyError, goes on for seconds with a NEW DataLoader (the old one never
    delivers again) and then exits 3 of its own accord: the caught exception is not what it died of."""
    cfg = {"mode": "caught", "at": 40, "steps": 600, "new_loader": True, "exit": 3}
    run = start(agent_env, tmp_path, cfg)
    run.event("caught")
    run.event("done")
    assert run.wait(DEADLINE_S) == 3
    snaps = run.snapshots()
    assert [e.origin for e in snaps[-1].exceptions] == ["next"]
    assert not [a for s in snaps for a in s.alerts if a.kind == KIND]
    assert "raised" not in run.verdict(), run.verdict()


def test_a_killed_workers_echo_is_not_the_cause(agent_env: dict[str, str], tmp_path: Path) -> None:
    """kill -9 of a worker: torch raises "DataLoader worker (pid N) is killed by signal" in the
    trainer, which dies of it uncaught. The signal is the cause; the exception only its echo."""
    run = start_deaths_run(agent_env, tmp_path, {"mode": "wait"}, runs=_RUNS)
    victim = run.event("pids")["workers"][1]
    os.kill(victim, signal.SIGKILL)
    assert run.wait(DEADLINE_S) == 1
    verdict = run.verdict()
    assert re.match(
        rf"dlmon: training exited 1: DataLoader worker 1 \(pid {victim}\).* was killed by SIGKILL", verdict
    )
    assert "raised" not in verdict, verdict
    snaps = run.snapshots()
    assert any(e.message.startswith("DataLoader worker (pid") for e in snaps[-1].exceptions), snaps[
        -1
    ].exceptions
    assert not [a for a in snaps[-1].alerts if a.kind == KIND]


def test_the_trainings_traceback_is_torchs_as_without_dlmon(
    agent_env: dict[str, str], tmp_path: Path
) -> None:
    """The hooks chain to sys.excepthook: the same traceback lines, but for the frame of dlmon's
    own __next__ wrapper (there before the last words: it times the call)."""
    cfg = json.dumps({"mode": "key_error", "at": 40})
    plain_env = {k: v for k, v in agent_env.items() if k != "PYTHONPATH"}
    plain = subprocess.run(
        [sys.executable, str(SCRIPT), cfg],
        env=plain_env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    run = start(agent_env, tmp_path, {"mode": "key_error", "at": 40})
    assert run.wait(DEADLINE_S) == plain.returncode == 1

    def traceback_lines(text: str) -> list[str]:
        lines = text[text.index("Traceback (most recent call last):") :].splitlines()
        out, skipping = [], False
        for line in lines:
            if line.startswith(("dlmon: ", "    advice: ")):
                continue  # dlmon's own lines (an alert, its advice, the verdict), wherever they fall
            if line.startswith('  File "'):
                skipping = "/dlmon/agent/" in line
            if not skipping:
                out.append(line)
        return out

    ours = traceback_lines(run.stderr())
    theirs = traceback_lines(plain.stderr)
    assert ours == theirs, "\n".join(ours)
    assert [line for line in theirs if line.strip()][-1] == "KeyError: 'label'"
    assert "KeyError: Caught KeyError in DataLoader worker process 0." in theirs


# -- dlmon diff: "died of X" in the after-run is a regression ---------------------------------------


def test_diff_flags_a_death_the_before_run_did_not_have(agent_env: dict[str, str], tmp_path: Path) -> None:
    before = start(agent_env, tmp_path, {"mode": "caught", "at": 40, "steps": 30}, name="before")
    assert before.wait(DEADLINE_S) == 0
    after = start(agent_env, tmp_path, {"mode": "key_error", "at": 40}, name="after")
    assert after.wait(DEADLINE_S) == 1

    def diff(a: Path, b: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dlmon", "diff", str(a), str(b), "--fail-on", "alerts+0"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    worse = diff(before.record, after.record)
    assert worse.returncode == 1, worse.stdout + worse.stderr
    assert "B ended as A did not: training exited 1: DataLoader worker 0" in worse.stdout, worse.stdout
    assert "alerts new in B: exception_death:bug" in worse.stdout
    assert "verdict: FAIL" in worse.stdout
    same = diff(after.record, after.record)
    assert same.returncode == 0, same.stdout


# -- the parts, on their own --------------------------------------------------------------------------


def _exception(**kw: Any) -> TrainingException:
    base: dict[str, Any] = {
        "reported_by": 1,
        "origin": "main",
        "type": "RuntimeError",
        "message": "",
        "time": 1.0,
    }
    return TrainingException(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        (
            {
                "worker_type": "RuntimeError",
                "worker_message": "unable to write to file </torch_1_2_3>: No space left on device (28)",
            },
            "shm_exhausted",
        ),
        (
            {"message": "unable to allocate shared memory(shm) for file </torch_9>: No space left on device"},
            "shm_exhausted",
        ),
        (
            {"worker_type": "OSError", "worker_message": "[Errno 24] Too many open files: '/data/x.jpg'"},
            "too_many_open_files",
        ),
        (
            {"message": "Too many open files. Communication with the workers is no longer possible."},
            "too_many_open_files",
        ),
        (
            {"type": "torch.OutOfMemoryError", "message": "CUDA out of memory. Tried to allocate 20.00 MiB"},
            "cuda_oom",
        ),
        (
            {
                "worker_type": "RuntimeError",
                "worker_message": "Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
                "multiprocessing, you must use the 'spawn' start method",
                "file": "dataset.py",
                "line": 12,
            },
            "cuda_in_forked_worker",
        ),
        ({"worker_type": "MemoryError", "worker_message": ""}, "host_memory"),
        (
            {"message": "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"},
            "host_memory",
        ),
        ({"message": "DataLoader worker (pid 4242) is killed by signal: Killed. "}, "worker_died"),
        ({"message": "DataLoader worker (pid(s) 4242) exited unexpectedly"}, "worker_died"),
        (
            {
                "type": "OSError",
                "message": "bad header",
                "file": "train.py",
                "line": 9,
                "raised_there": False,
            },
            "exception",
        ),
        ({"type": "KeyError", "message": "'label'", "file": "dataset.py", "line": 88}, "bug"),
        ({"type": "OSError", "message": "No space left on device: '/data/out.ckpt'"}, "exception"),
    ],
)
def test_families(kw: dict[str, Any], expected: str) -> None:
    assert family(_exception(**kw)) == expected


def test_a_long_exception_is_cut_to_one_journal_line_not_dropped() -> None:
    rec = {
        "kind": "exception",
        "seq": 1,
        "origin": "next",
        "type": "RuntimeError",
        "message": "m" * 5000,
        "traceback": "t" * 9000 + "THE END",
        "worker_message": "w" * 3000,
    }
    line = _journal.fit_line(rec)
    assert len(line) <= _journal.MAX_LINE and line.endswith(b"\n")
    got = _journal_exception(7, line)
    assert got is not None
    assert got[1].traceback.endswith("THE END") and got[1].message.startswith("mmm")


def test_journal_lines_that_are_not_exceptions_or_are_garbled_are_skipped() -> None:
    assert _journal_exception(7, b'{"pid": 12, "signal": 9}') is None  # a worker death
    assert _journal_exception(7, b'{"kind":"exception","seq":"x","origin":"main","type":"E"}') is None
    assert _journal_exception(7, b'{"kind":"exception"') is None
    assert _journal_exception(7, b"[1, 2]") is None


def test_the_snapshot_field_reads_both_ways() -> None:
    from support.snapshots import proc, snap

    s = snap(0, [proc(100, "main")])
    data = snapshot_to_dict(s)
    assert data["exceptions"] == []
    del data["exceptions"]  # a record written before the field
    assert snapshot_from_dict(data).exceptions == ()
    e = _exception(worker_id=2, worker_type="KeyError", worker_message="'label'", file="dataset.py", line=88)
    import dataclasses

    again = snapshot_from_dict(
        json.loads(json.dumps(snapshot_to_dict(dataclasses.replace(s, exceptions=(e,)))))
    )
    assert again.exceptions == (e,)


def test_the_excepthook_calls_the_one_it_chains_to_even_if_recording_is_interrupted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KeyboardInterrupt (a second Ctrl-C) while the line is written must not cost the user the
    traceback: the previous hook is called all the same."""
    from dlmon.agent import _last_words

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_last_words, "_record", interrupted)
    called: list[object] = []
    hook = _last_words._make_excepthook(lambda *a: called.append(a))
    exc = ValueError("boom")
    hook(ValueError, exc, None)
    assert called == [(ValueError, exc, None)]


def test_a_frame_line_with_a_long_run_of_spaces_parses_in_one_pass() -> None:
    """The hook parses tracebacks inside the training: the old pattern's ``(.+?)\\s*$`` scanned
    the run of spaces again at each of its characters (1 s of the training's CPU at 20,000
    spaces, about 6 s at 50,000, growing with the square)."""
    from dlmon.agent._last_words import _parse_traceback

    name = "step" + " " * 50_000 + "<lambda>"
    text = f'Traceback (most recent call last):\n  File "/job/train.py", line 7, in {name}   \n'
    frames, last = _parse_traceback(text + "ValueError: bad batch\n")
    assert frames == [("/job/train.py", 7, name)] and last == "ValueError: bad batch"
