"""dlmon's own failures never stop the watch, never lose or expose a file, never mislead.

Real processes, a real tmpfs that fills up, real pid namespaces; the one seam is a sampler whose
``sample`` raises on chosen ticks (dlmon's own failure cannot be summoned on demand otherwise).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dlmon.collect.sampler import Sampler
from dlmon.flow.loop import Faults, Pipeline, sample_until_done
from dlmon.flow.recording import RecordWriter
from dlmon.flow.records import RecordProblem, iter_records, parse_line
from dlmon.flow.sources import ReplaySource
from dlmon.launch.runner import LogDirError, launch, log_dir
from dlmon.model import Snapshot
from dlmon.model.serialize import snapshot_to_dict
from support.paths import ROOT
from support.ui import BOOT, MAIN_PID, T0, FakeSource, fixed_clock, make_snapshot


class FailingSampler(Sampler):
    """A real sampler whose ``sample`` raises OSError on the given tick numbers."""

    def __init__(self, pid: int, fail_on: set[int]) -> None:
        super().__init__(pid)
        self.fail_on = fail_on
        self.ticks = 0

    def sample(self) -> Snapshot:
        self.ticks += 1
        if self.ticks in self.fail_on:
            raise OSError(5, "Input/output error", f"/proc/{self.pid}/smaps_rollup")
        return super().sample()


def test_a_failing_tick_is_counted_reported_once_and_sampling_goes_on(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        said: list[str] = []
        faults = Faults(said.append)
        seen: list[Snapshot] = []
        sampler = FailingSampler(sleeper.pid, {2, 3, 5})
        pipeline = Pipeline(None, RecordWriter(str(tmp_path / "r.jsonl")), (seen.append,), faults)
        reason = sample_until_done(sampler, 0.1, pipeline, threading.Event(), duration=0.75)
        pipeline.finish(reason)
        sampler.close()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert reason == "duration"
    assert sampler.ticks >= 7 and len(seen) == sampler.ticks - 3  # every other tick delivered
    assert faults.failed_samples == 3
    assert len(said) == 1 and "a sample failed: Input/output error" in said[0]
    assert faults.summary() is not None and "3 samples failed" in faults.summary()  # type: ignore[operator]
    end = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[-1])
    assert end["type"] == "end" and end["failed_samples"] == 3 and "Input/output" in end["first_failure"]


def test_a_failing_tick_in_the_dashboard_source_keeps_the_sampler_thread_alive() -> None:
    from dlmon.flow.sources import LiveSource

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        source = LiveSource(sleeper.pid, 0.1, sampler=FailingSampler(sleeper.pid, {1, 2}))
        got: list[Snapshot] = []
        source.start(got.append, lambda reason: None)
        deadline = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        source.stop()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert len(got) >= 3 and source.faults.failed_samples == 2


# -- record files on a full disk: a real tmpfs that fills up -----------------------------------

FILL_SCRIPT = """
set -e
mount -t tmpfs -o size=48k dlmon-test "$DIR"
set +e
"$PY" -m dlmon record "$TARGET" -o "$DIR/r.jsonl" --interval 0.1 --duration 60 2>"$DIR/../err.txt"
echo "rc=$?" > "$DIR/../rc.txt"
cp "$DIR/r.jsonl" "$DIR/../r.jsonl"
"""


def test_a_tmpfs_filling_mid_record_leaves_whole_lines_and_one_line_of_error(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        env = {**os.environ, "DIR": str(mnt), "PY": sys.executable, "TARGET": str(sleeper.pid)}
        env["PYTHONPATH"] = str(ROOT)
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", FILL_SCRIPT], env=env, cwd=ROOT, timeout=120, capture_output=True
        )
    finally:
        sleeper.kill()
        sleeper.wait()
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "rc.txt").read_text().strip() == "rc=1"
    err = (tmp_path / "err.txt").read_text().splitlines()
    assert len(err) == 1 and "recording stopped: cannot write" in err[0] and "No space left" in err[0]
    data = (tmp_path / "r.jsonl").read_bytes()
    assert data and data.endswith(b"\n"), "a torn last line"
    lines = data.decode().splitlines()
    assert len(lines) >= 2
    for line in lines:
        assert json.loads(line)["type"] == "snapshot"


def test_records_are_fsynced_at_a_bounded_cadence_and_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    now = [0.0]
    writer = RecordWriter(str(tmp_path / "r.jsonl"), clock=lambda: now[0])
    snapshot = make_snapshot()
    for second in range(31):  # one line a second for 30 s
        now[0] = float(second)
        writer.write(snapshot)
    assert len(synced) == 3  # at 10, 20, 30 s
    writer.close()
    assert len(synced) == 4  # and at the end


# -- the open-files limit ----------------------------------------------------------------------


def test_dlmon_raises_its_open_files_limit_but_the_training_keeps_its_own() -> None:
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))

    script = "import resource as r, time; print(r.getrlimit(r.RLIMIT_NOFILE)[0], flush=True); time.sleep(3)"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlmon", "run", "--headless", "--", sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=low_limit,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    child_soft = proc.stdout.readline().strip()
    limits = Path(f"/proc/{proc.pid}/limits").read_text()
    proc.wait(timeout=60)
    dlmon_soft = next(line.split()[3] for line in limits.splitlines() if line.startswith("Max open files"))
    assert dlmon_soft == "4096"
    assert child_soft == "256"


# -- the training log directory ----------------------------------------------------------------


def test_the_log_directory_is_private_and_logs_are_0600(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    os.umask(0o022)
    training = launch(["true"], to_log=True)
    training.popen.wait()
    assert training.log_path is not None
    assert stat.S_IMODE(os.stat(training.log_path).st_mode) == 0o600
    for d in (Path(training.log_path).parent, Path(training.log_path).parent.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.stat().st_uid == os.getuid()


@pytest.mark.parametrize("mode", [0o755, 0o777, 0o770])
def test_a_log_directory_others_can_enter_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    base = tmp_path / f"dlmon-{os.getuid()}"
    base.mkdir()
    base.chmod(mode)
    with pytest.raises(LogDirError, match="refusing the training log directory"):
        log_dir()


def test_a_symlinked_log_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / f"dlmon-{os.getuid()}").symlink_to(target)
    with pytest.raises(LogDirError, match="not a directory"):
        log_dir()


# -- replay survives any file: types validated at the reader -----------------------------------

GOOD = snapshot_to_dict(make_snapshot())


def _with(path: tuple[str | int, ...], value: object) -> bytes:
    record = json.loads(json.dumps(GOOD))
    node = record
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = "__BAD__"
    raw = "1e400" if value == "1e400" else json.dumps(value)
    return json.dumps(record).replace('"__BAD__"', raw).encode()


BAD = [
    (("time",), "abc"),
    (("interval_s",), "x"),
    (("host",), 123),
    (("processes", 0, "rss_bytes"), "big"),
    (("processes", 0, "rss_bytes"), "1e400"),
    (("processes", 0, "rss_bytes"), True),
    (("processes", 0, "state"), 7),
    (("memory", "pss_sum_bytes"), "lots"),
    (("target", "alive"), 1),
    (("processes",), {"not": "a list"}),
    (("time",), None),
    (("memory", "pressure_note"), None),  # an unknown key: ignored, so this one is fine
]


@pytest.mark.parametrize(
    ("path", "value"), BAD[:-1], ids=[".".join(map(str, p)) + f"={v!r}" for p, v in BAD[:-1]]
)
def test_a_value_of_the_wrong_type_is_a_record_problem(path: tuple[str | int, ...], value: object) -> None:
    got = parse_line(7, _with(path, value))
    assert isinstance(got, RecordProblem), got
    assert got.line == 7 and str(path[-1]) in got.reason


def test_good_values_still_load_exactly() -> None:
    snapshot = make_snapshot(gpus=2)
    line = json.dumps(snapshot_to_dict(snapshot)).encode()
    assert parse_line(1, line) == snapshot
    assert not isinstance(parse_line(1, _with(*BAD[-1])), RecordProblem)


def test_replay_of_a_file_with_bad_lines_mid_file_shows_the_good_snapshots(tmp_path: Path) -> None:
    from dlmon.ui import create_app
    from dlmon.ui.app import MIN_RENDER_GAP_S
    from dlmon.ui.widgets import LinesView

    good = [make_snapshot(T0 + i) for i in range(3)]
    lines = [json.dumps(snapshot_to_dict(good[0])).encode()]
    lines += [_with(p, v) for p, v in BAD[:-1]]
    lines += [json.dumps(snapshot_to_dict(s)).encode() for s in good[1:]]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")

    problems = [item for item in iter_records(str(path)) if isinstance(item, RecordProblem)]
    assert [p.line for p in problems] == list(range(2, 2 + len(BAD) - 1))

    source = ReplaySource(str(path), speed=None)
    assert source.record.snapshots == good
    app = create_app(source, clock=fixed_clock, boot_time=BOOT)

    async def main() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            deadline = time.monotonic() + 30
            while app.state.latest != good[-1] and time.monotonic() < deadline:
                await pilot.pause(0.05)
            await pilot.pause(MIN_RENDER_GAP_S + 0.05)
            header = app.main_screen.query_one("#header", LinesView).text
            assert f"pid {MAIN_PID}" in header or str(MAIN_PID) in header
            await pilot.press("q")

    asyncio.run(main())
    assert app.state.latest == good[-1]


# -- the quit prompt while a child of the training is listed -----------------------------------


def test_quitting_asks_to_stop_while_a_child_outlives_the_training() -> None:
    from dlmon.ui import create_app
    from dlmon.ui.screens import QuitScreen

    exited = make_snapshot(T0 + 1, alive=False, exit_code=0)  # the trainer is gone, its workers are not
    source = FakeSource([make_snapshot(), exited])
    app = create_app(source, clock=fixed_clock, boot_time=BOOT, ask_stop_on_quit=True)

    async def main() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            source.end("target_exited")
            await pilot.pause(0.2)
            await pilot.press("q")
            assert isinstance(app.screen, QuitScreen)
            await pilot.press("x")

    asyncio.run(main())
    assert app.return_value is not None and app.return_value.stop_training


def test_stop_also_stops_what_the_training_left_in_its_group() -> None:
    training = launch(["sh", "-c", "sleep 600 </dev/null >/dev/null 2>&1 & echo $!"], to_log=False)
    training.popen.wait()
    from dlmon.launch.session import group_members

    left = group_members(training.pid)
    assert [cmd for _, cmd in left] == ["sleep 600"]
    training.stop(grace_s=5)
    assert group_members(training.pid) == []


# -- disk rates timed at their own read --------------------------------------------------------


class SlowOnOddTicks:
    """A GPU collector (the seam) that takes 0.3 s on odd ticks, like a slow NVML or agent poll."""

    def __init__(self) -> None:
        self.calls = 0
        self.pace_s = 0.0  # what GpuCollector reports: how long answering took, for the sweep's pacing

    def sample(self) -> tuple[object, tuple[()]]:
        from dlmon.model.snapshot import GpuStatus

        self.calls += 1
        if self.calls % 2:
            time.sleep(0.3)
        return GpuStatus(available=False, reason="test"), ()

    def close(self) -> None:
        pass


def test_disk_busy_percent_is_steady_when_other_reads_take_varying_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A disk exactly 50% busy (io_ticks advancing 500 ms per second) must read ~50% every tick,
    not 62%/37% alternating because the time was taken at the start of a tick of varying length."""
    from dlmon.collect import disks

    def half_busy(path: str) -> str | None:
        if not path.endswith("diskstats"):
            return None
        io_ms = int(time.monotonic() * 500)
        return f"   8       0 sda 100 0 800 10 100 0 800 10 0 {io_ms} {io_ms}\n"

    monkeypatch.setattr(disks, "read_text", half_busy)
    monkeypatch.setattr(disks.DiskStatsReader, "_whole_disk", lambda self, name: True)
    sampler = Sampler(os.getpid(), gpu=SlowOnOddTicks())  # type: ignore[arg-type]
    utils = []
    for _ in range(6):
        snapshot = sampler.sample()
        time.sleep(0.2)
        if snapshot.disks and snapshot.disks[0].util_percent is not None:
            utils.append(snapshot.disks[0].util_percent)
    sampler.close()
    assert len(utils) == 5
    assert all(abs(u - 50.0) < 5.0 for u in utils), utils


# -- NVML pids inside a container's pid namespace ----------------------------------------------

NS_SCRIPT = """
import sys
sys.path[:0] = [{root!r}, {tests!r}]
from support.fake_pynvml import FakeNVML, two_devices
from dlmon.collect.gpu import GpuCollector
status, devices = GpuCollector(FakeNVML(two_devices())).sample()
print(sum(len(d.processes) for d in devices), status.process_memory_note)
"""


def test_inside_a_pid_namespace_nvml_pids_are_not_given_to_local_processes() -> None:
    code = NS_SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests"))
    host = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    inside = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert host.returncode == 0 and inside.returncode == 0, host.stderr + inside.stderr
    host_count, host_note = host.stdout.split(" ", 1)
    inside_count, inside_note = inside.stdout.split(" ", 1)
    assert int(host_count) > 0 and host_note.strip() == "None"
    assert int(inside_count) == 0 and "container's pid namespace" in inside_note


def test_the_dashboard_shows_failed_samples_and_a_stopped_record() -> None:
    from dlmon.ui import create_app

    source = FakeSource([make_snapshot()])
    source.faults = Faults()  # type: ignore[attr-defined]  # what LiveSource carries
    app = create_app(source, clock=fixed_clock, boot_time=BOOT)

    async def main() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot.pause()
            source.faults.sample_failed(OSError(5, "Input/output error"))  # type: ignore[attr-defined]
            source.faults.record_failed("r.jsonl", OSError(28, "No space left on device"))  # type: ignore[attr-defined]
            deadline = time.monotonic() + 30
            while len(list(app._notifications)) < 2 and time.monotonic() < deadline:
                await pilot.pause(0.1)
            await pilot.press("q")

    asyncio.run(main())
    texts = [n.message for n in app._notifications]
    assert any("1 sample(s) failed" in t and "Input/output error" in t for t in texts), texts
    assert any("recording stopped: cannot write r.jsonl: No space left" in t for t in texts), texts


# -- numbers JSON allows but a float cannot hold -------------------------------------------------

HUGE = "1" + "0" * 400  # valid JSON (under Python's 4300-digit limit), too large for a float


def test_a_400_digit_number_is_a_record_problem_not_a_crash(tmp_path: Path) -> None:
    good = json.dumps(snapshot_to_dict(make_snapshot()))
    bad_time = json.loads(good)
    bad_time["time"] = "__HUGE__"
    bad_cpu = json.loads(good)
    bad_cpu["processes"][0]["cpu_percent"] = "__HUGE__"
    end = '{"type":"end","time":__HUGE__,"reason":"interrupted"}'
    lines = [good, json.dumps(bad_time), json.dumps(bad_cpu), good, end]
    path = tmp_path / "huge.jsonl"
    path.write_text("\n".join(lines).replace('"__HUGE__"', HUGE).replace("__HUGE__", HUGE) + "\n")

    records = list(iter_records(str(path)))
    assert [type(r).__name__ for r in records] == [
        "Snapshot",
        "RecordProblem",
        "RecordProblem",
        "Snapshot",
        "RecordEnd",
    ]
    assert "time" in records[1].reason and "cpu_percent" in records[2].reason  # type: ignore[union-attr]
    assert records[4].time is None  # type: ignore[union-attr]
    replay = subprocess.run(
        [sys.executable, "-m", "dlmon", "replay", str(path)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert "Traceback" not in replay.stderr, replay.stderr
    assert "skipping line 2" in replay.stderr and "skipping line 3" in replay.stderr


# -- the dashboard is drawn on stderr: a terminal with stderr redirected is no terminal for it ----


def test_replay_in_a_terminal_with_stderr_redirected_says_so_instead_of_drawing_into_the_file(
    tmp_path: Path,
) -> None:
    import shutil

    if shutil.which("tmux") is None:
        pytest.skip("needs tmux")
    record = tmp_path / "r.jsonl"
    record.write_text(json.dumps(snapshot_to_dict(make_snapshot())) + "\n")
    err, rc = tmp_path / "err.txt", tmp_path / "rc.txt"
    session = f"dlmon-stderr-{os.getpid()}"
    shell = (
        f"cd {ROOT} && PYTHONPATH={ROOT} {sys.executable} -m dlmon replay {record} 2>{err}; "
        f"echo $? > {rc}.tmp && mv {rc}.tmp {rc}; sleep 30"
    )
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "40", shell], check=True)
    try:
        deadline = time.monotonic() + 30
        while not rc.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not rc.exists():  # the dashboard runs, drawn into the file: leave it
            subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=False)
            time.sleep(2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
    text = err.read_text(errors="replace")
    assert "\x1b[" not in text, "the dashboard was drawn into the redirected stderr"
    assert rc.read_text().strip() == "2" and "needs a terminal" in text and "stderr" in text, text


def test_replay_of_a_record_with_a_huge_time_gap_keeps_its_thread_waiting(tmp_path: Path) -> None:
    """A gap of 10 s at ``--speed 1e-300`` (1e301 s, or a 9e10 s gap at speed 1): the replay waits
    (stoppable), never dies of an OverflowError."""
    lines = [json.dumps(snapshot_to_dict(make_snapshot(t))) for t in (T0, T0 + 10)]
    path = tmp_path / "gap.jsonl"
    path.write_text("\n".join(lines) + "\n")
    source = ReplaySource(str(path), speed=1e-300)
    got: list[Snapshot] = []
    source.start(got.append, lambda reason: None)
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    thread = source._thread
    assert thread is not None and thread.is_alive(), "the replay thread died on the gap"
    source.stop()
    assert not thread.is_alive() and len(got) == 1


@pytest.mark.parametrize("value", [1e18, -1e18])
def test_a_time_no_clock_can_show_is_a_record_problem_not_a_dashboard_crash(
    tmp_path: Path, value: float
) -> None:
    """``"time": 1e18`` is a number of the right type; shown as a clock it crashed the dashboard."""
    from dlmon.ui import create_app

    good = make_snapshot()
    bad = snapshot_to_dict(make_snapshot(T0 + 1))
    bad["time"] = value
    path = tmp_path / "far.jsonl"
    path.write_text(json.dumps(snapshot_to_dict(good)) + "\n" + json.dumps(bad) + "\n")
    source = ReplaySource(str(path), speed=None)
    assert [p.line for p in source.record.problems] == [2]
    app = create_app(source, clock=fixed_clock, boot_time=BOOT)

    async def main() -> None:
        async with app.run_test(size=(160, 50)) as pilot:
            deadline = time.monotonic() + 30
            while app.state.end_reason is None and time.monotonic() < deadline:
                await pilot.pause(0.05)
            await pilot.pause(0.3)
            await pilot.press("q")

    asyncio.run(main())
    assert app.state.latest == good


def test_an_alert_whose_evidence_holds_a_bool_replays() -> None:
    """memory_growth's evidence says whether the copy-on-read ceiling fits (True/False): a record
    dlmon itself wrote must read back (the type check rejected it: 78 lines of a real recording)."""
    import dataclasses
    import json
    from types import MappingProxyType

    from dlmon.flow.records import parse_line
    from dlmon.model import Alert
    from dlmon.model.serialize import snapshot_to_dict
    from support.ui import make_snapshot

    alert = Alert(
        "memory_growth", "info", "job", "levels off", "", 1.7e9, MappingProxyType({"fits": True, "n": 3})
    )
    snap = dataclasses.replace(make_snapshot(), alerts=(alert,))
    line = json.dumps(snapshot_to_dict(snap)).encode()
    back = parse_line(1, line)
    assert not hasattr(back, "reason"), back
    assert back.alerts[0].evidence["fits"] is True  # type: ignore[union-attr]


def test_advise_gives_the_count_of_failed_ticks_it_promised(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """advise's first failed tick says "the count is given at the end": it must be. Found in
    review: advise moved onto the watch (which reports a failed tick) without its end line."""
    from dlmon.launch.advise import advise_pid

    monkeypatch.setattr("dlmon.flow.watch.Sampler", lambda pid, **_: FailingSampler(pid, {2}))
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert advise_pid(sleeper.pid, 2.0, as_json=True) == 0
    finally:
        sleeper.kill()
        sleeper.wait()
    out, err = capsys.readouterr()
    assert json.loads(out)["snapshots"] == 2
    said = err.splitlines()
    assert len(said) == 2 and "count is given at the end" in said[0], said
    first = f"Input/output error (/proc/{sleeper.pid}/smaps_rollup)"
    assert said[1] == f"dlmon: 1 sample failed during the watch (first: {first})"
