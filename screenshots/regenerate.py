"""Regenerate every screenshot from real runs in tmux, saved with the dashboard's own key (``s``).

Run from anywhere (the dashboards run in the repository root, where ``screenshots/`` receives
what ``s`` saves); needs tmux and the CPU build of torch; about five minutes, unattended::

    python screenshots/regenerate.py                  # the whole set, then layout.json
    python screenshots/regenerate.py --only leak      # one run (no layout.json: the set is mixed)

The runs, each in its own tmux server:

- ``healthy``: ``dlmon demo`` at 160x50, then the same window resized to 80x24;
- ``leak``: ``dlmon demo --scenario leak`` until the memory_growth alert is up, then a worker's detail;
- ``death``: ``dlmon run`` of a real DataLoader job (screenshots/jobs/loader_job.py); one of its
  workers is SIGKILLed; the trainer dies of torch's error and the final frame has the verdict;
- ``ddp``: ``dlmon run -- python -m torch.distributed.run --nproc_per_node 2`` of a gloo DDP job
  (screenshots/jobs/ddp_job.py), two ranks with two workers each;
- ``cluster``: ``dlmon cluster`` over a two-node torchrun job, each node under ``dlmon run
  --prometheus`` in its own UTS namespace (``unshare -u``: needs root), node-b's loader slowed.

Whatever happens, every training a run started is killed (its process group, by the pid the
dashboard's header shows) before the next run starts. With the whole set done, the layout it was
made from is stored in ``layout.json`` (see layout.py): tests/ui/test_screenshots.py fails when the
dashboard's layout moves on without the screenshots.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))  # this checkout's dlmon, for layout.py and the runs

from layout import current_layout, store  # noqa: E402

# name -> what it shows (screenshots/README.md has the same table)
SHOTS = {
    "demo-healthy-160x50.svg": "healthy",
    "demo-healthy-80x24.svg": "healthy",
    "demo-leak-160x50.svg": "leak",
    "demo-leak-worker-detail.svg": "leak",
    "run-worker-killed-160x50.svg": "death",
    "run-ddp-160x50.svg": "ddp",
    "cluster-2-nodes-160x20.svg": "cluster",
}
RUNS = ("healthy", "leak", "death", "ddp", "cluster")
UP = re.compile(r"up (?:(\d+)h)?(?:(\d+)m)?(\d+)s")


class Shot:
    """One dashboard in one tmux server."""

    def __init__(self, name: str, command: str, size: tuple[int, int]) -> None:
        self.socket = f"dlmon-shots-{os.getpid()}-{name}"
        env = {**os.environ, "TERM": "xterm-256color", "PYTHONPATH": _pythonpath()}
        env.pop("NO_COLOR", None)
        geometry = ["-x", str(size[0]), "-y", str(size[1])]
        subprocess.run(
            ["tmux", "-L", self.socket, "new-session", "-d", "-s", "s", *geometry, f"{command}; sleep 60"],
            check=True,
            env=env,
            cwd=ROOT,
        )
        self.pids: set[int] = set()

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True).stdout

    def screen(self) -> str:
        text = self.tmux("capture-pane", "-p", "-t", "s")
        self.pids.update(int(p) for p in re.findall(r"│ pid (\d+) │", text))  # the training's, for the end
        return text

    def wait_for(self, what: str, found: Callable[[str], bool], timeout: float, soft: bool = False) -> str:
        """The screen once ``found`` says so; after ``timeout`` an error (``soft``: a note, and on)."""
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if found(screen):
                return screen
            time.sleep(0.5)
        if soft:
            print(f"{self.socket}: no {what} after {timeout:.0f} s; taking the shot anyway", flush=True)
            return screen
        raise SystemExit(f"{self.socket}: gave up waiting for {what} after {timeout:.0f} s:\n{screen}")

    def wait_up(self, seconds: float, timeout: float = 300.0) -> str:
        """Until the header says the training has been up ``seconds``."""
        return self.wait_for(f"up {seconds:.0f}s", lambda s: uptime(s) >= seconds, timeout)

    def keys(self, *keys: str) -> None:
        for key in keys:
            self.tmux("send-keys", "-t", "s", key)
            time.sleep(1.5)

    def save(self, name: str) -> None:
        started = time.time()
        self.tmux("send-keys", "-t", "s", "s")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            time.sleep(0.2)
            found = [p for p in HERE.glob("dlmon-*.svg") if p.stat().st_mtime >= started - 1]
            if found:
                time.sleep(0.3)  # written whole
                max(found, key=lambda p: p.stat().st_mtime).replace(HERE / name)
                print(f"wrote screenshots/{name}", flush=True)
                # its "screenshot saved" toast must not be in the next shot: wait for it to show, then go
                self.wait_for("the toast", lambda t: "screenshot saved" in t, 5, soft=True)
                self.wait_for("the toast to go", lambda t: "screenshot saved" not in t, 30)
                return
        raise SystemExit(f"no screenshot appeared for {name}:\n{self.screen()}")

    def resize(self, width: int, height: int) -> None:
        self.tmux("resize-window", "-t", "s", "-x", str(width), "-y", str(height))
        time.sleep(3.0)  # the dashboard re-lays out on SIGWINCH

    def close(self) -> None:
        self.screen()
        # `dlmon run`'s training outlives its dashboard by design; torchrun's ranks are in
        # sessions of their own: the whole tree, collected before anything in it is killed
        doomed = sorted({p for pid in self.pids for p in tree(pid)})
        self.tmux("kill-server")
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc's children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                todo.extend(int(c) for c in (task / "children").read_text().split())
    return out


def _pythonpath() -> str:
    rest = os.environ.get("PYTHONPATH", "")
    return f"{ROOT}{os.pathsep}{rest}" if rest else str(ROOT)


def uptime(screen: str) -> float:
    m = UP.search(screen)
    if m is None:
        return 0.0
    h, mins, s = (int(g or 0) for g in m.groups())
    return h * 3600.0 + mins * 60.0 + s


@contextlib.contextmanager
def shot(name: str, command: str, size: tuple[int, int] = (160, 50)) -> Iterator[Shot]:
    s = Shot(name, command, size)
    try:
        yield s
    finally:
        s.close()


def dlmon(*args: str) -> str:
    return " ".join([sys.executable, "-m", "dlmon", *args])


def healthy(seconds: float) -> None:
    with shot("healthy", dlmon("demo", "--workers", "4", "--duration", "900")) as s:
        s.wait_for("the workers", lambda t: re.search(r"worker\s+3\s+\d+", t) is not None, 120)
        s.wait_up(seconds)
        s.save("demo-healthy-160x50.svg")
        s.resize(80, 24)
        s.save("demo-healthy-80x24.svg")


def leak(seconds: float) -> None:
    with shot("leak", dlmon("demo", "--scenario", "leak", "--workers", "4", "--duration", "900")) as s:
        s.wait_for("the memory_growth alert", lambda t: re.search(r"Trend\s+PSS \+", t) is not None, 300)
        s.wait_up(seconds)  # a longer chart
        # the alert names the cause once every worker's USS has been read a few times
        s.wait_for("copy-on-read in the alert", lambda t: "copy-on-read" in t, 180, soft=True)
        s.save("demo-leak-160x50.svg")
        s.keys("down", "down", "enter")
        s.save("demo-leak-worker-detail.svg")


def workers_of(pid: int) -> list[int]:
    """The DataLoader workers (comm pt_data_worker) among ``pid``'s children."""
    out = []
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{child}/comm").read_text().strip() == "pt_data_worker":
                    out.append(int(child))
    return sorted(out)


def death(seconds: float) -> None:
    job = HERE / "jobs" / "loader_job.py"
    with shot("death", dlmon("run", str(job))) as s:
        s.wait_for("the workers", lambda t: re.search(r"worker\s+2\s+\d+", t) is not None, 120)
        s.wait_up(seconds)
        (trainer,) = s.pids
        victims = workers_of(trainer)  # persistent: the same 3 all along
        if len(victims) < 2:
            raise SystemExit(f"loader_job.py has workers {victims}, wanted 3")
        os.kill(victims[1], signal.SIGKILL)
        print(f"SIGKILLed worker pid {victims[1]} of the training (pid {trainer})", flush=True)
        s.wait_for("the final frame", lambda t: "exited" in t, 120)
        time.sleep(4.0)  # the last samples and the verdict in
        s.wait_for("the exit toast to go", lambda t: "last data stays on screen" not in t, 30, soft=True)
        s.save("run-worker-killed-160x50.svg")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def ddp(seconds: float) -> None:
    job = HERE / "jobs" / "ddp_job.py"
    run = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    with shot("ddp", dlmon("run", "--", sys.executable, *run, str(job))) as s:
        s.wait_for("both ranks", lambda t: "2 ranks" in t and t.count("ddp_job.py:") >= 2, 180)
        s.wait_up(seconds)
        s.keys("down", "space")  # the first rank's row, opened: its workers
        s.save("run-ddp-160x50.svg")


PORT_LINE = re.compile(r"serving Prometheus metrics on http://\S+?:(\d+)/metrics")


def cluster(seconds: float) -> None:
    """``dlmon cluster`` over a real two-node torchrun job (node ranks 0 and 1, rendezvous on
    127.0.0.1), each node under ``dlmon run --prometheus`` in its own UTS namespace (``unshare
    -u``, so the hosts are node-a and node-b), node-b's loader slow (tests/agent_scripts/
    ddp_straggler.py); the screen after ``seconds`` of its own refreshes (its trend columns), with
    node-b's ranks unfolded."""
    job = ROOT / "tests" / "agent_scripts" / "ddp_straggler.py"
    master = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": _pythonpath()}
    logs = Path(tempfile.mkdtemp(prefix="dlmon-shots-cluster-"))
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        for node_rank, host in enumerate(("node-a", "node-b")):
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank"]
            torchrun += [str(node_rank), "--nproc_per_node", "1", "--master_addr", "127.0.0.1"]
            torchrun += ["--master_port", str(master), str(job), "--seconds", "900", "--slow-rank", "1"]
            torchrun += ["--sleep-ms", "8"]
            inner = [sys.executable, "-m", "dlmon", "run", "--headless", "--prometheus", "127.0.0.1:0", "--"]
            with open(logs / f"{host}.err", "wb") as err:
                nodes.append(
                    subprocess.Popen(
                        [
                            "unshare",
                            "-u",
                            "sh",
                            "-c",
                            f"hostname {host} && exec {shlex.join(inner + torchrun)}",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        env=env,
                        cwd=ROOT,
                        start_new_session=True,
                    )
                )
        ports = []
        for host in ("node-a", "node-b"):
            deadline = time.monotonic() + 120
            while (m := PORT_LINE.search((logs / f"{host}.err").read_text())) is None:
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"{host}: no exporter after 120 s:\n{(logs / f'{host}.err').read_text()}"
                    )
                time.sleep(0.5)
            ports.append(m.group(1))
        command = dlmon("cluster", *(f"127.0.0.1:{p}" for p in ports), "--trend", f"{seconds:.0f}")
        with shot("cluster", command, size=(160, 20)) as s:
            s.wait_for("the straggler", lambda t: "rank 1 on node-b sets the pace" in t, 180)
            time.sleep(seconds)  # the trend columns fill with the screen's own refreshes
            s.wait_for("its cause", lambda t: "why:" in t and "not measured" not in t, 60, soft=True)
            s.keys("up", "enter")  # the cursor follows its node as the rows re-sort: up to node-b, the worst
            s.save("cluster-2-nodes-160x20.svg")
    finally:
        for node in nodes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="training time before each shot")
    parser.add_argument("--only", action="append", choices=RUNS, help="one run only (repeatable)")
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        raise SystemExit("needs tmux")
    only = args.only or list(RUNS)
    started = time.monotonic()
    for stale in HERE.glob("dlmon-*.svg"):  # a half-finished earlier run's unrenamed screenshot
        stale.unlink()
    runs: dict[str, Callable[[float], None]] = {
        "healthy": healthy,
        "leak": leak,
        "death": death,
        "ddp": ddp,
        "cluster": cluster,
    }
    for name in only:
        runs[name]({"leak": 1.5, "death": 0.5}.get(name, 1.0) * args.seconds)
    if set(only) == set(RUNS):
        store(current_layout())
        print("wrote screenshots/layout.json (the layout this set was made from)", flush=True)
    print(f"done in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
