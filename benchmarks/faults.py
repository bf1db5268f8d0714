"""Each fault against a real training job (tests/faults/job.py), with the training's own batches/s
measured without and with the fault, alternating so drift in machine load hits both alike.

    python benchmarks/faults.py [--seconds 4] [--rounds 2]

Prints: fault | what dlmon did | what was lost | batches/s without | with. The pass/fail versions of
these runs are tests/faults/; this prints figures for docs/reliability.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from dlmon.collect.agent_client import REQUEST, AgentClient  # noqa: E402
from dlmon.flow.sources import read_record  # noqa: E402
from faults.support import Job, dlmon_record, env_with_dlmon, record_lines, wait_until  # noqa: E402

Fault = Callable[[Job, Path], "contextlib.AbstractContextManager[dict[str, str]]"]


@contextlib.contextmanager
def recording(job: Job, work: Path) -> Iterator[dict[str, str]]:
    out = work / "rec.jsonl"
    result: dict[str, str] = {}
    with dlmon_record(job.pid, out, 0.1):
        yield result
    replay = read_record(str(out))
    result["did"] = f"recorded {len(replay.snapshots)} snapshots at 10 Hz"
    result["lost"] = f"{len(replay.problems)} bad lines"


@contextlib.contextmanager
def stopped(job: Job, work: Path) -> Iterator[dict[str, str]]:
    out = work / "stop.jsonl"
    result: dict[str, str] = {}
    with dlmon_record(job.pid, out, 0.1):
        wait_until(lambda: out.exists() and out.stat().st_size > 0, 60, "a record line")
        os.killpg(job.pid, signal.SIGSTOP)
        time.sleep(8)
        os.killpg(job.pid, signal.SIGCONT)
        yield result
    snaps = read_record(str(out)).snapshots
    shown = sum(1 for s in snaps for p in s.processes if p.pid == s.target.pid and p.state == "T")
    dead = sum(1 for s in snaps if not s.target.alive)
    kinds = {a.kind for s in snaps for a in s.alerts}
    result["did"] = f"{shown} ticks 'stopped', {dead} 'exited', alerts {sorted(kinds) or 'none'}"
    result["lost"] = "nothing" if dead == 0 else f"{dead} false deaths"


@contextlib.contextmanager
def killed_recorder(job: Job, work: Path) -> Iterator[dict[str, str]]:
    counts = {"whole": 0, "torn": 0}
    result: dict[str, str] = {}

    def kills() -> None:  # during the measuring window
        for k in range(3):
            out = work / f"kill{k}.jsonl"
            with dlmon_record(job.pid, out, 0.1) as rec:
                wait_until(lambda out=out: out.exists() and out.stat().st_size > 0, 60, "a record line")
                time.sleep(0.3 + 0.2 * k)
                rec.send_signal(signal.SIGKILL)
                rec.wait()
            for line in record_lines(out):
                try:
                    json.loads(line)
                    counts["whole"] += 1
                except ValueError:
                    counts["torn"] += 1

    thread = threading.Thread(target=kills)
    thread.start()
    yield result
    thread.join()
    result["did"] = f"3 SIGKILLs mid-record: {counts['whole']} whole lines"
    result["lost"] = f"{counts['torn']} torn last lines (replay skips and reports them)"


@contextlib.contextmanager
def socket_abuse(job: Job, work: Path) -> Iterator[dict[str, str]]:
    path = AgentClient.find_socket(job.pid)
    result: dict[str, str] = {}
    if path is None:
        result.update(did="no agent socket", lost="n/a")
        yield result
        return
    stop = threading.Event()
    replies = [0]

    def client() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(path)
                s.sendall(REQUEST)
                if s.recv(65536):
                    replies[0] += 1

    def garbage() -> None:
        while not stop.is_set():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            with contextlib.suppress(OSError):
                s.connect(path)
                s.send(os.urandom(100) + b"\n")
            s.close()
            time.sleep(0.0005)

    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(path)
    threads = [threading.Thread(target=client, daemon=True) for _ in range(50)]
    threads.append(threading.Thread(target=garbage, daemon=True))
    for t in threads:
        t.start()
    yield result
    stop.set()
    for t in threads:
        t.join(10)
    silent.close()
    answered = AgentClient().poll(job.pid) is not None
    result["did"] = f"served {replies[0]} replies to 50 clients; answers dlmon after: {answered}"
    result["lost"] = "nothing" if answered else "agent stopped answering"


FAULTS: dict[str, Fault] = {
    "dlmon recording at 10 Hz (no fault)": recording,
    "target SIGSTOPped 8 s, continued": stopped,
    "dlmon SIGKILLed mid-record": killed_recorder,
    "agent socket: 50 clients + garbage + a silent client": socket_abuse,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0, help="measuring window per run")
    ap.add_argument("--rounds", type=int, default=2, help="alternating without/with runs per fault")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dlmon-faults-"))
    os.chmod(work, 0o755)
    env = env_with_dlmon({"XDG_RUNTIME_DIR": str(work)})
    rows = []
    with Job({"workers": 2, "persistent": True, "agent": True}, env=env) as job:
        job.wait_batches(50)
        for name, fault in FAULTS.items():
            without: list[float] = []
            with_fault: list[float] = []
            result: dict[str, str] = {}
            for _ in range(args.rounds):
                without.append(job.measure(args.seconds))
                with fault(job, work) as outcome:
                    t0 = time.monotonic()
                    time.sleep(args.seconds)
                    rate = job.rate(t0, time.monotonic())
                with_fault.append(rate or 0.0)
                result = outcome
            rows.append((name, result.get("did", ""), result.get("lost", ""),
                         statistics.median(without), statistics.median(with_fault)))  # fmt: skip
    print("| fault | what dlmon did | what was lost | batches/s without | with |")
    print("|---|---|---|---|---|")
    for name, did, lost, a, b in rows:
        print(f"| {name} | {did} | {lost} | {a:.0f} | {b:.0f} ({100 * (b - a) / a:+.0f}%) |")


if __name__ == "__main__":
    main()
