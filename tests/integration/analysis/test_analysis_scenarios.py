"""dlmon.analysis on real processes sampled by the real Sampler: the failures it exists to catch.

Each scenario starts a real job (tests/scenarios/loader_job.py: a torch DataLoader, or fio),
samples it every 0.25 s and passes every snapshot through a strict Analyzer (a detector bug
fails the test instead of being swallowed).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import Background
from dlmon.analysis import Analyzer
from dlmon.collect.sampler import Sampler
from dlmon.flow.sources import LiveSource
from dlmon.model import Alert, Snapshot
from support.paths import TESTS

pytest.importorskip("torch")

JOB = str(TESTS / "scenarios" / "loader_job.py")
INTERVAL = 0.25
Start = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def start() -> Iterator[Start]:
    """Start a command in its own session; wait for READY if asked; kill the session at the end."""
    started: list[subprocess.Popen[str]] = []

    def _start(argv: list[str], *, ready: bool = True, timeout: float = 90.0) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True
        )
        started.append(proc)
        if ready:
            assert proc.stdout is not None
            got, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if got else ""
            if line.strip() != "READY":
                raise RuntimeError(f"{argv[:3]} did not get ready: {line!r}, exit {proc.poll()}")
        return proc

    yield _start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def job(*args: str) -> list[str]:
    return [sys.executable, JOB, *args]


class Watch:
    """A Sampler and a strict Analyzer on one target; ``until`` samples until an alert shows."""

    def __init__(self, pid: int, cores: int | None = None) -> None:
        self.sampler = Sampler(pid)
        self.analyzer = Analyzer(cores=cores, strict=True)
        self.snapshots: list[Snapshot] = []
        self.start = time.monotonic()
        self._next = self.start

    def tick(self) -> Snapshot:
        now = time.monotonic()
        if self._next > now:
            time.sleep(self._next - now)
        self._next = max(self._next + INTERVAL, time.monotonic())
        s = self.analyzer(self.sampler.sample())
        self.snapshots.append(s)
        return s

    def until(self, kind: str, seconds: float) -> Alert | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for alert in self.tick().alerts:
                if alert.kind == kind:
                    return alert
        return None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def kinds_seen(self) -> set[str]:
        return {a.kind for s in self.snapshots for a in s.alerts}

    def close(self) -> None:
        self.sampler.close()


@dataclass
class Watched:
    """One job of :func:`watch_side_by_side`: watched from its own READY on (as ``start`` + a Watch
    would), tick by tick, until ``stop`` says its question is decided or ``limit_s`` has passed."""

    argv: list[str]
    limit_s: float
    stop: Callable[[Watch, Snapshot], bool] = lambda w, s: False
    make_watch: Callable[[int], Watch] = Watch
    env: dict[str, str] | None = None
    proc: subprocess.Popen[str] | None = None
    watch: Watch | None = None
    watched_s: float | None = None  # how long it was watched (from READY to the stop)
    error: str | None = None
    done: bool = False

    def result(self) -> Watch:
        """The finished watch; a job that did not get ready fails the test that reads it."""
        if self.error is not None:
            raise RuntimeError(self.error)
        assert self.watch is not None and self.done
        return self.watch


def watch_side_by_side(jobs: Sequence[Watched], ready_timeout: float = 90.0) -> None:
    """Start every job at once and sample them in one loop, each on its own 0.25 s ticks, until all
    are decided: the jobs are rate-limited (mostly asleep), so their waits overlap instead of adding
    up. Each job's session is killed as soon as its watch ends."""
    for j in jobs:
        j.proc = subprocess.Popen(
            j.argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
            env=j.env,
        )  # fmt: skip
    launched = time.monotonic()
    starting = {j.proc.stdout: j for j in jobs if j.proc is not None and j.proc.stdout is not None}
    try:
        while not all(j.done for j in jobs):
            if starting:
                ticking = any(j.watch is not None and not j.done for j in jobs)
                got, _, _ = select.select(list(starting), [], [], 0.0 if ticking else INTERVAL)
                for f in got:
                    j = starting.pop(f)
                    assert j.proc is not None
                    line = f.readline()
                    if line.strip() == "READY":
                        j.watch = j.make_watch(j.proc.pid)
                    else:
                        _finish(j, f"{j.argv[:3]} did not get ready: {line!r}, exit {j.proc.poll()}")
                if time.monotonic() - launched > ready_timeout:
                    for f, j in list(starting.items()):
                        del starting[f]
                        _finish(j, f"{j.argv[:3]} did not get ready within {ready_timeout} s")
            for j in jobs:
                if j.watch is None or j.done:
                    continue
                s = j.watch.tick()
                if j.stop(j.watch, s) or j.watch.elapsed() >= j.limit_s:
                    j.watched_s = j.watch.elapsed()
                    _finish(j)
    finally:
        for j in jobs:
            _finish(j, j.error or "the side-by-side watch was interrupted")


def _finish(j: Watched, error: str | None = None) -> None:
    if j.done:
        return
    j.done = True
    if error is not None:
        j.error = error
    if j.watch is not None:
        j.watch.close()
    if j.proc is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(j.proc.pid, signal.SIGKILL)
        j.proc.wait()


LongJobs = Callable[[pytest.TempPathFactory, contextlib.ExitStack[None]], dict[str, Watched]]
_LONG_PLANS: dict[str, LongJobs] = {}
_LONG_WATCHED: dict[str, dict[str, Watched]] = {}


def register_long_jobs(module: str, plan: LongJobs) -> None:
    """A test module's long real jobs (at import, so at collection): the first test that needs its
    module's jobs starts every registered module's jobs at once and watches them side by side, so
    the suite waits about as long as the longest watch instead of the sum of them. ``plan`` makes
    the module's Watched (entering what they need, such as an agent's environment, on the stack)."""
    _LONG_PLANS[module] = plan


def long_jobs(module: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Watched]:
    """``module``'s watched jobs; the first call watches every registered module's, not yet watched."""
    if module not in _LONG_WATCHED:
        with contextlib.ExitStack() as stack:
            planned = {m: plan(tmp_path_factory, stack) for m, plan in _LONG_PLANS.items()}
            _LONG_PLANS.clear()
            watch_side_by_side([j for found in planned.values() for j in found.values()])
        _LONG_WATCHED.update(planned)
    return _LONG_WATCHED[module]


def release_long_jobs(module: str) -> None:
    """Forget ``module``'s snapshots once its tests are done (thousands, held for the session)."""
    _LONG_WATCHED.pop(module, None)


def fired(kind: str) -> Callable[[Watch, Snapshot], bool]:
    return lambda w, s: any(a.kind == kind for a in s.alerts)


def _long_jobs(tmp: pytest.TempPathFactory, stack: contextlib.ExitStack[None]) -> dict[str, Watched]:
    # Same loader, same pace (1000 samples/s over 2 shuffled workers: ~2 MB/s of copied pages per
    # worker at first); one Dataset holds 3M Python strings, the other the same bytes in a tensor.
    common = ["--items", "3000000", "--workers", "2", "--batch", "50", "--rate", "20", "--shuffle"]
    common.append("--persistent")
    return {
        # the leak: until its first memory_growth alert (which must come within 60 s)
        "leak": Watched(job("--store", "list", *common), 62.0, fired("memory_growth")),
        # quiet: the full 62 s
        "flat": Watched(job("--store", "tensor", *common), 62.0),
    }


register_long_jobs(__name__, _long_jobs)


@pytest.fixture(scope="module")
def jobs(
    tmp_path_factory: pytest.TempPathFactory,
    deaths_early: Background,
    trainer_leak_run: Background,
    report_recordings: Background,
) -> Iterator[dict[str, Watched]]:
    # the session's other long runs (conftest), begun during this window once the load-sensitive
    # watches are decided: their waits overlap this one instead of adding up
    trainer_leak_run.start(delay_s=0.0)  # the longest (~2 min); 2 light jobs, passed at once
    # after the copy-on-read verdicts (the pair's 62 s, the anonymous split's 75 s, from READY): on
    # CI, deaths_early's seven jobs (about a core) begun at 55 s kept all three from firing in time
    deaths_early.start(delay_s=80.0)
    report_recordings.start(delay_s=80.0)
    watched = long_jobs(__name__, tmp_path_factory)
    for run in (trainer_leak_run, deaths_early, report_recordings):
        run.settle()
    yield watched
    release_long_jobs(__name__)


@pytest.mark.slow
def test_copy_on_read_leak_is_alerted_within_a_minute_and_a_tensor_store_is_not(
    jobs: dict[str, Watched],
) -> None:
    leak, flat = jobs["leak"].result(), jobs["flat"].result()
    alert = next((a for s in leak.snapshots for a in s.alerts if a.kind == "memory_growth"), None)
    found = jobs["leak"].watched_s if alert is not None else None
    assert found is not None and found <= 60.0, f"no memory_growth alert within 60 s ({found})"
    assert alert is not None
    assert alert.evidence["cause"] == "copy_on_read", alert.message
    assert alert.evidence["growing_workers"] == 2
    rate = alert.evidence["rate_bytes_per_s"]
    assert isinstance(rate, float) and rate >= 2 * 1e6 * 0.8  # >= ~1 MB/s in each worker
    assert "pytorch#13246" in alert.advice
    watched = jobs["flat"].watched_s
    assert watched is not None and watched >= 62.0, watched
    assert "memory_growth" not in flat.kinds_seen(), [a.message for s in flat.snapshots for a in s.alerts]
    assert flat.snapshots[-1].memory.pss_sum_bytes is not None


def test_sigkilled_worker_is_a_zombie_while_its_iterator_lives(start: Start) -> None:
    # The kill lands while the trainer is in a long step. Landing while it waits on the loader's
    # queue instead, torch's handler polls the workers' liveness, which reaps the dead one at once
    # (no zombie to see: the death is worker_died's, integration/deaths/test_real_trainings.py); on a
    # loaded CI machine the trainer waited there often enough for this test to see no zombie.
    proc = start(
        job("--store", "tensor", "--items", "100000", "--workers", "2", "--rate", "20", "--persistent",
            "--step-after-ready", "120")
    )  # fmt: skip
    # through the real live path: LiveSource runs the analyzer on its sampling thread
    got: list[Snapshot] = []
    ended: list[str] = []
    source = LiveSource(proc.pid, interval=INTERVAL, analyzer=Analyzer(strict=True))
    source.start(got.append, ended.append)
    try:
        deadline = time.monotonic() + 10
        while not any(s.workers() for s in got) and time.monotonic() < deadline:
            time.sleep(0.05)
        victim = got[-1].workers()[0].pid
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        alert = None
        while alert is None and time.monotonic() < killed + 20:
            time.sleep(0.1)
            alert = next((a for a in got[-1].alerts if a.kind == "zombie_worker"), None)
        assert alert is not None, f"no zombie_worker alert (source ended: {ended})"
        # raised once it has outlasted a worker's join at an epoch's end (6 s), not much later
        assert time.monotonic() - killed < 12.0
        assert str(victim) in alert.message and alert.subject.endswith(f"(pid {victim})")
        assert alert.since >= got[0].time
    finally:
        source.stop()
        source.sampler.close()


def test_sigkilled_trainer_leaves_orphaned_workers(start: Start) -> None:
    proc = start(
        job("--store", "tensor", "--items", "100000", "--workers", "2", "--rate", "20", "--persistent")
    )
    w = Watch(proc.pid)
    try:
        workers = []
        while len(workers) < 2:
            workers = [p.pid for p in w.tick().workers()]
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        alert = w.until("orphan_worker", 8.0)  # workers linger 4-11 s after their trainer dies
        assert alert is not None, "no orphan_worker alert"
        assert time.monotonic() - killed < 4.0
        assert alert.evidence["count"] == 2
        assert alert.evidence["pids"] == ",".join(str(p) for p in sorted(workers))
        rss = alert.evidence["rss_bytes"]
        assert isinstance(rss, float) and rss > 10e6
        assert "exited" in alert.message and "RSS" in alert.message
    finally:
        w.close()


def _disk_of(path: Path) -> str | None:
    """The whole disk under ``path`` (sysfs name), or None."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
    if not sys_dev.exists():
        return None
    real = sys_dev.resolve()
    return real.parent.name if (real / "partition").exists() else real.name


@pytest.mark.slow
def test_disk_saturated_by_a_real_reader(start: Start, tmp_path: Path) -> None:
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    disk = _disk_of(tmp_path)
    if disk is None:
        pytest.skip(f"{tmp_path} is not on a block device")
    data = tmp_path / "fio.dat"
    fio = ["fio", "--name=t", f"--filename={data}", "--size=512m", "--output=/dev/null"]
    subprocess.run([*fio, "--rw=write", "--bs=1m", "--end_fsync=1"], check=True, timeout=120)
    # 16 synchronous O_DIRECT random readers: deep queue, every reader in D state, PSI io climbs
    load = "--rw=randread --direct=1 --bs=4k --numjobs=16 --ioengine=psync --time_based --runtime=40"
    reader = start([*fio, *load.split(), "--group_reporting"], ready=False)
    time.sleep(0.5)
    w = Watch(reader.pid)
    try:
        alert = w.until("io_saturation", 25.0)
        utils = [d.util_percent for s in w.snapshots for d in s.disks if d.name == disk and d.util_percent]
        if alert is None and (not utils or max(utils) < 75.0):
            pytest.skip(f"disk {disk} could not be saturated here (max %util {max(utils, default=0):.0f})")
        assert alert is not None, f"no io_saturation alert; %util seen: {[round(u) for u in utils]}"
        assert alert.subject == f"disk {disk}"
        util = alert.evidence["util_percent"]
        assert isinstance(util, float) and util >= 80.0
        assert alert.evidence["witnesses"]  # queueing, not just busy: pressure, D state, await or queue
        assert alert.severity in ("warning", "critical")  # the job itself is the reader
    finally:
        w.close()


def test_small_dev_shm_in_a_private_mount_namespace(start: Start) -> None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root to mount a private /dev/shm")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=8m tmpfs /dev/shm"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here: {probe.stderr.decode().strip()}")
    args = "--store big --items 100000 --workers 2 --batch 1 --rate 20 --tensor-bytes 1048576 --persistent"
    args += " --fill-shm 3000000"  # 3 of the 8 MB taken: the batches in flight nearly fill the rest
    script = f"mount -t tmpfs -o size=8m tmpfs /dev/shm && exec {sys.executable} {JOB} {args}"
    proc = start(["unshare", "-m", "sh", "-c", script])
    w = Watch(proc.pid)
    try:
        alert = w.until("shm_exhaustion", 5.0)
        assert alert is not None, "no shm_exhaustion alert"
        shm = w.snapshots[-1].shm
        assert shm is not None and shm.path == f"/proc/{proc.pid}/root/dev/shm"
        assert shm.total_bytes == 8 * 1024 * 1024  # the private one, not the machine's
        assert alert.evidence["shm_total_bytes"] == 8 * 1024 * 1024
        assert "Bus error" in alert.message and "--shm-size" in alert.advice
    finally:
        w.close()


def _cpu_inputs(w: Watch) -> str:
    """Why oversubscription did not raise: over the last 10 s of ticks, whether the detector
    found a candidate on each (+ or .; a raise needs 5 s of + unbroken), then what it reads on the
    last ticks (live workers of the live trainer, threads, CPU, involuntary switches, PSI)."""
    from dlmon.analysis.detectors._base import Context, JobTree
    from dlmon.analysis.detectors.loader import detect_oversubscription

    ticks = w.snapshots[-40:]
    first = len(w.snapshots) - len(ticks)
    marks = "".join(
        "+" if detect_oversubscription(Context.from_history(w.snapshots[: first + i + 1], cores=2)) else "."
        for i in range(len(ticks))
    )
    lines = [f"candidate per tick: {marks}"]
    for s in ticks[-5:]:
        workers = JobTree.of(s).workers()
        busy = sum(p.cpu_percent or 0.0 for p in workers)
        switches = [p.nonvoluntary_ctxt_switches_per_s for p in workers]
        psi = s.pressure.cpu_some_avg10 if s.pressure is not None else None
        lines.append(
            f"+{s.time - w.snapshots[0].time:.1f}s: {len(workers)} workers, threads "
            f"{[p.num_threads for p in workers]}, busy {busy:.0f}%, nvcsw/s "
            f"{[None if v is None else round(v) for v in switches]}, PSI cpu {psi}"
        )
    return "\n".join(lines)


@pytest.mark.slow
def test_oversubscribed_workers(start: Start) -> None:
    # 6 workers, each doing matmuls on 4 torch threads, on the 2 cores of this machine
    args = "--store busy --items 100000 --workers 6 --batch 4 --busy-threads 4 --persistent"
    proc = start(job(*args.split()))
    w = Watch(proc.pid, cores=2)
    try:
        # 60 s: the alert needs its candidate 5 s unbroken, and on a loaded machine (CI) one tick
        # with the workers briefly idle starts that count again; alone it comes at ~9 s
        alert = w.until("oversubscription", 60.0)
        assert alert is not None, f"no oversubscription alert\n{_cpu_inputs(w)}"
        # the workers' own switching is the witness, not the machine's CPU pressure (which other
        # processes on a loaded machine can raise)
        switches = alert.evidence["nonvoluntary_switches_per_s"]
        assert isinstance(switches, float) and switches >= 100, alert.evidence
        assert alert.evidence["workers"] == 6 and alert.evidence["cores"] == 2
        threads = alert.evidence["threads_per_worker"]
        assert isinstance(threads, float) and threads >= 4
        assert "at most 1 workers" in alert.advice
    finally:
        w.close()
