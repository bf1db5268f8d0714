"""The command line against bad input and odd environments, as a table.

Each row: (name, arguments, expected exit status, a substring of the first stderr line). Every
row runs the real ``dlmon`` in a subprocess with no terminal (stdin /dev/null, pipes), the way
nohup, cron and CI run it; the ``{placeholders}`` are real things made by the fixtures below (a
live process, a zombie, a thread id, files). Rows marked ``check`` also look at what was left
behind (an existing file untouched, a record whole). Cheap enough for CI: ~1 s per row.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support.paths import ROOT

EXISTING = '{"type": "end", "time": 1, "reason": "an older record of the user"}\n'
NOT_A_RECORD = "the user's notes: not a dlmon record\n"
DROP_PTRACE = [  # run dlmon as nobody, still able to load Python from /root, without ptrace rights
    "setpriv",
    "--reuid=65534",
    "--regid=65534",
    "--clear-groups",
    "--inh-caps=+dac_read_search,+dac_override",
    "--ambient-caps=+dac_read_search,+dac_override",
]


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    exit: int
    first_line: str
    env: dict[str, str] = field(default_factory=dict)
    stdout_to: str | None = None  # a path for stdout (e.g. /dev/full) instead of a pipe
    prefix: tuple[str, ...] = ()
    check: Callable[[dict[str, str], subprocess.CompletedProcess[str]], None] | None = None
    timeout: float = 60


def existing_untouched(places: dict[str, str], _: subprocess.CompletedProcess[str]) -> None:
    assert Path(places["existing"]).read_text() == EXISTING, "dlmon clobbered a file on an error path"


def not_a_record_untouched(places: dict[str, str], _: subprocess.CompletedProcess[str]) -> None:
    assert Path(places["notrecord"]).read_text() == NOT_A_RECORD, "dlmon replaced a file that is no record"


def link_target_untouched(places: dict[str, str], _: subprocess.CompletedProcess[str]) -> None:
    assert Path(places["linktarget"]).read_text() == NOT_A_RECORD, "dlmon wrote through a symlink"


def no_traceback(_: dict[str, str], result: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in result.stderr


def names_the_leftover(_: dict[str, str], result: subprocess.CompletedProcess[str]) -> None:
    line = next(x for x in result.stderr.splitlines() if "left running" in x)
    assert "sleep 600" in line and "kill " in line


def stderr_lists_bad_lines(_: dict[str, str], result: subprocess.CompletedProcess[str]) -> None:
    skipped = [x for x in result.stderr.splitlines() if "skipping line" in x]
    assert [x.split("skipping line ")[1].split()[0] for x in skipped] == ["2", "3", "4", "5", "6"]
    assert "more lines" in result.stderr  # 7 bad lines: 5 named, the rest counted


def impossible_values_skipped(_: dict[str, str], result: subprocess.CompletedProcess[str]) -> None:
    skipped = [x for x in result.stderr.splitlines() if "skipping line" in x]
    assert [x.split("skipping line ")[1].split()[0] for x in skipped] == ["2", "3", "4", "5", "6"]
    # the Run section's duration line (the recorded command line above it may say "--durations")
    duration = next(x for x in result.stdout.splitlines() if x.split()[:1] == ["duration"])
    assert "(2 snapshots)" in result.stdout and "PiB" not in result.stdout and "-" not in duration, duration


DAEMON = (  # a double fork into a new session: out of the training's tree, group and session at once
    "import os\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        fd = os.open(os.devnull, os.O_RDWR)\n"
    "        [os.dup2(fd, n) for n in (0, 1, 2)]\n"
    "        os.execvp('sleep', ['sleep', '600'])\n"
    "    os._exit(0)\n"
    "os.wait()\n"
)


CASES = [
    # -- existing bad-input cases ---------------------------------------------------------------
    Case("attach-not-a-pid", ("attach", "abc"), 2, "is not a process id"),
    Case("attach-zero", ("attach", "0"), 2, "is not a process id"),
    Case("attach-no-such-process", ("attach", "{gone}", "--once"), 2, "no such process"),
    Case("attach-bad-interval", ("attach", "{pid}", "--interval", "x"), 2, "must be a number of seconds"),
    Case("record-missing-o", ("record", "{pid}"), 2, "Missing option"),
    Case("record-into-a-directory", ("record", "{pid}", "-o", "{tmp}"), 2, "cannot write"),
    Case("run-no-such-script", ("run", "{tmp}/nope.py"), 2, "no such script"),
    Case("replay-missing-file", ("replay", "{tmp}/nope.jsonl"), 2, "cannot read"),
    Case("replay-empty-file", ("replay", "{empty}"), 2, "holds no snapshots"),
    Case("unknown-command", ("frobnicate",), 2, "No such command"),
    Case("demo-bad-interval", ("demo", "--interval", "x"), 2, "must be a number of seconds"),
    Case("diff-missing-file", ("diff", "{tmp}/nope.jsonl", "{good}"), 2, "cannot read"),
    Case("tune-bad-workers", ("tune", "--workers", "x", "--", "true"), 2, "is not a whole number"),
    # -- the interval floor ---------------------------------------------------------------------
    Case("attach-interval-1e-9", ("attach", "{pid}", "--interval", "1e-9"), 2, "at least 0.1 seconds"),
    Case(
        "record-interval-tiny",
        ("record", "{pid}", "-o", "{tmp}/r.jsonl", "--interval", "0.01"),
        2,
        "at least 0.1",
    ),
    Case("run-interval-tiny", ("run", "--interval", "1e-9", "--", "true"), 2, "at least 0.1 seconds"),
    Case(  # a wait of 1e300 s overflows the clock: it was a traceback
        "record-interval-huge",
        ("record", "{pid}", "-o", "{tmp}/r.jsonl", "--interval", "1e300", "--duration", "2"),
        2,
        "at most 86400 seconds",
        timeout=20,
    ),
    # -- messages that mislead ------------------------------------------------------------------
    Case("replay-negative-speed", ("replay", "{good}", "--speed", "-1"), 2, "a factor of 0 or more"),
    Case("attach-a-thread-id", ("attach", "{tid}", "--once"), 2, "is a thread of process"),
    Case("advise-a-zombie", ("advise", "{zombie}", "--seconds", "1"), 2, "has exited"),
    Case(
        "advise-as-another-user",
        ("advise", "{pid}", "--seconds", "1"),
        2,
        "permission denied",
        prefix=tuple(DROP_PTRACE),
    ),
    # -- issue 23: --inject on record, advise, export ------------------------------------------------
    Case(  # the load cannot be done: one line, and the recording goes on without the agent
        "record-inject-not-python",
        ("record", "{pid}", "-o", "{tmp}/i.jsonl", "--inject", "--duration", "1"),
        0,
        "look like CPython",
    ),
    Case("advise-inject-no-such-process", ("advise", "{gone}", "--inject"), 2, "no such process"),
    Case(
        "export-inject-no-such-process",
        ("export", "{gone}", "--inject", "--prometheus", "0"),
        2,
        "no such process",
    ),
    Case(
        "export-inject-all-jobs",
        ("export", "--all-jobs", "--inject", "--prometheus", "0"),
        2,
        "cannot be combined with --all-jobs",
    ),
    # -- output to a full disk ------------------------------------------------------------------
    Case(
        "attach-once-json-to-dev-full",
        ("attach", "--once", "--json", "{pid}"),
        1,
        "No space left on device",
        stdout_to="/dev/full",
        check=no_traceback,
    ),
    Case(
        "advise-to-dev-full", ("advise", "{pid}", "--seconds", "1"), 1, "No space left", stdout_to="/dev/full"
    ),
    Case(
        "record-to-dev-full",
        ("record", "{pid}", "-o", "/dev/full"),
        1,
        "recording stopped: cannot write /dev/full",
    ),
    Case(
        "run-headless-record-to-dev-full",
        ("run", "--headless", "--record", "/dev/full", "--", sys.executable, "-c", "import sys; sys.exit(3)"),
        3,  # the training's own exit status: dlmon never abandons it, never says "cannot start"
        "recording stopped: cannot write /dev/full",
    ),
    # -- never clobber a user's file ------------------------------------------------------------
    Case(
        "run-nonexistent-command-keeps-record",
        ("run", "--record", "{existing}", "--", "/nonexistent"),
        2,
        "cannot start /nonexistent",
        check=existing_untouched,
    ),
    Case(
        "attach-no-such-process-keeps-record",
        ("attach", "{gone}", "--record", "{existing}"),
        2,
        "no such process",
        check=existing_untouched,
    ),
    Case(
        "attach-in-a-terminal-no-such-process-keeps-record",
        ("attach", "{gone}", "--record", "{existing}"),
        2,
        "no such process",
        prefix=("script", "-qec"),
        check=existing_untouched,
    ),
    Case(
        "record-replacing-says-so",
        ("record", "{pid}", "-o", "{existing}", "--duration", "0.5", "--interval", "0.5"),
        0,
        "replacing the existing record",
    ),
    Case(  # issue 26 item 5: impossible values were printed as fact, an earlier line gave -1:59:54
        "report-impossible-values-skipped",
        ("report", "{impossible}"),
        0,
        "skipping line 2",
        check=impossible_values_skipped,
    ),
    # -- issue 26 item 6 and 11: values that were taken for something ---------------------------
    Case("run-prometheus-empty", ("run", "--headless", "--prometheus", "", "--", "true"), 2, "PORT must be"),
    Case("export-prometheus-empty", ("export", "{pid}", "--prometheus", ""), 2, "PORT must be a number"),
    Case("attach-interval-inf", ("attach", "{pid}", "--interval", "inf"), 2, "a finite number of seconds"),
    Case("attach-interval-nan", ("attach", "{pid}", "--interval", "nan"), 2, "a finite number of seconds"),
    Case("attach-arabic-indic-pid", ("attach", "{pid_arabic}", "--once"), 2, "is not a process id"),
    Case(  # issue 26 item 7: it blocked in open() and ignored --duration
        "record-to-a-fifo-without-reader-honours-duration",
        ("record", "{pid}", "-o", "{fifo}", "--duration", "1", "--interval", "0.5"),
        0,
        "is a FIFO nobody reads yet",
        timeout=20,
    ),
    # -- issue 26 item 10: -o followed a symlink and replaced any file -----------------------------
    Case(
        "record-over-a-file-that-is-no-record",
        ("record", "{pid}", "-o", "{notrecord}", "--duration", "0.5"),
        2,
        "is not a dlmon record: not replaced (--force replaces it)",
        check=not_a_record_untouched,
    ),
    Case(
        "run-record-over-a-file-that-is-no-record",
        ("run", "--headless", "--record", "{notrecord}", "--", "true"),
        2,
        "is not a dlmon record",
        check=not_a_record_untouched,
    ),
    Case(
        "attach-record-over-a-file-that-is-no-record",
        ("attach", "{pid}", "--record", "{notrecord}"),
        2,
        "is not a dlmon record",
        check=not_a_record_untouched,
    ),
    Case(
        "record-through-a-symlink",
        ("record", "{pid}", "-o", "{symlink}", "--duration", "0.5"),
        2,
        "is a symlink (to",
        check=link_target_untouched,
    ),
    Case(
        "record-through-a-symlink-in-a-world-writable-dir-even-forced",
        ("record", "{pid}", "-o", "{wwsymlink}", "--duration", "0.5", "--force"),
        2,
        "in a world-writable directory: never followed",
        check=link_target_untouched,
    ),
    Case(
        "record-over-a-file-that-is-no-record-forced",
        ("record", "{pid}", "-o", "{forced}", "--duration", "0.5", "--interval", "0.5", "--force"),
        0,
        "replacing the existing record",
    ),
    # -- terminals ------------------------------------------------------------------------------
    Case(
        "run-without-a-terminal-goes-headless", ("run", "--", "true"), 0, "not a terminal: running headless"
    ),
    Case("replay-without-a-terminal", ("replay", "{good}"), 2, "needs a terminal"),
    Case(
        "replay-bad-lines-listed", ("replay", "{mixed}"), 2, "skipping line 2", check=stderr_lists_bad_lines
    ),
    Case(
        "run-term-dumb-goes-headless",
        ("run", "--", "true"),
        0,
        "TERM=dumb cannot show a dashboard: running headless",
        env={"TERM": "dumb"},
        prefix=("script", "-qec"),
    ),
    Case(
        "run-agent-dir-foreign-says-why",
        ("run", "--headless", "--", sys.executable, "-c", "import time; time.sleep(1.5)"),
        0,
        "agent unreachable: its socket directory",
        env={"XDG_RUNTIME_DIR": "{foreignxdg}"},
    ),
    # -- the training log directory -------------------------------------------------------------
    Case(
        "run-tmpdir-log-dir-is-a-file",
        ("run", "--", "true"),
        2,
        "cannot use the training log directory",
        env={"TMPDIR": "{badtmp}"},
        prefix=("script", "-qec"),
    ),
    Case(
        "run-tmpdir-log-dir-foreign",
        ("run", "--", "true"),
        2,
        "refusing the training log directory",
        env={"TMPDIR": "{foreigntmp}"},
        prefix=("script", "-qec"),
    ),
    # -- a child that outlives the training -----------------------------------------------------
    Case(
        "run-headless-names-leftovers",
        ("run", "--headless", "--", "sh", "-c", "sleep 600 </dev/null >/dev/null 2>&1 & exit 0"),
        0,
        "left running after the training ended",
        check=names_the_leftover,
    ),
    Case(  # issue 26 item 4: a daemon that left the session was not named
        "run-headless-names-a-daemon-that-left-the-session",
        ("run", "--headless", "--", sys.executable, "-c", DAEMON),
        0,
        "left running after the training ended",
        check=names_the_leftover,
    ),
    # dlmon cluster (issue 25)
    Case("cluster-no-nodes", ("cluster", "--once"), 2, "name the nodes", env={"SLURM_JOB_NODELIST": ""}),
    Case(
        "cluster-nodes-and-prometheus",
        ("cluster", "a:1", "--prometheus", "http://x", "--once"),
        2,
        "not both",
    ),
    Case(
        "cluster-job-without-prometheus",
        ("cluster", "a:1", "--job", "x", "--once"),
        2,
        "give --prometheus URL",
    ),
    Case(
        "cluster-bad-slurm-nodelist",
        ("cluster", "--once"),
        2,
        "SLURM_JOB_NODELIST: node list 'node[3-1]'",
        env={"SLURM_JOB_NODELIST": "node[3-1]"},
    ),
    Case("cluster-hosts-file-missing", ("cluster", "--hosts-file", "{tmp}/none", "--once"), 2, "cannot read"),
    Case("cluster-hosts-file-a-fifo-dir", ("cluster", "--hosts-file", "{tmp}", "--once"), 2, "cannot read"),
    Case("cluster-bad-timeout", ("cluster", "a:1", "--timeout", "nan", "--once"), 2, "--timeout must be"),
    Case("cluster-bad-port", ("cluster", "a", "--port", "0", "--once"), 2, "--port"),
    # found in review: a socket timeout past time_t, a range that overflows (tracebacks)
    Case(
        "cluster-huge-timeout",
        ("cluster", "a:1", "--timeout", "1e308", "--once"),
        2,
        "--timeout must be at most",
    ),
    Case(
        "cluster-huge-window",
        ("cluster", "a:1", "--window", "1e308", "--once"),
        2,
        "--window must be at most",
    ),
    Case("cluster-screen-without-a-terminal", ("cluster", "127.0.0.1:1"), 2, "not a terminal"),
    Case(
        "cluster-prometheus-unreachable",
        ("cluster", "--prometheus", "http://127.0.0.1:1", "--once"),
        2,
        "cannot reach Prometheus at http://127.0.0.1:1",
    ),
    Case("cluster-prometheus-not-a-url", ("cluster", "--prometheus", "::::", "--once"), 2, "Prometheus"),
    Case(
        "cluster-to-dev-full",
        ("cluster", "127.0.0.1:1", "--once", "--json", "--window", "0"),
        1,
        "No space left",
        stdout_to="/dev/full",
    ),
]


def _zombie() -> tuple[subprocess.Popen[str], int]:
    code = (
        "import os, time\npid = os.fork()\nif pid == 0: os._exit(0)\nprint(pid, flush=True)\ntime.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


def _record_lines() -> tuple[str, str]:
    """A good record line (a real snapshot of this process) and its end line."""
    sys.path.insert(0, str(ROOT))
    from dlmon.collect.sampler import Sampler
    from dlmon.flow.recording import encode_snapshot

    sampler = Sampler(os.getpid())
    sampler.sample()
    line = encode_snapshot(sampler.sample()).decode()
    sampler.close()
    return line, '{"type":"end","time":1,"reason":"interrupted"}\n'


BAD_VALUES = [
    ("time", "abc"),
    ("interval_s", "x"),
    ("host", 123),
    ("rss_bytes", "big"),
    ("rss_bytes", "1e400"),
    ("state", 7),
    ("pss_sum_bytes", "lots"),
]


def bad_line(good: str, key: str, value: object) -> str:
    """``good`` with one value replaced, as raw JSON text (1e400 must stay a bare number)."""
    record = json.loads(good)
    if key in ("rss_bytes", "state"):
        record["processes"][0][key] = "__BAD__"
    elif key == "pss_sum_bytes":
        record["memory"][key] = "__BAD__"
    else:
        record[key] = "__BAD__"
    raw = value if value == "1e400" else json.dumps(value)
    return json.dumps(record).replace('"__BAD__"', str(raw)) + "\n"


def impossible_lines(good: str) -> list[str]:
    """A good line, four with values no measurement has, one two hours early, one good later."""

    def changed(where: Callable[[dict[str, Any]], dict[str, Any]], key: str, value: object) -> str:
        record = json.loads(good)
        where(record)[key] = value
        return json.dumps(record) + "\n"

    first_process: Callable[[dict[str, Any]], dict[str, Any]] = lambda r: r["processes"][0]  # noqa: E731
    start = float(json.loads(good)["time"])
    return [
        good,
        changed(first_process, "rss_bytes", -1_000_000_000),
        changed(lambda r: r["memory"], "rss_sum_bytes", 10**30),
        changed(first_process, "cpu_percent", -50.0),
        changed(first_process, "read_bytes_per_s", 1e300),
        changed(lambda r: r, "time", start - 7194),
        changed(lambda r: r, "time", start + 1),
    ]


@pytest.fixture(scope="module")
def places() -> Iterator[dict[str, str]]:
    tmp = tempfile.mkdtemp(prefix="dlmon-adv-")
    sleeper = subprocess.Popen(["sleep", "600"])
    zombie_parent, zombie = _zombie()
    stop_thread = threading.Event()
    thread = threading.Thread(target=stop_thread.wait, daemon=True)
    thread.start()
    good, end = _record_lines()
    Path(tmp, "good.jsonl").write_text(good + end)
    Path(tmp, "empty.jsonl").write_text("")
    mixed = [good] + [bad_line(good, k, v) for k, v in BAD_VALUES] + [good, end]
    Path(tmp, "mixed.jsonl").write_text("".join(mixed))
    os.mkfifo(Path(tmp, "fifo"))
    Path(tmp, "notrecord.txt").write_text(NOT_A_RECORD)
    Path(tmp, "forced.txt").write_text(NOT_A_RECORD)
    Path(tmp, "linktarget.txt").write_text(NOT_A_RECORD)
    Path(tmp, "link.jsonl").symlink_to(Path(tmp, "linktarget.txt"))
    world = Path(tmp, "world")
    world.mkdir()
    world.chmod(0o1777)
    Path(world, "link.jsonl").symlink_to(Path(tmp, "linktarget.txt"))
    Path(tmp, "impossible.jsonl").write_text("".join(impossible_lines(good)) + end)
    badtmp = Path(tmp, "badtmp")
    badtmp.mkdir()
    Path(badtmp, f"dlmon-{os.getuid()}").write_text("a file where the log directory goes")
    foreign = Path(tmp, "foreigntmp")
    foreign.mkdir()
    foreign_dir = Path(foreign, f"dlmon-{os.getuid()}")
    foreign_dir.mkdir()
    os.chown(foreign_dir, 65534, 65534)
    foreign_dir.chmod(0o777)
    foreign_xdg = Path(tmp, "xdg")
    foreign_xdg.mkdir()
    Path(foreign_xdg, "dlmon").mkdir()
    os.chown(Path(foreign_xdg, "dlmon"), 65534, 65534)
    Path(foreign_xdg, "dlmon").chmod(0o777)
    gone = 4_000_000
    while os.path.exists(f"/proc/{gone}"):
        gone += 1
    yield {
        "tmp": tmp,
        "pid": str(sleeper.pid),
        "pid_arabic": str(sleeper.pid).translate({ord("0") + i: 0x660 + i for i in range(10)}),
        "zombie": str(zombie),
        "tid": str(thread.native_id),
        "gone": str(gone),
        "good": f"{tmp}/good.jsonl",
        "empty": f"{tmp}/empty.jsonl",
        "mixed": f"{tmp}/mixed.jsonl",
        "impossible": f"{tmp}/impossible.jsonl",
        "fifo": f"{tmp}/fifo",
        "notrecord": f"{tmp}/notrecord.txt",
        "forced": f"{tmp}/forced.txt",
        "linktarget": f"{tmp}/linktarget.txt",
        "symlink": f"{tmp}/link.jsonl",
        "wwsymlink": f"{tmp}/world/link.jsonl",
        "existing": f"{tmp}/existing.jsonl",
        "badtmp": str(badtmp),
        "foreigntmp": str(foreign),
        "foreignxdg": str(foreign_xdg),
    }
    stop_thread.set()
    for proc in (sleeper, zombie_parent):
        proc.kill()
        proc.wait()


def _kill_named_leftovers(stderr: str) -> None:
    """Kill what a row left running on purpose: the pids dlmon named ("stop them with: kill ...")."""
    for line in stderr.splitlines():
        if "stop them with: kill " in line:
            for pid in line.split("stop them with: kill ", 1)[1].split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gives_one_line_and_the_right_exit(case: Case, places: dict[str, str]) -> None:
    Path(places["existing"]).write_text(EXISTING)
    args = [a.format(**places) for a in case.args]
    command = [sys.executable, "-m", "dlmon", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **{k: v.format(**places) for k, v in case.env.items()}}
    if case.prefix[:1] == ("script",):  # a real pseudo-terminal: the dashboard path, not the fallback
        command = [*case.prefix, " ".join(command), "/dev/null"]
    else:
        command = [*case.prefix, *command]
    stdout = open(case.stdout_to, "w") if case.stdout_to else subprocess.PIPE  # noqa: SIM115
    try:
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.PIPE if case.prefix[:1] != ("script",) else subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=case.timeout,
        )
    finally:
        if case.stdout_to:
            stdout.close()  # type: ignore[union-attr]
    err = result.stderr if result.stderr is not None else (result.stdout or "")
    _kill_named_leftovers(err)
    lines = [x for x in err.replace("\r", "").splitlines() if x.strip()]
    assert result.returncode == case.exit, err
    assert lines and case.first_line in lines[0], err
    assert "Traceback" not in err
    if case.check is not None:
        case.check(places, result)


def test_the_table_covers_every_command() -> None:
    """Every command of the CLI, a new one included, has at least one bad-input row."""
    from dlmon.cli import main

    covered = {c.args[0] for c in CASES}
    assert sorted(set(main.commands) - covered) == []
