"""The in-process agent (dlmon.agent) and its client, with real DataLoaders in real subprocesses.

Every training script runs as a child process with the agent's bootstrap directory on
PYTHONPATH (or calls dlmon.agent.start() itself), reports its own truth on stdout, and waits
on stdin while the test polls its agent. Sockets live under a private XDG_RUNTIME_DIR.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dlmon.agent import _paths, wire
from dlmon.agent._server import Server, _cuda_figures, parse_host_memory_stats
from dlmon.agent.sitecustomize_hook import (
    bootstrap_dir,
    is_multiprocessing_helper,
    pythonpath_with_bootstrap,
)
from dlmon.collect.agent_client import AgentClient, AgentReading, TorchDeviceMemory, merge_torch_memory
from dlmon.model.snapshot import GpuDevice
from support.agent import counters_reply, loader_reply, private_agent_env
from support.paths import ROOT, TESTS

SCRIPTS = TESTS / "agent_scripts"
TRAIN = str(SCRIPTS / "train.py")
IDLE = str(SCRIPTS / "idle.py")


# ---------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, str]]:
    """A private XDG_RUNTIME_DIR for the whole module (the client reads the same variable)."""
    with private_agent_env("dlmon-agent-test-") as e:
        yield e


class Proc:
    """A child Python process speaking the ``@@ {json}`` event protocol of tests/agent_scripts."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(SCRIPTS),
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read_out, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()
        self.pid = self.p.pid

    def _read_out(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith("@@ "):
                self.events.put(json.loads(line[3:]))

    def _read_err(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.stderr.append(line)

    def expect(self, ev: str, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                got = self.events.get(timeout=max(0.01, left))
            except queue.Empty:
                pytest.fail(
                    f"no {ev!r} event within {timeout}s; rc={self.p.poll()} stderr:\n{''.join(self.stderr)}"
                )
            if got["ev"] == ev:
                return got

    def send(self, cmd: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()

    def finish(self, cmd: str = "exit", timeout: float = 30.0) -> int:
        try:
            self.send(cmd)
            self.p.stdin.close()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            pass
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.p.poll() is None:
            try:
                self.finish()
            except Exception:
                self.p.kill()
                self.p.wait()


def train(cfg: dict[str, Any], env: dict[str, str]) -> Proc:
    return Proc([TRAIN, json.dumps(cfg)], env)


def raw(pid: int, client: AgentClient | None = None) -> dict[str, Any]:
    got = (client or AgentClient()).read_raw([pid])
    assert pid in got, f"agent of {pid} did not answer"
    return got[pid]


def wait_for_socket(pid: int, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = AgentClient.find_socket(pid)
        if path is not None:
            return path
        time.sleep(0.02)
    pytest.fail(f"no agent socket for pid {pid}")


def ask(path: str, payload: bytes, timeout: float = 2.0) -> bytes:
    """Send raw bytes, read until EOF or a newline."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        if payload:
            s.sendall(payload)
        buf = b""
        while not buf.endswith(b"\n"):
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:  # closed with our bytes unread: a reset, not a FIN
                break
            if not chunk:
                break
            buf += chunk
        return buf
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------
# measurement against the scripts' own truth


def _window(log: list[list[int]], t1: int, t2: int) -> tuple[int, int, int]:
    """(batches, wait_ns, compute_ns) the script measured for batches returned in (t1, t2]."""
    n = wait = compute = 0
    for i, (t_call, t_ret, _w, _s) in enumerate(log):
        if t1 < t_ret <= t2:
            n += 1
            if i > 0:  # the first batch of the epoch is start-up, not steady state
                wait += t_ret - t_call
                compute += t_call - log[i - 1][1]
    return n, wait, compute


@pytest.mark.parametrize(
    ("num_workers", "sample_sleep_s", "step_sleep_s"),
    [(0, 0.0025, 0.010), (1, 0.005, 0.010), (4, 0.010, 0.005)],
    ids=["workers0", "workers1", "workers4"],
)
def test_rates_wait_fraction_pids_and_batches_per_worker(
    env: dict[str, str], num_workers: int, sample_sleep_s: float, step_sleep_s: float
) -> None:
    # batch of 4: each worker makes a batch in 4 * sample_sleep; the step sleeps step_sleep.
    # All three are built so that the data wait is about half of each step (0.5).
    cfg = {
        "mode": "rate",
        "num_workers": num_workers,
        "batch_size": 4,
        "sample_sleep_s": sample_sleep_s,
        "step_sleep_s": step_sleep_s,
        "run_s": 2.2,
    }
    client = AgentClient()
    with train(cfg, env) as p:
        started = p.expect("started")
        time.sleep(0.3)
        raw1 = client.read_raw([p.pid])
        first = client.convert(raw1)
        time.sleep(1.3)
        raw2 = client.read_raw([p.pid])
        second = client.convert(raw2)
        done = p.expect("done")
        final = raw(p.pid)

    assert first.loaders and first.loaders[0].batches_per_s is None  # no rate on the first poll
    assert first.loaders[0].data_wait_fraction is None
    (ls,) = second.loaders
    t1, t2 = raw1[p.pid]["time_ns"], raw2[p.pid]["time_ns"]
    n, wait, compute = _window(done["log"], t1, t2)
    script_rate = n / ((t2 - t1) / 1e9)
    assert ls.batches_per_s is not None and ls.samples_per_s is not None
    assert abs(ls.batches_per_s - script_rate) <= 0.05 * script_rate, (ls.batches_per_s, script_rate)
    assert abs(ls.samples_per_s - 4 * script_rate) <= 0.05 * 4 * script_rate
    truth = wait / (wait + compute)
    assert ls.data_wait_fraction is not None
    assert abs(ls.data_wait_fraction - truth) <= 0.05, (ls.data_wait_fraction, truth)
    assert abs(truth - 0.5) <= 0.2, f"the set-up itself is off: the script measured {truth:.2f}"

    # names, settings, pids
    assert ls.name == f"train.py:{started['site']}"
    assert ls.num_workers == num_workers and ls.batch_size == 4
    assert first.loaders[0].worker_pids == tuple(started["worker_pids"])
    assert len(ls.worker_pids) == num_workers
    assert first.num_threads.get(p.pid) == started["num_threads"]

    # cumulative totals equal the script's own counts
    (fl,) = final["loaders"]
    log = done["log"]
    assert fl["batches_total"] == len(log)
    assert fl["samples_total"] == sum(row[3] for row in log)
    per_worker = Counter(row[2] for row in log)
    assert fl["batches_per_worker"] == [per_worker.get(w, 0) for w in range(num_workers)]
    assert fl["epochs_started"] == 1 and fl["epochs"] == 0
    assert fl["startup_wait_ns_total"] > 0
    assert final.get("injected_unix_time", "missing") is None  # started with the job: counts from its start
    script_wait = sum(r[1] - r[0] for r in log[1:])
    assert abs(fl["wait_ns_total"] - script_wait) <= 0.05 * script_wait
    if num_workers:
        assert fl["multiprocessing_context"] == "fork"


def test_worker_killed_by_sigkill_is_reported(env: dict[str, str]) -> None:
    client = AgentClient()
    with train({"mode": "kill"}, env) as p:
        pids = p.expect("pids")["worker_pids"]
        victim = pids[0]
        os.kill(victim, signal.SIGKILL)
        caught = p.expect("caught")
        r = raw(p.pid, client)
        reading = client.convert({p.pid: r})
    assert str(victim) in caught["message"]  # torch's own message
    deaths = [d for d in r["worker_deaths"] if d["pid"] == victim]
    assert len(deaths) == 1, r["worker_deaths"]
    (d,) = deaths
    assert d["signal"] == signal.SIGKILL and d["signal_name"] == "SIGKILL" and d["exit_code"] is None
    assert d["worker_id"] == 0 and d["loader_id"] == r["loaders"][0]["id"]
    assert d["time_ns"] <= caught["t"], "the death must be recorded before torch raises"
    assert "sigchld" in r["hooks"]
    (wd,) = [w for w in reading.worker_deaths if w.pid == victim]
    assert wd.signal == 9 and wd.reported_by == p.pid and wd.loader_id == f"{p.pid}:{d['loader_id']}"


def test_train_and_val_loaders_side_by_side(env: dict[str, str]) -> None:
    with train({"mode": "trainval"}, env) as p:
        mid = p.expect("mid")
        r_mid = raw(p.pid)
        p.send("go")
        done = p.expect("done")
        r_end = raw(p.pid)
    assert len(r_mid["loaders"]) == 2
    by_workers = {ld["num_workers"]: ld for ld in r_mid["loaders"]}
    assert by_workers[2]["worker_pids"] == mid["train_pids"]
    assert by_workers[1]["worker_pids"] == mid["val_pids"]
    assert not set(mid["train_pids"]) & set(mid["val_pids"])
    by_name = {ld["name"]: ld for ld in r_end["loaders"]}
    train_ld = by_name[f"train.py:{done['train_site']}"]
    val_ld = by_name[f"train.py:{done['val_site']}"]
    assert train_ld["batches_total"] == done["train_batches"] == 60
    assert val_ld["batches_total"] == done["val_batches"] == 20
    assert train_ld["samples_total"] == 240 and val_ld["samples_total"] == 40
    assert sum(train_ld["batches_per_worker"]) == 60 and sum(val_ld["batches_per_worker"]) == 20
    assert train_ld["id"] != val_ld["id"]


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "non_persistent"])
def test_three_epochs_persistent_and_not(env: dict[str, str], persistent: bool) -> None:
    seen: list[list[int]] = []
    with train({"mode": "epochs", "persistent": persistent}, env) as p:
        for epoch in range(3):
            mid = p.expect("mid")
            assert mid["epoch"] == epoch
            (ld,) = raw(p.pid)["loaders"]
            assert ld["worker_pids"] == mid["worker_pids"]
            assert ld["epochs"] == epoch and ld["epochs_started"] == epoch + 1
            seen.append(mid["worker_pids"])
            p.send("go")
        done = p.expect("done")
        (ld,) = raw(p.pid)["loaders"]
    assert done["batches"] == ld["batches_total"] == 18
    assert ld["epochs"] == 3 and ld["epochs_started"] == 3
    assert ld["persistent_workers"] is persistent
    assert sum(ld["batches_per_worker"]) == 18
    if persistent:
        assert seen[0] == seen[1] == seen[2]
        assert ld["worker_pids"] == seen[0]  # persistent workers outlive the epoch
        assert len(ld["iterators"]) == 1
    else:
        assert len({p for pids in seen for p in pids}) == 6  # new workers every epoch
        assert ld["worker_pids"] == []  # shut down at the end of each epoch


@pytest.mark.slow
def test_spawned_workers_do_not_serve(env: dict[str, str]) -> None:
    with train({"mode": "spawn"}, env) as p:
        mid = p.expect("mid", timeout=90)
        (ld,) = raw(p.pid)["loaders"]
        assert ld["worker_pids"] == mid["worker_pids"]
        assert ld["multiprocessing_context"] == "spawn"
        for wpid in mid["worker_pids"]:
            assert AgentClient.find_socket(wpid) is None
        p.send("go")
        p.expect("done")


def test_hooks_survive_odd_batches_and_broken_state(env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "odd.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, sys
            import dlmon.agent
            dlmon.agent.start()
            import torch
            from torch.utils.data import DataLoader
            words = DataLoader(["a", "b", "c", "d", "e"], batch_size=2)
            dicts = DataLoader([{"x": torch.zeros(3)} for _ in range(5)], batch_size=2)
            single = DataLoader(torch.zeros(5, 3), batch_size=None)
            assert [len(b) for b in words] == [2, 2, 1]
            assert [b["x"].shape[0] for b in dicts] == [2, 2, 1]
            assert len(list(single)) == 5
            it = iter(DataLoader(list(range(6)), batch_size=3))
            it._dlmon_st = object()  # corrupted agent state: iteration must go on regardless
            assert [b.tolist() for b in it] == [[0, 1, 2], [3, 4, 5]]
            # torch before _process_data(self, data, worker_idx): batches per worker from _task_info
            import torch.utils.data.dataloader as d
            from dlmon.agent import _hooks
            cls = d._MultiProcessingDataLoaderIter
            cls._process_data = cls._process_data.__dlmon_orig__
            cls._next_data = _hooks._make_next_data_task_info(cls._next_data)
            class WorkerId(torch.utils.data.Dataset):
                def __len__(self): return 20
                def __getitem__(self, i): return torch.utils.data.get_worker_info().id
            seen = [0, 0]
            for b in DataLoader(WorkerId(), batch_size=2, num_workers=2): seen[int(b[0])] += 1
            c = dlmon.agent.counters()
            out = {l["name"]: [l["batches_total"], l["samples_total"], l["epochs"]] for l in c["loaders"]}
            out["per_worker"] = [seen, c["loaders"][-1]["batches_per_worker"]]
            print(json.dumps(out))
            """
        )
    )
    e = dict(env)
    e["PYTHONPATH"] = str(ROOT)  # no bootstrap: the script starts the agent itself
    out = subprocess.run([sys.executable, str(script)], env=e, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["odd.py:7"] == [3, 6, 1]  # list of str: counted by batch_size (the last one is short)
    assert got["odd.py:8"] == [3, 5, 1]  # dict of tensors: the first tensor's first dimension
    assert got["odd.py:9"] == [5, 5, 1]  # no batching: one sample per item
    seen, counted = got["per_worker"]
    assert counted == seen and sum(seen) == 10


def test_loader_iterated_before_start_is_picked_up(env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "late.py"
    script.write_text(
        textwrap.dedent(
            """
            import json
            import torch
            from torch.utils.data import DataLoader
            it = iter(DataLoader(torch.zeros(10, 2), batch_size=2))
            next(it)
            import dlmon.agent
            dlmon.agent.start()  # torch.utils.data is imported already: patched at once
            rest = sum(1 for _ in it)
            (l,) = dlmon.agent.counters()["loaders"]
            print(json.dumps([rest, l["name"], l["site"], l["batches_total"], l["epochs"]]))
            """
        )
    )
    e = dict(env)
    e["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(script)], env=e, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [4, "late.py:9", "first_iterated", 4, 1]


# ---------------------------------------------------------------------------------------------
# a process that never imports torch; transport and safety


@pytest.fixture(scope="module")
def idle(env: dict[str, str]) -> Iterator[Proc]:
    with Proc([IDLE], env) as p:
        p.expect("ready")
        wait_for_socket(p.pid)
        yield p


def test_no_torch_means_no_loaders_and_no_torch_import(idle: Proc) -> None:
    r = raw(idle.pid)
    assert r["pid"] == idle.pid
    assert r["torch_imported"] is False and r["torch_version"] is None
    assert r["hooks_patched"] is False and r["loaders"] == [] and r["cuda"] == [] and r["pinned"] is None
    idle.send("modules")
    assert idle.expect("modules")["torch"] is False
    reading = AgentClient().poll(idle.pid)
    assert reading is not None and reading.pids == (idle.pid,)
    assert reading.loaders == () and reading.pinned is None and reading.devices == ()
    assert dict(reading.torch_versions) == {idle.pid: None}


def test_socket_dir_is_private_and_named_by_pid(idle: Proc) -> None:
    path = wait_for_socket(idle.pid)
    assert path == _paths.socket_path(idle.pid)
    assert os.path.dirname(path) == os.path.join(os.environ["XDG_RUNTIME_DIR"], "dlmon")
    st = os.stat(os.path.dirname(path))
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to setuid a child")
def test_socket_refuses_another_uid(idle: Proc, tmp_path: Path) -> None:
    path = wait_for_socket(idle.pid)
    # The 0700 directory already keeps other users away from the socket. To reach the agent's
    # second line of defence (SO_PEERCRED), open a hole on purpose: a hard link to the socket
    # in a world-accessible directory on the same filesystem, with the inode made 0666.
    hole = tempfile.mkdtemp(dir=os.path.dirname(os.path.dirname(path)))
    os.chmod(hole, 0o755)
    link = os.path.join(hole, "hole.sock")
    os.link(path, link)
    os.chmod(link, 0o666)
    try:
        assert json.loads(ask(link, b'{"get": "counters"}\n'))["pid"] == idle.pid  # the hole works

        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            code = 9
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(3)
                s.connect(link)
                with contextlib.suppress(OSError):
                    s.sendall(b'{"get": "counters"}\n')
                try:
                    code = 0 if s.recv(65536) == b"" else 1  # 0: closed without a word
                except ConnectionResetError:
                    code = 0
                except TimeoutError:
                    code = 3
            except PermissionError:
                code = 2
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "expected the agent to close on uid 65534"
        assert json.loads(ask(path, b'{"get": "counters"}\n'))["pid"] == idle.pid  # still serving
    finally:
        os.chmod(path, 0o600)
        os.unlink(link)
        os.rmdir(hole)


def test_socket_survives_garbage_and_silent_clients(idle: Proc) -> None:
    path = wait_for_socket(idle.pid)
    assert b"error" in ask(path, b"garbage\n")
    assert b"error" in ask(path, b'{"get": "everything"}\n')
    assert b"error" in ask(path, b"\xff\xfe\x00\n")
    assert ask(path, b"x" * 10_000) == b""  # no newline within the read limit: closed
    half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    half.connect(path)
    half.sendall(b'{"get": "coun')
    half.close()
    silent = []
    for _ in range(20):  # more than the agent's connection limit, and none ever sends
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        silent.append(s)
    try:
        t0 = time.monotonic()
        r = AgentClient().read_raw([idle.pid])
        assert idle.pid in r and time.monotonic() - t0 < 0.2
        silent[-1].settimeout(5)
        assert silent[-1].recv(10) == b""  # the agent closes an idle connection after its deadline
    finally:
        for s in silent:
            s.close()
    r2 = raw(idle.pid)
    assert r2["pid"] == idle.pid


def test_forked_child_does_not_serve(idle: Proc) -> None:
    path = wait_for_socket(idle.pid)
    idle.send("fork")
    forked = idle.expect("forked")
    assert forked["child_serving"] is None
    assert AgentClient.find_socket(forked["child"]) is None
    idle.expect("child_exited")
    assert os.path.exists(path), "the child's exit must not remove its parent's socket"
    assert raw(idle.pid)["pid"] == idle.pid


def test_socket_removed_at_exit_and_stale_ones_swept(env: dict[str, str]) -> None:
    d = _paths.ensure_socket_dir()
    old = time.time() - 3600
    stale = os.path.join(d, "4000001.sock")  # left by a killed process: nobody listens
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    s.close()
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live_path = os.path.join(d, "4000002.sock")
    live.bind(live_path)
    live.listen(1)
    young = os.path.join(d, "4000003.sock")  # too young to judge: maybe between bind and listen
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(young)
    s.close()
    os.utime(stale, (old, old))
    os.utime(live_path, (old, old))
    try:
        with Proc([IDLE], env) as p:
            p.expect("ready")
            path = wait_for_socket(p.pid)
            deadline = time.monotonic() + 5
            while os.path.exists(stale) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not os.path.exists(stale)
            assert os.path.exists(live_path) and os.path.exists(young)
            assert p.finish() == 0
        assert not os.path.exists(path)
    finally:
        live.close()
        for f in (live_path, young):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)


def test_stale_socket_replaced_live_one_refused(tmp_path: Path) -> None:
    stale = str(tmp_path / "1.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    s.close()  # the file stays, nobody listens: what a killed process leaves behind
    Server._clear_stale(stale)
    assert not os.path.exists(stale)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(stale)
    live.listen(1)
    try:
        with pytest.raises(OSError):
            Server._clear_stale(stale)
        assert os.path.exists(stale)
    finally:
        live.close()


def test_unsafe_socket_dir_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "dlmon"
    assert _paths.ensure_socket_dir(str(d)) == str(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    os.chmod(d, 0o755)
    with pytest.raises(_paths.SocketDirError):
        _paths.ensure_socket_dir(str(d))
    os.chmod(d, 0o700)
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(_paths.SocketDirError):
        _paths.ensure_socket_dir(str(link))
    if os.geteuid() == 0:
        os.chown(d, 65534, -1)
        with pytest.raises(_paths.SocketDirError):
            _paths.ensure_socket_dir(str(d))


# ---------------------------------------------------------------------------------------------
# import purity, bootstrap


def test_import_and_start_use_the_standard_library_only(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import sys
        before = set(sys.modules)
        import dlmon.agent
        dlmon.agent.start()
        import dlmon.agent.sitecustomize_hook
        new = {m.split(".")[0] for m in set(sys.modules) - before}
        bad = sorted(m for m in new if m not in sys.stdlib_module_names and m != "dlmon")
        assert not bad, bad
        assert "torch" not in sys.modules
        assert dlmon.agent.serving_path() is not None
        print("ok")
        """
    )
    e = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    e["PYTHONPATH"] = str(ROOT)
    e["XDG_RUNTIME_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_bootstrap_sitecustomize_starts_agent_and_chains(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITECUSTOMIZE_RAN'] = '1'\n")
    code = textwrap.dedent(
        """
        import os, sys, json
        import dlmon.agent
        print(json.dumps({"serving": dlmon.agent.serving_path(),
                          "other": os.environ.get("OTHER_SITECUSTOMIZE_RAN"),
                          "torch": "torch" in sys.modules}))
        """
    )
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DLMON_AGENT_DISABLE")}
    e["PYTHONPATH"] = os.pathsep.join([bootstrap_dir(), str(other), str(ROOT)])
    e["XDG_RUNTIME_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["other"] == "1", "the other sitecustomize must still run"
    assert got["serving"] and got["serving"].startswith(str(tmp_path)), "dlmon's must run too"
    assert got["torch"] is False

    e["DLMON_AGENT_DISABLE"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)
    got = json.loads(out.stdout)
    assert got["serving"] is None and got["other"] == "1"


def test_multiprocessing_helpers_are_recognised() -> None:
    assert is_multiprocessing_helper(
        ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]
    )
    assert is_multiprocessing_helper(
        ["python", "-B", "-c", "from multiprocessing.resource_tracker import main"]
    )
    assert is_multiprocessing_helper(["python", "-c", "x", "--multiprocessing-fork"])
    assert not is_multiprocessing_helper(["python", "train.py", "--lr", "0.1"])
    assert pythonpath_with_bootstrap("/a:/b").split(os.pathsep) == [bootstrap_dir(), "/a", "/b"]
    assert pythonpath_with_bootstrap(pythonpath_with_bootstrap(None)) == bootstrap_dir()


# ---------------------------------------------------------------------------------------------
# the client on its own


def _wire(
    time_ns: int, batches: int, samples: int, wait: int, compute: int, agent: str = "a"
) -> dict[str, Any]:
    loader = loader_reply(
        batches_total=batches,
        samples_total=samples,
        wait_ns_total=wait,
        compute_ns_total=compute,
        batches_per_worker=[batches // 2, batches - batches // 2],
    )
    device = wire.cuda_device_wire(
        device=0, allocated=10, reserved=20, peak_allocated=15, name=None, uuid="abc"
    )
    reply = counters_reply(
        agent_id=agent,
        time_ns=time_ns,
        loaders=[loader],
        cuda=[device],
        pinned=wire.pinned_wire(
            bytes=4096, in_use=1024, source="torch.cuda.host_memory_stats:allocated_bytes.current"
        ),
        num_threads=8,
        degraded={"sigchld": "why"},
    )
    return dict(reply)


def test_client_rates_from_cumulative_counters() -> None:
    c = AgentClient()
    first = c.convert({42: _wire(1_000_000_000, 10, 80, 100, 300)})
    (ls,) = first.loaders
    assert ls.batches_per_s is None and ls.samples_per_s is None and ls.data_wait_fraction is None
    assert ls.id == "42:1" and ls.pid == 42 and ls.worker_pids == (100, 101) and ls.pin_memory is True
    second = c.convert({42: _wire(3_000_000_000, 50, 400, 1100, 3300)})
    (ls,) = second.loaders
    assert ls.batches_per_s == pytest.approx(20.0)
    assert ls.samples_per_s == pytest.approx(160.0)
    assert ls.data_wait_fraction == pytest.approx(1000 / 4000)
    assert ls.batches_total == 50 and ls.batches_per_worker == (25, 25)
    assert second.pinned is not None and (second.pinned.bytes, second.pinned.in_use_bytes) == (4096, 1024)
    assert second.devices[0].allocated_bytes == 10 and second.num_threads[42] == 8
    assert second.degraded == {"42:sigchld": "why"}
    # no progress: rates are 0, the fraction unknown
    (ls,) = c.convert({42: _wire(4_000_000_000, 50, 400, 1100, 3300)}).loaders
    assert ls.batches_per_s == 0.0 and ls.data_wait_fraction is None
    # a new agent behind the same pid (pid reuse): back to "first poll"
    (ls,) = c.convert({42: _wire(5_000_000_000, 60, 480, 1200, 3400, agent="b")}).loaders
    assert ls.batches_per_s is None


def test_client_merges_ranks() -> None:
    c = AgentClient()
    a, b = _wire(1, 1, 8, 1, 1), _wire(1, 1, 8, 1, 1)
    b["pid"] = 43
    b["cuda"][0]["uuid"] = "def"
    merged = c.convert({42: a, 43: b})
    assert merged.pids == (42, 43)
    assert {ls.id for ls in merged.loaders} == {"42:1", "43:1"}
    assert merged.pinned is not None and (merged.pinned.bytes, merged.pinned.in_use_bytes) == (8192, 2048)
    # an agent from before the pool/in-use split: its pool counts, the job's in-use part is unknown
    del b["pinned"]["in_use"]
    older = AgentClient().convert({42: a, 43: b})
    assert older.pinned is not None and (older.pinned.bytes, older.pinned.in_use_bytes) == (8192, None)
    gpus = (
        GpuDevice(0, "H200", "GPU-ABC", None, None, None),
        GpuDevice(1, "H200", "GPU-DEF", None, None, None),
        GpuDevice(2, "H200", "GPU-XYZ", None, None, None),
    )
    out = merge_torch_memory(gpus, merged)
    assert [g.torch_allocated_bytes for g in out] == [10, 10, None]  # both ranks call it device 0
    assert out[0].torch_reserved_bytes == 20 and out[0].torch_peak_allocated_bytes == 15
    no_uuid = AgentReading(
        time=0.0,
        pids=(1,),
        devices=(TorchDeviceMemory(1, 1, None, None, 5, 6, 7),),
    )
    assert merge_torch_memory(gpus, no_uuid)[1].torch_allocated_bytes == 5


def test_client_is_quiet_and_quick_without_a_working_agent(env: dict[str, str]) -> None:
    c = AgentClient()
    t0 = time.monotonic()
    assert c.poll(2**22 + 12345) is None  # no socket at all
    d = _paths.ensure_socket_dir()
    mute_pid, garbage_pid = 2**22 + 1, 2**22 + 2
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(os.path.join(d, f"{mute_pid}.sock"))
    mute.listen(4)  # accepts into the backlog, never answers
    garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    garbage.bind(os.path.join(d, f"{garbage_pid}.sock"))
    garbage.listen(4)

    def answer_garbage() -> None:
        try:  # the client may refuse before connecting: its peer is not the pid it asked for
            conn, _ = garbage.accept()
            conn.sendall(b"not json at all\n")
            conn.close()
        except OSError:
            pass

    th = threading.Thread(target=answer_garbage, daemon=True)
    th.start()
    try:
        t0 = time.monotonic()
        assert c.poll([mute_pid, garbage_pid]) is None
        assert time.monotonic() - t0 < 0.3  # 200 ms for all pids together
    finally:
        th.join(2)
        for s in (mute, garbage):
            s.close()
        for pid in (mute_pid, garbage_pid):
            os.unlink(os.path.join(d, f"{pid}.sock"))


def _host_stats_of(stat_names: list[str], duration_names: list[str], counts: list[str]) -> dict[str, int]:
    """A flat torch.cuda.host_memory_stats() dict (as its _recurse_add_to_result makes it) for a
    HostStats struct with these members, every figure 0."""
    out = {f"{n}.{k}": 0 for n in stat_names for k in ("current", "peak", "allocated", "freed")}
    out.update({f"{n}.{k}": 0 for n in duration_names for k in ("total", "max", "min", "count", "avg")})
    out.update(dict.fromkeys(counts, 0))
    return out


def _installed_host_stats() -> dict[str, int]:
    """The keys of the installed torch's HostStats (ATen/core/CachingHostAllocator.h), which
    torch.cuda.host_memory_stats() flattens: the current era's, read from torch itself."""
    torch = pytest.importorskip("torch")
    header = Path(torch.__file__).parent / "include" / "ATen" / "core" / "CachingHostAllocator.h"
    if not header.exists():
        pytest.skip("the installed torch has no headers")
    body = header.read_text().split("struct TORCH_API HostStats {", 1)[1].split("};", 1)[0]
    return _host_stats_of(
        re.findall(r"^\s*Stat (\w+);", body, re.M),
        re.findall(r"^\s*DurationStat (\w+);", body, re.M),
        re.findall(r"^\s*int64_t (\w+) = 0;", body, re.M),
    )


# torch 2.7-2.9's HostStats: the pool is reserved_bytes, the part handed out allocated_bytes
OLD_ERA = _host_stats_of(
    ["allocation", "segment", "allocated_bytes", "reserved_bytes"],
    ["host_alloc_time", "host_free_time"],
    ["num_host_alloc", "num_host_free"],
)


def test_the_pinned_pool_and_its_part_in_use_by_the_keys_the_running_torch_has() -> None:
    """host_memory_stats' keys changed meaning between torch eras: each era's dict through the
    one function that interprets it gives the pool and the part in use."""
    new = _installed_host_stats()
    assert "active_bytes.current" in new and "allocated_bytes.current" in new  # torch 2.13's names
    assert "reserved_bytes.current" not in new
    new.update({"allocated_bytes.current": 512 << 20, "active_bytes.current": 96 << 20})
    assert parse_host_memory_stats(new) == (
        512 << 20,
        96 << 20,
        "torch.cuda.host_memory_stats:allocated_bytes.current (in use: active_bytes.current)",
    )
    old = {**OLD_ERA, "reserved_bytes.current": 256 << 20, "allocated_bytes.current": 64 << 20}
    assert parse_host_memory_stats(old) == (
        256 << 20,
        64 << 20,
        "torch.cuda.host_memory_stats:reserved_bytes.current (in use: allocated_bytes.current)",
    )
    # nested (host_memory_stats_as_nested_dict) reads the same
    nested = {"reserved_bytes": {"current": 9, "peak": 10}, "allocated_bytes": {"current": 4}}
    assert parse_host_memory_stats(nested)[:2] == (9, 4)  # type: ignore[index]


def test_the_pinned_era_is_told_by_the_keys_present_not_by_which_figures_read() -> None:
    """A 2.7-2.9 dict whose pool figure is unreadable must not have its in-use part taken for the
    pool (a wrong number, 4x too small here); one with the pool alone still gives the pool."""
    bad_pool = {**OLD_ERA, "reserved_bytes.current": -1, "allocated_bytes.current": 64 << 20}
    assert parse_host_memory_stats(bad_pool) is None
    pool_only = {"reserved_bytes": {"current": 256 << 20}}
    assert parse_host_memory_stats(pool_only) == (
        256 << 20,
        None,
        "torch.cuda.host_memory_stats:reserved_bytes.current",
    )
    # a dict with the three names (as the device allocator's memory_stats has): reserved is the pool
    three = {"reserved_bytes.current": 300, "allocated_bytes.current": 100, "active_bytes.current": 120}
    assert parse_host_memory_stats(three)[:2] == (300, 120)  # type: ignore[index]
    assert parse_host_memory_stats({7: 1, "allocated_bytes.current": 5})[:2] == (5, None)  # type: ignore[index]


def test_cuda_and_pinned_figures_are_read_defensively() -> None:
    # only the pool's key: the pool, in use unknown
    assert parse_host_memory_stats({"allocated_bytes.current": 1 << 20}) == (
        1 << 20,
        None,
        "torch.cuda.host_memory_stats:allocated_bytes.current",
    )
    assert parse_host_memory_stats({"allocated_bytes": {"current": 7}})[0] == 7  # type: ignore[index]
    assert parse_host_memory_stats({"allocated_bytes.all.current": 3}) == (
        3,
        None,
        "torch.cuda.host_memory_stats:allocated_bytes.all.current",
    )
    assert parse_host_memory_stats({}) is None and parse_host_memory_stats(None) is None
    assert parse_host_memory_stats({"allocated_bytes.current": "x"}) is None
    # a bad in-use figure is no era: the next era that fits is taken
    assert parse_host_memory_stats({"allocated_bytes.current": 5, "active_bytes.current": -1})[:2] == (  # type: ignore[index]
        5,
        None,
    )

    cpu_torch = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: False))
    assert _cuda_figures(cpu_torch) == (False, [], None, None)

    calls: list[int] = []

    def memory_stats(d: int) -> dict[str, int]:
        calls.append(d)
        return {
            "allocated_bytes.all.current": 100 + d,
            "reserved_bytes.all.current": 200 + d,
            "allocated_bytes.all.peak": 150 + d,
        }

    def flattening_again(d: int) -> int:  # each of these flattens memory_stats under the allocator mutex
        raise AssertionError("one memory_stats() per device, not one call per figure")

    fake = SimpleNamespace(
        cuda=SimpleNamespace(
            is_initialized=lambda: True,
            device_count=lambda: 2,
            memory_stats=memory_stats,
            memory_allocated=flattening_again,
            memory_reserved=flattening_again,
            max_memory_allocated=flattening_again,
            get_device_properties=lambda d: SimpleNamespace(name="H200", uuid=f"uuid-{d}"),
            host_memory_stats=lambda: {"allocated_bytes.current": 4096, "active_bytes.current": 1024},
        )
    )
    init, devices, pinned, err = _cuda_figures(fake)
    assert init and err is None
    assert calls == [0, 1]
    assert devices[0]["allocated"] == 100
    assert devices[1] == {
        "device": 1,
        "allocated": 101,
        "reserved": 201,
        "peak_allocated": 151,
        "name": "H200",
        "uuid": "uuid-1",
    }
    assert pinned == {
        "bytes": 4096,
        "in_use": 1024,
        "source": "torch.cuda.host_memory_stats:allocated_bytes.current (in use: active_bytes.current)",
    }
    older = SimpleNamespace(cuda=SimpleNamespace(**{**vars(fake.cuda), "host_memory_stats": None}))
    del older.cuda.host_memory_stats
    assert _cuda_figures(older)[2] is None  # absent on older torch: pinned unknown, not 0


def test_a_pid_without_an_agent_is_looked_for_less_often_and_a_late_agent_is_still_found(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 14: attached to a job without an agent, every tick looked for its socket (stat
    calls: the whole cost of the poll). After its first polls a pid is looked for every
    ABSENT_RECHECK_S, and an agent that starts later is found within that."""
    from dlmon.collect import agent_client

    monkeypatch.setattr(agent_client, "ABSENT_RECHECK_S", 0.5)
    plain = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # no agent at start-up
    plain["PYTHONPATH"] = str(ROOT)
    code = "import sys; sys.stdin.readline(); import dlmon.agent; dlmon.agent.start(); print('UP', flush=True); sys.stdin.readline()"  # noqa: E501
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=plain
    )
    assert proc.stdin is not None and proc.stdout is not None
    lookups = Counter[int]()
    real = AgentClient._candidates

    def counted(pid: int, where: Any = None) -> Any:
        lookups[pid] += 1
        return real(pid, where)

    monkeypatch.setattr(AgentClient, "_candidates", staticmethod(counted))
    try:
        client = AgentClient()
        for _ in range(agent_client.ABSENT_FAST_POLLS + 5):
            assert client.poll(proc.pid) is None
        assert lookups[proc.pid] == agent_client.ABSENT_FAST_POLLS  # then it rests
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "UP"
        started = time.monotonic()
        reading = None
        while reading is None and time.monotonic() - started < 5.0:
            reading = client.poll(proc.pid)
            time.sleep(0.05)
        assert reading is not None and proc.pid in reading.pids
        assert time.monotonic() - started < 0.5 + 0.4
    finally:
        proc.kill()
        proc.wait()


def test_sockets_already_connected_are_closed_when_a_later_connect_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poll of several ranks connects one by one: when a later one raises (socket() at the fd
    limit: EMFILE), the sockets connected before it are closed, not left to the garbage collector."""
    mine, theirs = socket.socketpair()
    client = AgentClient()

    def connect(pid: int, request: bytes = b"") -> socket.socket | None:
        if pid == 1:
            return mine
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(client, "_connect", connect)
    try:
        with pytest.raises(OSError):
            client.read_raw([1, 2])
        assert mine.fileno() == -1
    finally:
        mine.close()
        theirs.close()


def test_wall_share_leaves_start_up_out_like_own_share() -> None:
    """A bare one-loader loop with worker start-up in the interval: the wall share (what the job
    is judged on) leaves the start-up out as the own share does, so the two are the same; an
    interval that is all start-up has no figure, as before (not a 0 that dilutes the window)."""
    c = AgentClient()
    c.convert({42: _wire(1_000_000_000, 10, 80, 100, 300)})
    cur = _wire(3_000_000_000, 50, 400, 600_000_100, 400_000_300)
    cur["loaders"][0]["startup_wait_ns_total"] = 800_000_005  # 0.8 s of the 2 s starting workers
    cur["loaders"][0]["end_wait_ns_total"] = 200_000_000  # and 0.2 s ending the epoch
    (ls,) = c.convert({42: cur}).loaders
    assert ls.data_wait_fraction == pytest.approx(0.6)
    assert ls.wall_wait_fraction == pytest.approx(ls.data_wait_fraction, abs=1e-6)
    c = AgentClient()
    c.convert({42: _wire(1_000_000_000, 10, 80, 100, 300)})
    cur = _wire(3_000_000_000, 11, 88, 100, 300)
    cur["loaders"][0]["startup_wait_ns_total"] = 2_000_000_005  # the whole interval
    (ls,) = c.convert({42: cur}).loaders
    assert ls.data_wait_fraction is None and ls.wall_wait_fraction is None


def test_the_pinned_in_use_part_reads_both_ways_in_records() -> None:
    """A new record's pool and part in use read back; an older record (no ``in_use_bytes``)
    reads with the part unknown."""
    from dataclasses import replace

    from dlmon.model import PinnedMemory
    from dlmon.model.serialize import snapshot_from_dict, snapshot_to_dict
    from support.ui import make_snapshot

    pinned = PinnedMemory(512 << 20, "torch.cuda.host_memory_stats:allocated_bytes.current", 96 << 20)
    data = snapshot_to_dict(replace(make_snapshot(), pinned=pinned))
    assert snapshot_from_dict(json.loads(json.dumps(data))).pinned == pinned
    del data["pinned"]["in_use_bytes"]
    old = snapshot_from_dict(data).pinned
    assert old is not None and (old.bytes, old.in_use_bytes) == (512 << 20, None)
