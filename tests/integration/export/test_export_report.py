"""`dlmon report` and `dlmon diff` on real recordings made here: a healthy DataLoader job, one
whose workers grow by copy-on-read, one whose worker is SIGKILLed, a gzip'd one, and damaged copies."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from conftest import Background
from dlmon.flow.summary import SERIES_POINTS, summarize
from dlmon.model.format import human_bytes
from support.export import LOADER_JOB, dlmon_cmd, kill_group, read_snapshots, wait_for

pytestmark = pytest.mark.slow

JOB = [LOADER_JOB, "--store", "tensor", "--items", "20000", "--workers", "2", "--rate", "40"]
# The 60-s memory_growth window needs ~40 s of readings (docs/detectors.md), + load: the leak's
# recording ends LEAK_MARGIN_S after the alert first reaches its file, or at LEAK_S at the latest.
LEAK_S = 120
LEAK_MARGIN_S = 3.0
DEATH_JOB = str(Path(LOADER_JOB).parent / "worker_death_job.py")  # worker 1 SIGKILLs itself
# Copy-on-read in the workers (pytorch#13246): the trainer-side leak signals wait out a 2-minute
# warm-up (docs/detectors.md), the workers' copy-on-read signal does not.
LEAK_JOB = [LOADER_JOB, "--store", "list", "--items", "3000000", "--workers", "2", "--batch", "50"]
LEAK_JOB += ["--rate", "20", "--shuffle", "--persistent"]

LONG_SNAPSHOTS = 5_000  # ~10 x SERIES_POINTS: every series is thinned

STARTUP_SLEEP = 1.0
STARTUP_JOB = [LOADER_JOB, "--store", "tensor", "--items", "640", "--workers", "2", "--rate", "40"]
STARTUP_JOB += ["--init-sleep", str(STARTUP_SLEEP)]


def record(path: Path, *job: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        dlmon_cmd("run", "--headless", "--interval", "0.5", "--record", str(path), *job),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


class Recordings:
    """Made side by side (about a minute): healthy, leak, death, healthy gzip'd, slow, start-up.
    Started by the session (conftest) with the suite's first long window, so that they are made
    by the time this module runs; its ``recordings`` waits for them."""

    def __init__(self, tmp: Path) -> None:
        self.paths = {
            "healthy": tmp / "healthy.jsonl",
            "healthy_gz": tmp / "healthy.jsonl.gz",
            "leak": tmp / "leak.jsonl",
            "death": tmp / "death.jsonl",
            "slow": tmp / "slow.jsonl",
            "startup": tmp / "startup.jsonl",
        }
        self.runs: list[subprocess.Popen[bytes]] = []
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        paths = self.paths
        self.runs = [
            record(paths["healthy"], *JOB, "--seconds", "12"),
            record(paths["healthy_gz"], *JOB, "--seconds", "8"),
            record(paths["slow"], *JOB, "--seconds", "12", "--rate", "15"),  # the same job, throttled
            # one long epoch, persistent workers: no respawn sawtooth over the steady leak
            record(paths["leak"], *LEAK_JOB, "--seconds", str(LEAK_S)),
            # short epochs, non-persistent workers that take STARTUP_SLEEP s to start each epoch
            record(paths["startup"], *STARTUP_JOB, "--seconds", "14"),
            record(paths["death"], DEATH_JOB, "16"),
        ]

        def body() -> None:
            try:
                end_when_alerted(paths["leak"], "memory_growth", LEAK_S + 60)
                for run in self.runs:
                    run.wait(timeout=LEAK_S + 120)
            except BaseException as exc:  # re-raised by the module's fixture
                self.error = exc

        self.thread = threading.Thread(target=body, name="report-recordings", daemon=True)
        self.thread.start()

    def result(self) -> dict[str, Path]:
        assert self.thread is not None
        self.thread.join(LEAK_S + 300)
        assert not self.thread.is_alive(), "the recordings were not over in time"
        if self.error is not None:
            raise self.error
        return self.paths

    def close(self) -> None:
        for run in self.runs:
            kill_group(run)


@pytest.fixture(scope="module")
def recordings(report_recordings: Background) -> dict[str, Path]:
    made: Recordings = report_recordings.get()
    return made.result()


def end_when_alerted(path: Path, kind: str, timeout: float) -> None:
    """Wait until ``kind`` is in a snapshot of the recording at ``path``, then LEAK_MARGIN_S more,
    then end its job the way its ``--seconds`` would (loader_job.py: SIGUSR1, exit 0). The job's own
    ``--seconds`` still ends it if the alert never comes (and the test that asks for it fails)."""

    def alerted() -> int | None:
        for s in read_snapshots(path) if path.exists() else []:
            if any(a["kind"] == kind for a in s["alerts"]):
                return int(s["target"]["pid"])
        return None

    pid = wait_for(alerted, timeout=timeout, every=0.5)
    if pid is not None:
        time.sleep(LEAK_MARGIN_S)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dlmon_cmd("report", *args), capture_output=True, text=True, timeout=120)


def diff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dlmon_cmd("diff", *args), capture_output=True, text=True, timeout=120)


def test_healthy_report_shows_the_recordings_own_figures(recordings: dict[str, Path]) -> None:
    path = recordings["healthy"]
    snapshots = read_snapshots(path)
    result = report(str(path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    peak_pss = coherent_pss_peak(snapshots)  # no tick that sums a pre-fork PSS with its workers'
    peak_rss = max(s["memory"]["rss_sum_bytes"] or 0 for s in snapshots)
    assert re.search(rf"job PSS \(true total\)\s+{re.escape(human_bytes(peak_pss))}", out), out
    assert re.search(rf"RSS sum \(double-counts shared\)\s+{re.escape(human_bytes(peak_rss))}", out)
    started = [s for s in snapshots if any(lo["batches_total"] for lo in s["loaders"]) and s["interval_s"]]
    known = [[lo["samples_per_s"] for lo in s["loaders"] if lo["samples_per_s"] is not None] for s in started]
    rates = [sum(values) for values in known if values]
    assert rates, "the agent's loader figures are missing from the recording"
    assert f"{sum(rates) / len(rates):,.1f}/s" in out
    assert f"({len(snapshots)} snapshots)" in out and "ended            target exited" in out
    assert "Worker deaths (0)" in out
    assert "memory_growth" not in out and "worker_died" not in out  # healthy stays quiet
    assert "Memory [MiB]" in out and "seconds since start" in out  # the plotext charts


def coherent_pss_peak(snapshots: list[dict[str, Any]]) -> float:
    """The largest job PSS among snapshots whose every PSS reading was taken after the newest
    process of the tree first appeared (a parent's pre-fork PSS still counts its shared pages)."""
    first_seen: dict[tuple[int, int], float] = {}
    best = 0.0
    for i, s in enumerate(snapshots):
        seen = {
            (p["pid"], p["start_time"]): first_seen.get(
                (p["pid"], p["start_time"]), -1e18 if i == 0 else s["time"]
            )
            for p in s["processes"]
        }
        first_seen = seen
        newest = max(seen.values())
        read_at = [s["time"] - p["pss_age_s"] for p in s["processes"] if p["pss_bytes"] is not None]
        if all(t >= newest - 1e-3 for t in read_at) and s["memory"]["pss_sum_bytes"] is not None:
            best = max(best, s["memory"]["pss_sum_bytes"])
    return best


def test_the_job_pss_peak_never_adds_a_parents_pre_fork_pss_to_its_workers(
    recordings: dict[str, Path],
) -> None:
    """The tick after a DataLoader forks its workers holds the workers' fresh PSS and the trainer's
    PSS from before the fork (read on a budget): summed, the shared pages count twice. That sum
    never existed and must not be the run's peak (it was +40% in a recording made here)."""
    for name in ("healthy", "leak", "slow"):
        snapshots = read_snapshots(recordings[name])
        assert summarize(str(recordings[name])).peaks["job_pss"].value == coherent_pss_peak(snapshots)


def test_leak_report_has_the_memory_growth_window(recordings: dict[str, Path]) -> None:
    result = report(str(recordings["leak"]), "--no-charts")
    assert result.returncode == 0, result.stderr
    line = next((ln for ln in result.stdout.splitlines() if "memory_growth" in ln), None)
    assert line is not None, result.stdout
    assert re.search(r"\+0:\d\d:\d\d\s+\+0:\d\d:\d\d", line), line  # its time window


def test_death_report_names_the_worker_and_the_signal(recordings: dict[str, Path]) -> None:
    result = report(str(recordings["death"]), "--no-charts")
    assert result.returncode == 0, result.stderr
    assert "Worker deaths (1)" in result.stdout
    if summarize(str(recordings["death"])).oom_kills == 0:  # the test's SIGKILL, not the kernel's
        assert "not by the OOM killer" in result.stdout
    assert re.search(r"worker \d \(pid \d+\).*SIGKILL", result.stdout), result.stdout
    assert "worker_died" in result.stdout


def test_gzip_recordings_are_written_and_read(recordings: dict[str, Path]) -> None:
    path = recordings["healthy_gz"]
    with gzip.open(path, "rt") as fh:
        lines = fh.read().splitlines()
    assert json.loads(lines[-1])["type"] == "end"
    result = report(str(path), "--no-charts")
    assert result.returncode == 0 and f"({len(lines) - 1} snapshots)" in result.stdout, result.stderr


def test_a_killed_gzip_recording_keeps_its_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "killed.jsonl.gz"
    job = subprocess.Popen(["sleep", "60"], start_new_session=True)
    recorder = subprocess.Popen(
        dlmon_cmd("record", str(job.pid), "-o", str(path), "--interval", "0.2"), start_new_session=True
    )
    try:
        assert wait_for(lambda: path.exists() and path.stat().st_size > 2000, timeout=60)
        recorder.send_signal(signal.SIGKILL)
        recorder.wait(timeout=30)
    finally:
        kill_group(job)
        kill_group(recorder)
    result = report(str(path), "--no-charts")
    assert result.returncode == 0, result.stderr
    assert re.search(r"\((\d+) snapshots\)", result.stdout)
    assert "no end marker" in result.stdout


def test_a_damaged_recording_says_what_it_skipped_and_renders_the_rest(
    recordings: dict[str, Path], tmp_path: Path
) -> None:
    lines = recordings["healthy"].read_text().splitlines(keepends=True)
    whole = len(read_snapshots(recordings["healthy"]))
    damaged = tmp_path / "damaged.jsonl"
    # line 3 garbage, line 6 a snapshot of a future schema, the last line cut mid-way, no end marker
    body = [*lines[:2], "{not json\n", *lines[2:4], '{"type":"snapshot","schema":99}\n', *lines[4:-2]]
    damaged.write_text("".join(body) + lines[-2][: len(lines[-2]) // 2])
    result = report(str(damaged), "--no-charts")
    assert result.returncode == 0, result.stderr
    assert "skipping line 3" in result.stderr and "skipping line 6" in result.stderr
    assert f"({whole - 1} snapshots)" in result.stdout
    assert "3 line(s) skipped" in result.stdout and "Memory peaks" in result.stdout


def test_markdown_for_a_pr_comment(recordings: dict[str, Path]) -> None:
    result = report(str(recordings["death"]), "--md")
    assert result.returncode == 0
    assert result.stdout.startswith("## dlmon report")
    assert "| figure | peak | at |" in result.stdout and "| at | worker | loader | cause |" in result.stdout


def test_html_report_is_one_self_contained_file(recordings: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "leak.html"
    result = report(str(recordings["leak"]), "--html", str(out), "--no-charts")
    assert result.returncode == 0 and "HTML report written" in result.stderr
    html = out.read_text()
    assert html.count("<svg") == 4 and "memory_growth" in html
    assert "<script" not in html and not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)
    assert "<link" not in html and "@import" not in html


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium not installed (.ci/run installs it)")
def test_html_report_renders_in_headless_chromium(recordings: dict[str, Path], tmp_path: Path) -> None:
    html, png = tmp_path / "report.html", tmp_path / "report.png"
    assert report(str(recordings["leak"]), "--html", str(html), "--no-charts").returncode == 0
    result = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--screenshot={png}", "--window-size=880,1800", html.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and png.exists(), result.stderr[-2000:]
    data = png.read_bytes()
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (880, 1800)
    assert len(data) > 40_000  # a blank page compresses to a few kB; charts and tables do not


def test_diff_fails_ci_on_a_memory_regression(recordings: dict[str, Path]) -> None:
    result = diff(str(recordings["healthy"]), str(recordings["leak"]), "--fail-on", "memory+10%")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "verdict: FAIL" in result.stdout and "memory_growth" in result.stdout
    assert re.search(r"limit: memory\+10%: memory changed \+\d+\.\d%", result.stdout)


def test_diff_fails_ci_on_a_throughput_regression(recordings: dict[str, Path]) -> None:
    limits = ["--fail-on", "throughput-5%", "--fail-on", "memory+50%"]
    result = diff(str(recordings["healthy"]), str(recordings["slow"]), *limits)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"limit: throughput-5%: throughput changed -\d\d\.\d%", result.stdout), result.stdout
    assert "limit: memory+50%" not in result.stdout
    assert re.search(r"throughput \(mean samples/s\).*worse", result.stdout)
    back = diff(str(recordings["slow"]), str(recordings["healthy"]), *limits)
    assert back.returncode == 0, back.stdout
    assert re.search(r"throughput \(mean samples/s\).*better", back.stdout)  # data-wait may rise with it


def without_pss(path: Path, out: Path) -> Path:
    """A copy of a real recording as made where smaps_rollup is unreadable (no PSS, no USS)."""
    with open(path) as src, open(out, "w") as dst:
        for line in src:
            record = json.loads(line)
            if record.get("type") == "snapshot":
                record["memory"]["pss_sum_bytes"] = record["memory"]["uss_sum_bytes"] = None
                for p in record["processes"]:
                    p["pss_bytes"] = p["uss_bytes"] = p["pss_shmem_bytes"] = p["pss_age_s"] = None
            dst.write(json.dumps(record) + "\n")
    return out


def test_diff_memory_never_compares_one_runs_pss_with_the_others_rss_sum(
    recordings: dict[str, Path], tmp_path: Path
) -> None:
    """The same run, once without PSS readings: its memory is unchanged, not +100% (B's RSS sum
    against A's PSS) nor -50% (the other way round, which would hide a real regression)."""
    healthy = str(recordings["healthy"])
    no_pss = str(without_pss(recordings["healthy"], tmp_path / "no_pss.jsonl"))
    for a, b in ((healthy, no_pss), (no_pss, healthy)):
        result = diff(a, b, "--fail-on", "memory+10%", "--fail-on", "memory-10%")
        assert result.returncode == 0, result.stdout
        assert re.search(r"peak RSS sum \(PSS not read in both\)\s.*\+0\.0%\s+same", result.stdout), (
            result.stdout
        )


def test_diff_per_process_peaks_never_compare_pss_with_rss(
    recordings: dict[str, Path], tmp_path: Path
) -> None:
    """The same run, once without PSS readings: each process's peak is its RSS there. Comparing it
    with the other run's PSS peak read as a per-worker memory regression (RSS counts shared pages)."""
    healthy = str(recordings["healthy"])
    no_pss = str(without_pss(recordings["healthy"], tmp_path / "no_pss.jsonl"))
    result = diff(healthy, no_pss, "--fail-on", "worker-memory+10%")
    assert result.returncode == 0, result.stdout
    assert "worker-memory+10%: n/a" in result.stdout, result.stdout
    assert "(A PSS, B RSS)" in result.stdout and "n/a (not the same measure)" in result.stdout, result.stdout


def test_diff_fails_ci_when_the_loader_never_delivers_a_batch(
    recordings: dict[str, Path], tmp_path: Path
) -> None:
    """B: the start of the healthy run, cut where its DataLoader existed but had not delivered a
    batch yet (a loader hung in start-up). Its throughput is 0, not "n/a, not a failure"."""
    hung = tmp_path / "hung.jsonl"
    with open(recordings["healthy"]) as src, open(hung, "w") as dst:
        for line in src:
            record = json.loads(line)
            if record.get("type") != "snapshot":
                continue
            for lo in record["loaders"]:
                lo.update(batches_total=0, samples_total=0, batches_per_s=None, samples_per_s=None)
                lo.update(batches_per_worker=[0 for _ in lo["batches_per_worker"]])
            dst.write(json.dumps(record) + "\n")
            if record["loaders"]:
                break
    result = diff(str(recordings["healthy"]), str(hung), "--fail-on", "throughput-5%")
    assert result.returncode == 1, result.stdout
    assert "limit: throughput-5%: throughput changed -100.0%" in result.stdout, result.stdout


def test_diff_per_worker_memory_limit(recordings: dict[str, Path]) -> None:
    result = diff(str(recordings["healthy"]), str(recordings["leak"]), "--fail-on", "worker-memory+50%")
    assert result.returncode == 1 and "limit: worker-memory+50%: worker-memory changed +" in result.stdout


def test_diff_of_a_run_with_itself_passes(recordings: dict[str, Path]) -> None:
    path = str(recordings["healthy"])
    result = diff(
        path, path, "--fail-on", "memory+10%", "--fail-on", "throughput-5%", "--fail-on", "alerts+0"
    )
    assert result.returncode == 0, result.stdout
    assert "verdict: same" in result.stdout and "worker 0 (loader 1)" in result.stdout


@pytest.mark.parametrize(
    "spec", ["memory", "memory+10", "speed-5%", "throughput-5pp", "alerts-1", "memory+x%"]
)
def test_bad_fail_on_specs_are_one_line_and_exit_2(spec: str) -> None:
    result = diff("/nonexistent-a", "/nonexistent-b", "--fail-on", spec)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--fail-on" in result.stderr


@pytest.mark.parametrize(("content", "words"), [(None, "cannot read"), ("", "holds no snapshots")])
def test_unreadable_or_empty_recordings_are_one_line_and_exit_2(
    tmp_path: Path, content: str | None, words: str
) -> None:
    path = tmp_path / "r.jsonl"
    if content is not None:
        path.write_text(content)
    for result in (report(str(path)), diff(str(path), str(path))):
        assert result.returncode == 2 and words in result.stderr and result.stderr.count("\n") == 1


def test_a_long_recording_is_streamed_in_bounded_memory(recordings: dict[str, Path], tmp_path: Path) -> None:
    """LONG_SNAPSHOTS snapshots (1.4 h at 1 Hz, ~25 MB): the summary's series stay at most
    SERIES_POINTS and the reader's peak memory stays a small fraction of the file.

    The bound is a share of the file, so it is as strict per snapshot at 5 000 as at 20 000 (what
    was kept per snapshot must stay under a tenth of its line either way; the fixed part is ~0.7 MB,
    4x under the bound here); tracemalloc makes the read ~8x slower, which 20 000 paid in minutes."""
    snapshots = read_snapshots(recordings["healthy"])
    template: dict[str, Any] = snapshots[len(snapshots) // 2]
    long_path = tmp_path / "long.jsonl"
    with open(long_path, "w") as fh:
        for i in range(LONG_SNAPSHOTS):
            template["time"] = 1_800_000_000.0 + i
            template["memory"]["pss_sum_bytes"] = 100_000_000 + i
            fh.write(json.dumps(template) + "\n")
    tracemalloc.start()
    try:
        summary = summarize(str(long_path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    last = LONG_SNAPSHOTS - 1
    assert summary.snapshots == LONG_SNAPSHOTS and summary.peaks["job_pss"].value == 100_000_000 + last
    assert all(len(points) <= SERIES_POINTS for points in summary.series.values())
    assert peak < long_path.stat().st_size / 10, (peak, long_path.stat().st_size)
    assert summary.duration_s == last


def test_report_is_also_a_module_command() -> None:
    """`python -m dlmon report --help` works without loading the collectors (fast CLI)."""
    result = subprocess.run(
        [sys.executable, "-m", "dlmon", "report", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "--html" in result.stdout


def test_prometheus_with_once_is_refused() -> None:
    result = subprocess.run(
        dlmon_cmd("attach", str(os.getpid()), "--once", "--prometheus", "0"), capture_output=True, text=True
    )
    assert result.returncode == 2 and "--once" in result.stderr and result.stderr.count("\n") == 1


def startup_rows(text: str) -> list[list[str]]:
    """The rows of the text report's start-up section, split on runs of spaces."""
    section = text.split("Worker start-up per epoch\n", 1)[1].split("\n\n", 1)[0]
    return [re.split(r"\s{2,}", line.strip()) for line in section.splitlines() if line.startswith("  ")]


def test_worker_start_up_per_epoch_from_a_real_slow_start_up(recordings: dict[str, Path]) -> None:
    """Non-persistent workers sleeping 1 s in worker_init_fn: each epoch pays >= 1 s of start-up,
    which the report shows per loader (epochs started, total, per epoch, share of wall time)."""
    path = recordings["startup"]
    last = [s["loaders"][0] for s in read_snapshots(path) if s.get("loaders")][-1]  # the last with a loader
    result = report(str(path), "--no-charts")
    assert result.returncode == 0, result.stderr
    assert "n/a: this recording holds no worker start-up" not in result.stdout
    header, *rows, _note = startup_rows(result.stdout)
    assert header[:3] == ["loader", "epochs started", "start-up total"], header
    assert len(rows) == 1, rows
    loader_id, epochs, total, per_epoch, share = rows[0][:5]
    assert loader_id == last["id"]
    assert int(epochs) == last["epochs_started"] >= 3
    assert float(total.removesuffix(" s")) == pytest.approx(last["startup_s_total"], abs=0.05)
    assert float(per_epoch.removesuffix(" s")) >= STARTUP_SLEEP * 0.95  # at least the init sleep
    assert float(share.removesuffix("%")) > 5.0
    assert "persistent_workers=True" in result.stdout
    md = report(str(path), "--md")
    assert "### Worker start-up per epoch" in md.stdout and f"| {loader_id} | {epochs} |" in md.stdout
    html = path.with_suffix(".html")
    assert report(str(path), "--html", str(html), "--no-charts").returncode == 0
    assert f"<td>{loader_id}</td><td>{epochs}</td><td>{total}</td>" in html.read_text()


def test_no_start_up_figures_stay_n_a(recordings: dict[str, Path], tmp_path: Path) -> None:
    """Without the agent's start-up counter the section still says n/a, with the reason."""
    lines = []
    for line in recordings["healthy"].read_text().splitlines():
        record = json.loads(line)
        for loader in record.get("loaders", []) if isinstance(record, dict) else []:
            loader.pop("startup_s_total", None)
            loader.pop("epochs_started", None)
        lines.append(json.dumps(record))
    stripped = tmp_path / "no-startup.jsonl"
    stripped.write_text("\n".join(lines) + "\n")
    result = report(str(stripped), "--no-charts")
    assert result.returncode == 0, result.stderr
    assert "n/a: this recording holds no worker start-up figures" in result.stdout
