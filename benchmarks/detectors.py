"""How well the detectors do on real jobs: time to detect, ETA-to-OOM error, false alarms, cost.

    python benchmarks/detectors.py [--only NAME ...] [--interval 0.25]

Each scenario starts a real job (tests/scenarios/loader_job.py, or fio), samples it with the real
Sampler every ``--interval`` seconds and runs every snapshot through one Analyzer, as the live
source does. The two leak scenarios run inside a cgroup v1 memory cgroup whose limit is set a
fixed margin above the job's usage once it is running, so the OOM killer really fires; the ETA
the memory_growth alert predicted is compared with when it did.

* detected after: seconds from the start of the condition (first batch, the kill, the load) to
  the alert being raised;
* ETA error: (time of the alert + its ETA) - the real OOM kill, at the first alert and halfway
  from the first alert to the kill (negative: the warning came early, which is the safe side);
* alerts of other kinds: raised alerts of any kind the scenario does not produce (before an OOM
  kill), with their severity; each is listed under the table with its message, so a false alarm
  can be told from a true one about something else on the machine (another process's IO);
* analyzer cost: CPU per tick in the analyzer alone, on this job's tree.

A false-alarm table runs healthy jobs for ``--healthy-seconds`` (3 min by default; ``--only
fa-memmap fa-startup fa-warmup fa-cache``) and counts the alerts they raise: the target is 0.
Timings on a loaded machine (other jobs sharing the cores) are approximate: detection times stretch
with the sampling jitter, and a healthy job can look input-bound when it is starved of CPU.

A last table times the Analyzer on a synthetic hour of a 1 + 32 process job at 1 Hz and says
how much memory it keeps. Needs root for the cgroup, fio for the disk scenario, unshare for shm.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from dlmon.analysis import Analyzer, events  # noqa: E402
from dlmon.collect.sampler import Sampler  # noqa: E402
from dlmon.model import Snapshot  # noqa: E402

JOB = str(ROOT / "tests" / "scenarios" / "loader_job.py")
MIB = 1024 * 1024


@dataclass
class Result:
    name: str
    expected: str
    detected_after_s: float | None = None
    eta_first_error_s: float | None = None
    eta_half_error_s: float | None = None
    oom_after_s: float | None = None
    false_alarms: list[str] = field(default_factory=list)
    ms_per_tick: float | None = None
    note: str = ""
    details: list[str] = field(default_factory=list)  # every alert raised, for the footnotes


# -- processes and cgroups -----------------------------------------------------------------


@contextlib.contextmanager
def started(
    argv: list[str], ready: bool = True, timeout: float = 120.0, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True, env=env
    )
    try:
        if ready:
            assert proc.stdout is not None
            got, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if got else ""
            if line.strip() != "READY":
                raise RuntimeError(f"{argv[:4]} did not get ready: {line!r}")
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def own_memory_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            d = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return d if d.is_dir() else None
    return None


@contextlib.contextmanager
def memory_cgroup() -> Iterator[Path]:
    parent = own_memory_cgroup()
    if parent is None:
        raise RuntimeError("no cgroup v1 memory hierarchy")
    d = parent / f"dlmon-bench-{os.getpid()}"
    d.mkdir()
    try:
        yield d
    finally:
        for _ in range(100):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.05)


class Run:
    """A Sampler + Analyzer over one target, with the alert transitions and their times."""

    def __init__(self, pid: int, interval: float, cores: int | None = None) -> None:
        self.sampler = Sampler(pid)
        self.analyzer = Analyzer(cores=cores)
        self.interval = interval
        self.snapshots: list[Snapshot] = []
        self.raised: list[tuple[float, str]] = []  # (monotonic time, kind)
        self.details: list[str] = []  # every raised alert: "kind severity: message"
        self.t0 = time.monotonic()
        self._next = self.t0

    def tick(self) -> Snapshot:
        now = time.monotonic()
        if self._next > now:
            time.sleep(self._next - now)
        self._next = max(self._next + self.interval, time.monotonic())
        before = self.snapshots[-1].alerts if self.snapshots else ()
        s = self.analyzer(self.sampler.sample())
        self.snapshots.append(s)
        stamp = time.monotonic()
        for e in events(before, s.alerts):
            if e.action == "raised":
                self.raised.append((stamp, e.alert.kind))
                self.details.append(f"{e.alert.kind} {e.alert.severity}: {e.alert.message}")
        return s

    def run_for(self, seconds: float, stop: Callable[[Snapshot], bool] | None = None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            s = self.tick()
            if stop is not None and stop(s):
                return

    def first(self, kind: str) -> float | None:
        return next((t for t, k in self.raised if k == kind), None)

    def others(self, allowed: set[str], before: float | None = None) -> list[str]:
        """Alerts of other kinds, as "kind (severity)"."""
        return [
            f"{k} ({d.split(':')[0].split()[-1]})"
            for (t, k), d in zip(self.raised, self.details, strict=True)
            if k not in allowed and (before is None or t < before)
        ]

    def cost_ms(self) -> float:
        a = self.analyzer
        return 1000.0 * a.cpu_s / max(1, a.ticks)

    def close(self) -> None:
        self.sampler.close()


# -- scenarios -------------------------------------------------------------------------------


def leak_to_oom(name: str, job_args: str, margin: int, interval: float, limit_s: float = 400.0) -> Result:
    """A leaking job in a memory cgroup limited to its usage + ``margin``: run until the OOM kill."""
    r = Result(name, "memory_growth")
    with memory_cgroup() as cg:
        script = f"echo $$ > {cg}/cgroup.procs && exec {sys.executable} {JOB} {job_args}"
        with started(["sh", "-c", script]) as proc:
            t_ready = time.monotonic()
            usage = int((cg / "memory.usage_in_bytes").read_text())
            (cg / "memory.limit_in_bytes").write_text(str(usage + margin))
            run = Run(proc.pid, interval)
            oom_at: float | None = None
            etas: list[tuple[float, float]] = []  # (monotonic time, predicted OOM time)

            def stop(s: Snapshot) -> bool:
                nonlocal oom_at
                for a in s.alerts:
                    eta = a.evidence.get("eta_s")
                    if a.kind == "memory_growth" and isinstance(eta, (int, float)):
                        etas.append((time.monotonic(), time.monotonic() + float(eta)))
                kills = s.cgroup.oom_kill_count if s.cgroup is not None else None
                if kills:
                    oom_at = time.monotonic()
                return oom_at is not None

            run.run_for(limit_s, stop)
            first = run.first("memory_growth")
            r.detected_after_s = None if first is None else first - t_ready
            r.false_alarms = run.others({"memory_growth"}, before=oom_at)
            r.details = run.details
            r.ms_per_tick = run.cost_ms()
            if oom_at is None:
                r.note = f"no OOM kill within {limit_s:.0f} s"
            else:
                r.oom_after_s = oom_at - t_ready
                if etas:
                    r.eta_first_error_s = etas[0][1] - oom_at
                    half = etas[0][0] + 0.5 * (oom_at - etas[0][0])
                    closest = min(etas, key=lambda e: abs(e[0] - half))
                    r.eta_half_error_s = closest[1] - oom_at
            r.note = (r.note + f" limit = usage + {margin // MIB} MiB").strip()
            run.close()
    return r


def steady(name: str, argv: list[str], seconds: float, interval: float, cores: int | None = None) -> Result:
    """A healthy job: every alert is a false alarm."""
    r = Result(name, "(none)")
    with started(argv) as proc:
        run = Run(proc.pid, interval, cores)
        run.run_for(seconds)
        r.false_alarms = run.others(set())
        r.details = run.details
        r.ms_per_tick = run.cost_ms()
        r.note = f"{seconds:.0f} s"
        run.close()
    return r


@contextlib.contextmanager
def agent_env() -> Iterator[dict[str, str]]:
    """A child environment that starts the in-process agent, with a private runtime directory."""
    from dlmon.agent.sitecustomize_hook import pythonpath_with_bootstrap

    d = tempfile.mkdtemp(prefix="dlmon-bench-agent-")
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = d
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath_with_bootstrap(os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    env.pop("DLMON_AGENT_DISABLE", None)
    try:
        yield env
    finally:
        if old is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old
        shutil.rmtree(d, ignore_errors=True)


def healthy(name: str, argv: list[str], seconds: float, interval: float, agent: bool = False) -> Result:
    """A healthy job run for minutes: every alert raised is a false alarm (target: 0)."""
    with contextlib.ExitStack() as stack:
        env = stack.enter_context(agent_env()) if agent else None
        proc = stack.enter_context(started(argv, env=env))
        run = Run(proc.pid, interval)
        run.run_for(seconds)
        r = Result(name, "(none)", false_alarms=run.others(set()), details=run.details)
        r.ms_per_tick = run.cost_ms()
        r.note = f"{seconds:.0f} s" + (", agent" if agent else "")
        run.close()
    return r


def page_cache_in_cgroup(seconds: float, interval: float) -> Result:
    """A job capped at 1.5 GiB streaming a 2.5 GiB file: its cgroup is full of page cache."""
    data = Path(tempfile.mkdtemp(prefix="dlmon-bench-")) / "stream.bin"
    with data.open("wb") as fh:
        fh.truncate(2560 * MIB)  # sparse: read through the page cache all the same
    reader = f"f=open({str(data)!r},'rb',buffering=0)\nprint('READY',flush=True)\n" + (
        "while True:\n f.seek(0)\n while f.read(1<<20): pass\n"
    )
    try:
        with memory_cgroup() as cg:
            (cg / "memory.limit_in_bytes").write_text(str(1536 * MIB))
            script = f'echo $$ > {cg}/cgroup.procs && exec {sys.executable} -c "$0"'
            with started(["sh", "-c", script, reader]) as proc:
                run = Run(proc.pid, interval)
                run.run_for(seconds)
                r = Result("page cache under a 1.5 GiB cgroup limit", "(none)", details=run.details)
                r.false_alarms = run.others(set())
                r.ms_per_tick = run.cost_ms()
                cg_last = run.snapshots[-1].cgroup
                ws = cg_last.working_set_bytes if cg_last is not None else None
                cache = cg_last.cache_bytes if cg_last is not None else None
                r.note = f"{seconds:.0f} s; working set {fmt_mib(ws)}, cache {fmt_mib(cache)}"
                run.close()
    finally:
        shutil.rmtree(data.parent, ignore_errors=True)
    return r


def fmt_mib(v: int | None) -> str:
    return "-" if v is None else f"{v / MIB:.0f} MiB"


def after_kill(name: str, kind: str, kill_main: bool, interval: float) -> Result:
    r = Result(name, kind)
    args = ["--store", "tensor", "--items", "100000", "--workers", "2", "--rate", "20", "--persistent"]
    with started([sys.executable, JOB, *args]) as proc:
        run = Run(proc.pid, interval)
        while len(run.tick().workers()) < 2:
            pass
        run.run_for(3.0)
        victim = proc.pid if kill_main else run.snapshots[-1].workers()[0].pid
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        run.run_for(12.0)
        first = run.first(kind)
        r.detected_after_s = None if first is None else first - killed
        # a killed worker's loader raises; orphans exit and may be zombies for a moment
        allowed = {kind, "zombie_worker", "worker_died"} if kill_main else {kind, "worker_died"}
        r.false_alarms = run.others(allowed)
        r.details = run.details
        r.ms_per_tick = run.cost_ms()
        run.close()
    return r


def io_load(interval: float) -> Result:
    r = Result("disk saturated (fio, 16 sync O_DIRECT readers)", "io_saturation")
    if shutil.which("fio") is None:
        r.note = "skipped: no fio"
        return r
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        fio = ["fio", "--name=b", f"--filename={tmp}/f.dat", "--size=512m", "--output=/dev/null"]
        subprocess.run([*fio, "--rw=write", "--bs=1m", "--end_fsync=1"], check=True, timeout=120)
        time.sleep(12)  # let the write's IO pressure decay out of PSI avg10
        load = "--rw=randread --direct=1 --bs=4k --numjobs=16 --ioengine=psync --time_based --runtime=40"
        with started([*fio, *load.split()], ready=False) as proc:
            t0 = time.monotonic()
            time.sleep(0.3)
            run = Run(proc.pid, interval)
            run.run_for(30.0, lambda s: bool(run.first("io_saturation")))
            first = run.first("io_saturation")
            r.detected_after_s = None if first is None else first - t0
            r.false_alarms = run.others({"io_saturation"})
            r.details = run.details
            r.ms_per_tick = run.cost_ms()
            utils = [d.util_percent for s in run.snapshots for d in s.disks if d.util_percent is not None]
            r.note = f"max %util {max(utils, default=0):.0f}"
            run.close()
    return r


def small_shm(interval: float) -> Result:
    r = Result("8 MiB /dev/shm (private mount namespace)", "shm_exhaustion")
    args = "--store big --items 100000 --workers 2 --batch 1 --rate 20 --tensor-bytes 1048576 --persistent"
    script = (
        f"mount -t tmpfs -o size=8m tmpfs /dev/shm && exec {sys.executable} {JOB} {args} --fill-shm 3000000"
    )
    with started(["unshare", "-m", "sh", "-c", script]) as proc:
        t0 = time.monotonic()
        run = Run(proc.pid, interval)
        run.run_for(10.0)
        first = run.first("shm_exhaustion")
        r.detected_after_s = None if first is None else first - t0
        r.false_alarms = run.others({"shm_exhaustion"})
        r.details = run.details
        r.ms_per_tick = run.cost_ms()
        run.close()
    return r


def oversubscribed(interval: float) -> Result:
    r = Result("6 workers x 4 threads on 2 cores", "oversubscription")
    args = [
        "--store",
        "busy",
        "--items",
        "100000",
        "--workers",
        "6",
        "--batch",
        "4",
        "--busy-threads",
        "4",
        "--persistent",
    ]
    with started([sys.executable, JOB, *args]) as proc:
        t0 = time.monotonic()
        run = Run(proc.pid, interval, cores=2)
        run.run_for(30.0)
        first = run.first("oversubscription")
        r.detected_after_s = None if first is None else first - t0
        r.false_alarms = run.others({"oversubscription"})
        r.details = run.details
        r.ms_per_tick = run.cost_ms()
        run.close()
    return r


# -- analyzer cost on a synthetic hour -------------------------------------------------------


def synthetic_hour() -> tuple[float, float, float, float, int]:
    """(mean, p99, max, max with the cyclic GC paused: ms/tick; bytes kept) for 3600 ticks of
    1 + 32 processes."""
    import gc

    from support.snapshots import MIB as S_MIB
    from support.snapshots import memory_snapshots

    costs = []
    a = Analyzer(cores=2)
    for s in memory_snapshots(3600, lambda i, t: 100 * S_MIB + (t % 60) * 0.1 * S_MIB, workers=32):
        start = time.thread_time()
        a(s)
        costs.append(time.thread_time() - start)
    # the same hour with the cyclic GC paused: its pauses land in whichever tick triggers them
    gc.collect()
    gc.disable()
    quiet = []
    c = Analyzer(cores=2)
    for s in memory_snapshots(3600, lambda i, t: 100 * S_MIB + (t % 60) * 0.1 * S_MIB, workers=32):
        start = time.thread_time()
        c(s)
        quiet.append(time.thread_time() - start)
    gc.enable()
    # what it keeps: replay the same hour under tracemalloc, snapshots made and dropped one by one
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    b = Analyzer(cores=2)
    for s in memory_snapshots(3600, lambda i, t: 100 * S_MIB + (t % 60) * 0.1 * S_MIB, workers=32):
        b(s)
    del s
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    costs.sort()
    return (
        1000 * statistics.fmean(costs),
        1000 * costs[int(0.99 * len(costs))],
        1000 * costs[-1],
        1000 * max(quiet),
        kept,
    )


# -- main ------------------------------------------------------------------------------------


def fmt(v: float | None, unit: str = " s", signed: bool = False) -> str:
    if v is None:
        return "-"
    return f"{v:+.1f}{unit}" if signed else f"{v:.1f}{unit}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", type=float, default=0.25)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--healthy-seconds", type=float, default=180.0, help="how long each healthy job runs")
    args = p.parse_args()
    iv = args.interval
    cor = "--store list --items 3000000 --workers 2 --batch 50 --rate 20 --shuffle --persistent --seconds 900"
    steady_args = "--items 3000000 --workers 2 --batch 50 --rate 20 --shuffle --persistent --seconds 900"
    main_leak = "--store tensor --items 100000 --workers 2 --rate 20 --persistent --seconds 900"
    scenarios: dict[str, Callable[[], Result]] = {
        "cor": lambda: leak_to_oom("copy-on-read, 3M str, 2 workers, to OOM", cor, 250 * MIB, iv),
        "main": lambda: leak_to_oom(
            "main process leaks 2 MiB/s, to OOM", f"{main_leak} --leak-main {2 * MIB}", 300 * MIB, iv
        ),
        "tensor": lambda: steady(
            "tensor-backed store, same loader",
            [sys.executable, JOB, "--store", "tensor", *steady_args.split()],
            90,
            iv,
        ),
        "zombie": lambda: after_kill("SIGKILL a worker", "zombie_worker", False, iv),
        "orphan": lambda: after_kill("SIGKILL the trainer", "orphan_worker", True, iv),
        "io": lambda: io_load(iv),
        "shm": lambda: small_shm(iv),
        "oversub": lambda: oversubscribed(iv),
    }
    fa = args.healthy_seconds
    mm = str(Path(tempfile.gettempdir()) / f"dlmon-bench-memmap-{os.getpid()}.u8")
    healthy_jobs: dict[str, Callable[[], Result]] = {
        "fa-memmap": lambda: healthy(
            "4 workers random-read a 1 GiB np.memmap",
            [sys.executable, JOB, "--store", "memmap", "--memmap", mm, "--workers", "4", "--batch", "8",
             "--rate", "20", "--shuffle", "--persistent", "--seconds", "3600"],
            fa, iv,
        ),
        "fa-startup": lambda: healthy(
            "3 s worker start-up, no persistent workers",
            [sys.executable, JOB, "--store", "tensor", "--items", "600", "--batch", "20", "--workers", "2",
             "--rate", "20", "--init-sleep", "3", "--seconds", "3600"],
            fa, iv, agent=True,
        ),
        "fa-warmup": lambda: healthy(
            "trainer loads 2 GiB in 30 s, then flat",
            [sys.executable, JOB, "--store", "tensor", "--items", "100000", "--workers", "2", "--rate", "20",
             "--persistent", "--preload", str(2048 * MIB), "--preload-seconds", "30", "--seconds", "3600"],
            fa, iv,
        ),
        "fa-cache": lambda: page_cache_in_cgroup(fa, iv),
    }  # fmt: skip
    scenarios.update(healthy_jobs)
    chosen = [k for k in (args.only if args.only is not None else list(scenarios)) if k in scenarios]
    results: list[Result] = []
    healthy_names: set[str] = set()
    for key in chosen:
        print(f"running {key} ...", file=sys.stderr, flush=True)
        try:
            results.append(scenarios[key]())
            if key in healthy_jobs:
                healthy_names.add(results[-1].name)
        except Exception as exc:  # one broken scenario must not lose the others' numbers
            results.append(Result(key, "?", note=f"failed: {type(exc).__name__}: {exc}"))
    print(f"\nInterval {iv} s, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}.\n")
    detections = [r for r in results if r.name not in healthy_names]
    header = "| scenario | expected alert | detected after | ETA error at first alert | ETA error halfway "
    if detections:
        print(header + "| OOM kill after | alerts of other kinds | analyzer ms/tick | note |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in detections:
        fa = str(len(r.false_alarms)) + (
            f" ({', '.join(sorted(set(r.false_alarms)))})" if r.false_alarms else ""
        )
        print(
            f"| {r.name} | {r.expected} | {fmt(r.detected_after_s)} | "
            f"{fmt(r.eta_first_error_s, signed=True)} | {fmt(r.eta_half_error_s, signed=True)} | "
            f"{fmt(r.oom_after_s)} | {fa} | "
            f"{fmt(r.ms_per_tick, '')} | {r.note} |"
        )
    healthy_results = [r for r in results if r.name in healthy_names]
    if healthy_results:
        print("\nFalse alarms: healthy jobs that must stay quiet (target: 0 alerts raised).\n")
        print("| healthy job | alerts raised | analyzer ms/tick | note |")
        print("|---|---:|---:|---|")
        for r in healthy_results:
            kinds = f" ({', '.join(sorted(set(r.false_alarms)))})" if r.false_alarms else ""
            print(f"| {r.name} | {len(r.false_alarms)}{kinds} | {fmt(r.ms_per_tick, '')} | {r.note} |")
    unexpected = [(r.name, d) for r in results for d in r.details if d.split()[0] not in r.expected]
    if unexpected:
        print("\nAlerts of other kinds, with their messages:\n")
        for name, d in unexpected:
            print(f"- {name}: {d}")
    if args.only is None or "cost" in (args.only or []):
        mean, p99, worst, worst_no_gc, kept = synthetic_hour()
        print("\n| Analyzer, synthetic 1 + 32 processes, 3600 ticks at 1 Hz | value |")
        print("|---|---:|")
        print(f"| CPU per tick, mean | {mean:.3f} ms |")
        print(f"| CPU per tick, p99 | {p99:.3f} ms |")
        print(f"| CPU per tick, max | {worst:.3f} ms |")
        print(f"| CPU per tick, max with Python's cyclic GC paused | {worst_no_gc:.3f} ms |")
        print(f"| memory kept after the hour | {kept / MIB:.1f} MiB |")


if __name__ == "__main__":
    main()
