"""The dashboard's CPU next to htop's, watching the same DataLoader-like tree in the same minute.

Builds the tree of ``benchmarks/sampler.py`` (1 main that fills ``--gib`` GiB + ``--workers``
workers named ``pt_data_worker`` that share it), then starts, each in its own tmux session of
the same size and at the same time:

- **dlmon**: the dashboard on a live source at 1 Hz (the tiny launcher below, until
  ``dlmon attach`` starts the dashboard itself);
- **htop**: ``htop -d 10 -p <the tree's pids>`` (1 Hz, the same processes, default config);
- optionally (``--naive``) a naive Textual app that refreshes a 33x10 DataTable once a second;
- optionally (``--htop-pss``) htop showing PSS and swap columns, i.e. the information dlmon
  shows: it reads every process's smaps_rollup every second (dlmon reads them on a budget).

After a warm-up, it reads each process's CPU time (utime + stime from /proc/PID/stat, all
threads) at the start and the end of the same window and prints CPU seconds per minute, the
ratio to htop, a markdown table, and for dlmon the split between the sampling thread and the
UI. It also reports the time to the first frame and to the first data (polling capture-pane)
and dlmon's RSS at the start and the end of the window.

The tree's memory stands still unless ``--moving`` (one worker faults in 64 MiB/s); ``--busy F``
makes every worker compute F of a core without touching memory. The default warm-up (45 s)
covers the first PSS reading of every process, which the budget spreads over ~30 s at 32 x 1 GiB
on this VM (~14 ms per read); a shorter one measures part of that one-off fill.

    python benchmarks/dashboard_cpu.py                    # 32 workers x 1 GiB, 60 s window
    python benchmarks/dashboard_cpu.py --busy 0.02        # ... each computing 2% of a core
    python benchmarks/dashboard_cpu.py --moving           # ... one of them faulting memory in
    python benchmarks/dashboard_cpu.py --workers 8 --gib 0.25 --seconds 20 --warmup 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampler import build_tree  # the sibling benchmark's tree builder

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SOCKET = f"dlmon-bench-{os.getpid()}"
LAUNCHER = (
    "from dlmon.ui import run_dashboard; from dlmon.flow.sources import LiveSource; "
    "run_dashboard(LiveSource({pid}))"
)
HTOPRC_PSS = """htop_version=3.2.2
config_reader_min_version=3
delay=10
screen:Main=PID USER STATE PERCENT_CPU M_RESIDENT M_PSS M_SWAP Command
.sort_key=PERCENT_CPU
.sort_direction=-1
"""
NAIVE_APP = r"""
import random, sys
from textual.app import App
from textual.widgets import DataTable
class Naive(App):
    def compose(self):
        yield DataTable()
    def on_mount(self):
        t = self.query_one(DataTable)
        for c in range(10):
            t.add_column(f"c{c}", key=f"c{c}")
        for r in range(33):
            t.add_row(*["0"] * 10, key=str(r))
        self.set_interval(1.0, self.tick)
    def tick(self):
        t = self.query_one(DataTable)
        for r in range(33):
            for c in range(10):
                t.update_cell(str(r), f"c{c}", f"{random.random() * 100:.1f}")
Naive().run()
"""


def tmux(*args: str, check: bool = True) -> str:
    out = subprocess.run(["tmux", "-L", SOCKET, *args], capture_output=True, text=True, check=check)
    return out.stdout


def start(name: str, command: str, width: int, height: int, env: dict[str, str]) -> int:
    exports = " ".join(f"{k}={v}" for k, v in env.items())
    tmux(
        "new-session", "-d", "-s", name, "-x", str(width), "-y", str(height), f"exec env {exports} {command}"
    )
    return int(tmux("list-panes", "-t", name, "-F", "#{pane_pid}").strip())


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads of one name added up)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                raw = fh.read()
        except OSError:
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return out


def tree_memory(pids: list[int]) -> tuple[int, int]:
    """Page faults (minor + major) and RSS pages summed over the tree: what dlmon calls movement."""
    faults = pages = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        faults += int(fields[7]) + int(fields[9])
        pages += int(fields[21])
    return faults, pages


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def wait_for(name: str, needle: str, started: float, timeout: float = 30.0) -> float | None:
    while time.monotonic() - started < timeout:
        if needle in tmux("capture-pane", "-p", "-t", name, check=False):
            return time.monotonic() - started
        time.sleep(0.02)
    return None


def tree_pids(main_pid: int) -> list[int]:
    pids = [main_pid]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            if ppid == main_pid:
                pids.append(int(entry))
    return sorted(pids)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    parser.add_argument("--warmup", type=float, default=45.0, help="seconds before the window")
    parser.add_argument("--size", default="160x50", help="terminal size of each session, WxH")
    parser.add_argument(
        "--busy",
        type=float,
        default=0.0,
        help="fraction of a core each worker (but a --moving one) computes, 0 <= F < 1 (0: idle)",
    )
    parser.add_argument(
        "--moving", action="store_true", help="one worker faults in 64 MiB/s (its memory moves)"
    )
    parser.add_argument("--naive", action="store_true", help="also run a naive DataTable app")
    parser.add_argument("--htop-pss", action="store_true", help="also run htop with PSS columns")
    parser.add_argument(
        "--rss-every", type=float, default=0.0, help="print dlmon's RSS every this many seconds of the window"
    )
    args = parser.parse_args()
    if not 0.0 <= args.busy < 1.0:
        parser.error("--busy takes a fraction of a core, 0 <= F < 1")
    if shutil.which("tmux") is None or shutil.which("htop") is None:
        sys.exit("needs tmux and htop")
    width, height = (int(v) for v in args.size.split("x"))

    t0 = time.monotonic()
    main_pid = build_tree(args.workers, args.gib, moving_worker=args.moving, busy=args.busy)
    pids = tree_pids(main_pid)
    print(
        f"tree: 1 main + {len(pids) - 1} workers sharing {args.gib} GiB, each busy {args.busy:.0%}"
        f"{', one moving' if args.moving else ''}, "
        f"built in {time.monotonic() - t0:.1f} s; terminal {width}x{height}"
    )
    home = tempfile.mkdtemp(prefix="dlmon-bench-")  # htop with its default config
    env = {"TERM": "xterm-256color", "HOME": home, "LANG": "C.UTF-8"}
    runs: dict[str, int] = {}
    try:
        launched = time.monotonic()
        runs["dlmon"] = start(
            "dlmon", f"{sys.executable} -c '{LAUNCHER.format(pid=main_pid)}'", width, height, env
        )
        runs["htop"] = start("htop", f"htop -d 10 -p {','.join(map(str, pids))}", width, height, env)
        if args.htop_pss:
            rc = Path(home) / "htoprc-pss"
            rc.write_text(HTOPRC_PSS)
            runs["htop with PSS columns"] = start(
                "htop-pss",
                f"htop -d 10 -p {','.join(map(str, pids))}",
                width,
                height,
                {**env, "HTOPRC": str(rc)},
            )
        if args.naive:
            script = Path(home) / "naive.py"
            script.write_text(NAIVE_APP)
            runs["naive DataTable app"] = start("naive", f"{sys.executable} {script}", width, height, env)
        first_frame = wait_for("dlmon", "dlmon", launched)
        first_data = wait_for("dlmon", f"{len(pids)} processes", launched)  # the table's caption
        print(f"dlmon: first frame after {_s(first_frame)}, first data after {_s(first_data)}")
        time.sleep(max(0.0, args.warmup - (time.monotonic() - launched)))

        memory_before = tree_memory(pids)
        before = {name: cpu_seconds(pid) for name, pid in runs.items()}
        threads_before = thread_cpu(runs["dlmon"])
        rss_before = rss_mib(runs["dlmon"])
        window_start = time.monotonic()
        if args.rss_every > 0:  # the dashboard's memory over a long window: flat, or a leak
            print("| minute of the window | dlmon RSS MiB |")
            print("|---:|---:|")
            while time.monotonic() - window_start < args.seconds:
                time.sleep(min(args.rss_every, max(0.0, args.seconds - (time.monotonic() - window_start))))
                minute = (time.monotonic() - window_start) / 60
                print(f"| {minute:.1f} | {rss_mib(runs['dlmon']):.1f} |", flush=True)
        else:
            time.sleep(args.seconds)
        elapsed = time.monotonic() - window_start
        after = {name: cpu_seconds(pid) for name, pid in runs.items()}
        memory_after = tree_memory(pids)
        threads_after = thread_cpu(runs["dlmon"])
        rss_after = rss_mib(runs["dlmon"])
        screen = tmux("capture-pane", "-p", "-t", "dlmon")

        tmux("send-keys", "-t", "dlmon", "q")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(runs["dlmon"]):
            time.sleep(0.1)
        quit_ok = not _alive(runs["dlmon"])
    finally:
        tmux("kill-server", check=False)
        os.killpg(main_pid, signal.SIGKILL)
        os.waitpid(main_pid, 0)
        shutil.rmtree(home, ignore_errors=True)

    per_min = {name: (after[name] - before[name]) * 60.0 / elapsed for name in runs}
    sampler = (
        (threads_after.get("dlmon-sampler", 0.0) - threads_before.get("dlmon-sampler", 0.0)) * 60 / elapsed
    )
    ui = per_min["dlmon"] - sampler
    htop = per_min["htop"]
    print(f"window: {elapsed:.1f} s; dlmon quit with q: {'yes' if quit_ok else 'NO'}")
    faults, pages = (after_ - before_ for after_, before_ in zip(memory_after, memory_before, strict=True))
    print(
        f"the tree over the window: {faults} page faults, RSS {pages:+d} pages "
        f"({'stood still' if not faults and not pages else 'moved'})"
    )
    print(f"dlmon RSS: {rss_before:.1f} MiB at the start of the window, {rss_after:.1f} MiB at the end")
    print()
    print("| process (1 Hz, same tree, same minute) | CPU-s per minute | % of one core | vs htop |")
    print("|---|---:|---:|---:|")
    rows = [
        ("dlmon dashboard, whole process", per_min["dlmon"]),
        ("  of which the sampling thread", sampler),
        ("  of which the UI (everything else)", ui),
        ("htop -d 10 -p <tree>", htop),
    ]
    if "htop with PSS columns" in per_min:
        rows.append(("htop -d 10 -p <tree>, PSS + swap columns", per_min["htop with PSS columns"]))
    if "naive DataTable app" in per_min:
        rows.append(("naive Textual DataTable app (33x10)", per_min["naive DataTable app"]))
    for name, value in rows:
        print(f"| {name} | {value:.2f} | {value / 60 * 100:.2f}% | {value / htop:.2f}x |")
    print()
    print(f"dlmon / htop = {per_min['dlmon'] / htop:.2f} (whole process); UI only / htop = {ui / htop:.2f}")
    if "dlmon" not in screen or str(main_pid) not in screen:
        print("warning: the dlmon screen did not show the tree:\n" + screen)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


if __name__ == "__main__":
    main()
