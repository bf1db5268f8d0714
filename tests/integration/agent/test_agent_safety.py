"""The agent and its client under hostile or unusual conditions (regressions from a review).

Each test names the finding it covers. Training-like code runs in child processes; sockets
live under a private XDG_RUNTIME_DIR.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlmon.agent import _hooks, _paths
from dlmon.agent._server import REPLY_BURST, Server
from dlmon.agent.sitecustomize_hook import is_spawned_child
from dlmon.collect.agent_client import AgentClient
from support.agent import private_agent_env
from support.paths import ROOT, TESTS

server_mod = importlib.import_module("dlmon.agent._server")  # not dlmon.agent._server: see finding 2
SCRIPTS = TESTS / "agent_scripts"
REQUEST = b'{"get": "counters"}\n'


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, str]]:
    """A private XDG_RUNTIME_DIR for the module, in this process and in the children's environment."""
    with private_agent_env("dlmon-agent-safety-") as e:
        yield e


def plain_env(env: dict[str, str]) -> dict[str, str]:
    """The module's environment without the bootstrap: the script starts the agent itself."""
    e = dict(env)
    e["PYTHONPATH"] = str(ROOT)
    return e


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
        threading.Thread(target=self._pump, args=(self.p.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.p.stderr, False), daemon=True).start()
        self.pid = self.p.pid

    def _pump(self, stream: Any, events: bool) -> None:
        for line in stream:
            if events and line.startswith("@@ "):
                self.events.put(json.loads(line[3:]))
            elif not events:
                self.stderr.append(line)

    def expect(self, ev: str, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(
                    f"no {ev!r} within {timeout}s; rc={self.p.poll()}; stderr:\n{''.join(self.stderr)}"
                )
            if got["ev"] == ev:
                return got

    def send(self, cmd: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(OSError):
                self.send("exit")
                self.p.stdin.close()  # type: ignore[union-attr]
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def run_script(code: str, env: dict[str, str], tmp_path: Path, name: str = "job.py") -> Any:
    """Run ``code`` as a script file; return the JSON of its last stdout line."""
    script = tmp_path / name
    script.write_text(textwrap.dedent(code))
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def thread_cpu_s(pid: int, tid: int) -> float:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def read_reply(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


# ---------------------------------------------------------------------------------------------
# 1. accept() failing with EMFILE must not spin the serving thread


def test_accept_failure_for_want_of_fds_does_not_spin(env: dict[str, str]) -> None:
    with Proc([str(SCRIPTS / "fds.py")], plain_env(env)) as p:
        ev = p.expect("exhausted")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(ev["path"])  # lands in the backlog; the agent cannot accept it (EMFILE)
        s.sendall(REQUEST)
        try:
            time.sleep(0.3)
            cpu0 = thread_cpu_s(p.pid, ev["tid"])
            time.sleep(1.5)
            used = thread_cpu_s(p.pid, ev["tid"]) - cpu0
            assert used < 0.15, f"the serving thread used {used:.2f} s of CPU in 1.5 s: it spins on accept()"
            p.send("free")
            p.expect("freed")
            reply = json.loads(read_reply(s, timeout=5.0))  # accepted once fds are back
            assert reply["pid"] == p.pid
        finally:
            s.close()


# ---------------------------------------------------------------------------------------------
# 2. counters()/serving_path() never raise; a failed start can be retried


def test_public_functions_never_raise_and_a_failed_start_is_retried(
    env: dict[str, str], tmp_path: Path
) -> None:
    xdg = tmp_path / "xdg"
    (xdg / "dlmon").mkdir(parents=True)
    os.chmod(xdg / "dlmon", 0o755)  # unsafe: the agent refuses to serve there
    code = f"""
        import json, os
        os.environ["XDG_RUNTIME_DIR"] = {str(xdg)!r}
        import dlmon.agent as A
        out = {{"pid": os.getpid()}}
        out["before_start"] = sorted(A.counters())[:3]
        os.environ["DLMON_AGENT_DISABLE"] = "1"
        A.start()
        out["disabled"] = [A.serving_path(), "loaders" in A.counters()]
        del os.environ["DLMON_AGENT_DISABLE"]
        A.start()  # the directory is unsafe: no server
        out["failed"] = [A.serving_path(), "server" in A.counters()["degraded"]]
        os.chmod({str(xdg / "dlmon")!r}, 0o700)
        A.start()  # retried, and now it works
        out["retried"] = [A.serving_path(), "server" in A.counters()["degraded"]]
        print(json.dumps(out))
    """
    got = run_script(code, plain_env(env), tmp_path)
    assert got["before_start"] == ["agent_id", "cuda", "cuda_initialized"]
    assert got["disabled"] == [None, True]
    assert got["failed"] == [None, True]
    assert got["retried"] == [str(xdg / "dlmon" / f"{got['pid']}.sock"), False]


# ---------------------------------------------------------------------------------------------
# 3. SIGCHLD: only torch's own handler is ever wrapped


def test_sigchld_ignore_and_user_handlers_are_never_replaced(env: dict[str, str], tmp_path: Path) -> None:
    code = """
        import json, signal
        import dlmon.agent
        dlmon.agent.start()
        from torch.utils.data import DataLoader
        dl = DataLoader(list(range(8)), batch_size=2, num_workers=1)
        out = {}
        list(dl)
        out["first"] = getattr(signal.getsignal(signal.SIGCHLD), "__qualname__", None)
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the program wants children reaped for it
        list(dl)
        out["ign"] = str(signal.getsignal(signal.SIGCHLD))
        def mine(signum, frame):
            pass
        signal.signal(signal.SIGCHLD, mine)
        list(dl)
        out["mine"] = signal.getsignal(signal.SIGCHLD) is mine
        out["degraded"] = dlmon.agent.counters()["degraded"].get("sigchld", "")
        print(json.dumps(out))
    """
    got = run_script(code, plain_env(env), tmp_path)
    assert got["first"] == "_install_sigchld_observer.<locals>.observer"  # torch's, wrapped
    assert got["ign"] == str(signal.SIG_IGN)
    assert got["mine"] is True
    assert "torch's" in got["degraded"]


# ---------------------------------------------------------------------------------------------
# 4. an iterator built before start() gets its worker pids


def test_iterator_built_before_start_reports_its_workers(env: dict[str, str], tmp_path: Path) -> None:
    code = """
        import json
        from torch.utils.data import DataLoader
        dl = DataLoader(list(range(64)), batch_size=4, num_workers=2, persistent_workers=True)
        it = iter(dl)
        next(it)
        import dlmon.agent
        dlmon.agent.start()
        for _ in range(2):
            for b in dl:
                pass
        (l,) = dlmon.agent.counters()["loaders"]
        print(json.dumps([l["worker_pids"], [w.pid for w in it._workers], l["batches_total"]]))
    """
    reported, actual, batches = run_script(code, plain_env(env), tmp_path)
    assert reported == actual and len(actual) == 2
    assert batches == 32


# ---------------------------------------------------------------------------------------------
# 5. a stall in progress shows as ~1.0 data wait; iterator construction and the first batch are
# start-up, counted apart (LoaderSample.startup_s_total)


@pytest.mark.parametrize(
    ("num_workers", "stall_at"), [(0, 20), (2, 20), (0, 0)], ids=["workers0", "workers2", "first_batch"]
)
def test_a_loader_stalled_right_now_shows_full_data_wait(
    env: dict[str, str], num_workers: int, stall_at: int
) -> None:
    cfg = {"num_workers": num_workers, "stall_at": stall_at, "stall_s": 4.0}
    client = AgentClient()
    with Proc([str(SCRIPTS / "stall.py"), json.dumps(cfg)], env) as p:
        p.expect("ready")
        p.expect("stalling")
        time.sleep(0.3)
        raw1 = client.read_raw([p.pid])
        first = client.convert(raw1)
        time.sleep(1.0)
        raw2 = client.read_raw([p.pid])
        second = client.convert(raw2)
    assert first.loaders and first.loaders[0].data_wait_fraction is None  # first poll: no rate
    (ls,) = second.loaders
    if stall_at == 0:
        # a stall in worker start-up is start-up, its own figure (issue 8), not a data wait of 1.0
        assert ls.data_wait_fraction is None, (ls, raw2)
        assert ls.startup_s_total is not None and ls.startup_s_total > 1.0, (ls, raw2)
    else:
        assert ls.data_wait_fraction is not None and ls.data_wait_fraction > 0.95, (ls, raw2)
    (wl,) = raw2[p.pid]["loaders"]
    (it,) = wl["iterators"]
    assert it["in_call_ns"] > 1.0e9
    pending = "startup_wait_ns_pending" if stall_at == 0 else "wait_ns_pending"
    assert wl[pending] > 1.0e9


def test_client_counts_the_wait_in_progress() -> None:
    def wire(t: int, wait: int, compute: int, **pending: int) -> dict[str, Any]:
        ld = {"id": 1, "wait_ns_total": wait, "compute_ns_total": compute, **pending}
        return {"pid": 7, "agent_id": "a", "time_ns": t, "loaders": [ld]}

    c = AgentClient()
    c.convert({7: wire(1_000_000_000, 100, 900)})
    # stuck in one call for the whole second: nothing returned, the pending wait grew by 1 s
    r = c.convert({7: wire(2_000_000_000, 100, 900, wait_ns_pending=1_200_000_000)})
    assert r.loaders[0].data_wait_fraction == pytest.approx(1.0, abs=0.01)
    # a first call of an epoch (start-up) that lasted the whole interval: start-up, not data wait
    c = AgentClient()
    c.convert({7: wire(1_000_000_000, 0, 0, startup_wait_ns_pending=500, startup_wait_ns_total=0)})
    r = c.convert(
        {7: wire(2_000_000_000, 0, 0, startup_wait_ns_pending=1_000_000_500, startup_wait_ns_total=0)}
    )
    assert r.loaders[0].data_wait_fraction is None
    assert r.loaders[0].startup_s_total == pytest.approx(1.0, abs=0.01)
    # a long training step (no call in progress, nothing returned): unknown, as before
    c = AgentClient()
    c.convert({7: wire(1_000_000_000, 100, 900)})
    assert c.convert({7: wire(2_000_000_000, 100, 900)}).loaders[0].data_wait_fraction is None


def test_building_the_iterator_counts_as_start_up_and_worker_errors_are_no_batches(
    env: dict[str, str], tmp_path: Path
) -> None:
    code = """
        import json
        import dlmon.agent
        dlmon.agent.start()
        import torch
        from torch.utils.data import DataLoader, Dataset
        class Failing(Dataset):
            def __len__(self): return 40
            def __getitem__(self, i):
                if i == 10:
                    raise ValueError("bad sample")
                return torch.zeros(2)
        dl = DataLoader(Failing(), batch_size=2, num_workers=2)
        it = iter(dl)
        (l,) = dlmon.agent.counters()["loaders"]
        startup = [l["startup_wait_ns_total"], l["batches_total"]]
        got = 0
        try:
            for _ in it:
                got += 1
        except ValueError:
            pass
        (l,) = dlmon.agent.counters()["loaders"]
        print(json.dumps([startup, got, l["batches_total"], l["batches_per_worker"]]))
    """
    (startup_ns, batches_then), got, total, per_worker = run_script(code, plain_env(env), tmp_path)
    assert batches_then == 0 and startup_ns > 0  # spawning the workers is start-up wait
    assert got == total == 5
    assert sum(per_worker) == total  # the batch that carried the worker's exception is not one


# ---------------------------------------------------------------------------------------------
# 6. the client trusts only the target's own socket, and never raises on a reply


class FakeAgent:
    """Serves the given replies, one per connection, on ``path`` from this (the test's) process."""

    def __init__(self, path: str, replies: list[bytes]) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.replies = list(replies)
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                with contextlib.suppress(OSError):
                    conn.recv(4096)
                    conn.sendall(self.replies.pop(0) if self.replies else b'{"error": "done"}\n')

    def close(self) -> None:
        self.stop = True
        self.thread.join(2)
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _line(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def test_client_survives_hostile_replies(env: dict[str, str]) -> None:
    me = os.getpid()
    good: dict[str, Any] = {"v": 1, "pid": me, "agent_id": "x", "time_ns": 5, "loaders": []}
    hostile = [
        {**good, "loaders": [{"id": [1, 2]}, {"id": {"a": 1}}, {"id": True}]},
        {**good, "degraded": [1, 2]},
        {**good, "degraded": "why"},
        {**good, "cuda": "abc"},
        {**good, "cuda": [{"device": "0"}, {"device": 0, "allocated": "x"}]},
        {**good, "worker_deaths": 5},
        {**good, "worker_deaths": [{"pid": 9, "unix_time": float("nan"), "loader_id": [1]}]},
        {**good, "agent_id": {"a": 1}},
        {**good, "time_ns": True},
        {**good, "pinned": [1]},
        {**good, "pinned": {"bytes": True}},
        {
            **good,
            "loaders": [{"id": 1, "batches_total": "many", "worker_pids": "abc", "name": 5, "alive": "no"}],
        },
    ]
    d = _paths.ensure_socket_dir()
    fake = FakeAgent(os.path.join(d, f"{me}.sock"), [_line(h) for h in hostile])
    client = AgentClient(timeout_s=0.2)
    results = []
    try:
        for _ in hostile:
            results.append(client.poll(me))  # must never raise
    finally:
        fake.close()
    assert all(r is None or r.pids == (me,) for r in results)
    dropped = [i for i, r in enumerate(results) if r is None]
    assert {1, 2, 3, 5, 7, 8, 9} <= set(dropped), dropped
    assert results[0] is not None and results[0].loaders == ()
    assert results[6] is not None and results[6].worker_deaths[0].time is None
    assert results[6].worker_deaths[0].loader_id is None
    assert results[10] is not None and results[10].pinned is None
    r11 = results[11]
    assert r11 is not None and r11.loaders[0].batches_total is None and r11.loaders[0].worker_pids == ()
    # convert() itself, with garbage where dicts belong, drops that pid and keeps the others
    ok = {"pid": 42, "agent_id": "a", "time_ns": 1, "loaders": [{"id": 1}]}
    mixed = client.convert({41: "garbage", 42: ok, 43: {**ok, "degraded": 3}})  # type: ignore[dict-item]
    assert mixed.pids == (42,) and [ls.id for ls in mixed.loaders] == ["42:1"]


def test_client_refuses_a_socket_served_by_another_process(env: dict[str, str]) -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    d = _paths.ensure_socket_dir()
    reply = {"v": 1, "pid": victim.pid, "agent_id": "x", "time_ns": 5, "loaders": [{"id": 1}]}
    fake = FakeAgent(os.path.join(d, f"{victim.pid}.sock"), [_line(reply)] * 3)
    try:
        assert AgentClient.find_socket(victim.pid) is not None  # it is where victim's agent would be
        assert AgentClient().poll(victim.pid) is None  # but the listener is not victim (SO_PEERCRED)
    finally:
        fake.close()
        victim.kill()
        victim.wait()


def test_client_refuses_sockets_in_unsafe_directories(
    env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    me = os.getpid()
    reply = _line({"v": 1, "pid": me, "agent_id": "x", "time_ns": 5, "loaders": []})
    open_dir = tmp_path / "open"
    (open_dir / "dlmon").mkdir(parents=True)
    os.chmod(open_dir / "dlmon", 0o755)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "dlmon").symlink_to(private)
    for xdg, sock_dir in ((open_dir, open_dir / "dlmon"), (linked, private)):
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
        fake = FakeAgent(str(sock_dir / f"{me}.sock"), [reply] * 3)
        try:
            assert AgentClient.find_socket(me) is None
            assert AgentClient().poll(me) is None
        finally:
            fake.close()
    # the same socket in a private directory is read
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "dlmon").mkdir(mode=0o700)
    fake = FakeAgent(str(tmp_path / "dlmon" / f"{me}.sock"), [reply] * 3)
    try:
        got = AgentClient().poll(me)
        assert got is not None and got.pids == (me,)
    finally:
        fake.close()


# ---------------------------------------------------------------------------------------------
# 7. the client looks where the target serves, not where the monitor would


def test_client_finds_a_target_with_another_xdg_runtime_dir(
    env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = tmp_path / "their-runtime"
    theirs.mkdir(mode=0o700)
    child_env = dict(env)
    child_env["XDG_RUNTIME_DIR"] = str(theirs)
    monkeypatch.delenv("XDG_RUNTIME_DIR")  # the monitor has none
    with Proc([str(SCRIPTS / "idle.py")], child_env) as p:
        ready = p.expect("ready")
        assert ready["serving"] == str(theirs / "dlmon" / f"{p.pid}.sock")
        got = AgentClient().read_raw([p.pid])
        assert got[p.pid]["pid"] == p.pid


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a target as another user")
def test_root_monitor_finds_another_users_agent(env: dict[str, str]) -> None:
    nobody = 65534
    tmp_dir = os.path.join(tempfile.gettempdir(), f"dlmon-{nobody}")
    r, w = os.pipe()
    r2, w2 = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.close(r)
            os.close(w2)
            os.environ.pop("XDG_RUNTIME_DIR", None)
            os.setgroups([])
            os.setgid(nobody)
            os.setuid(nobody)
            import dlmon.agent

            dlmon.agent.start()
            os.write(w, (dlmon.agent.serving_path() or "-").encode() + b"\n")
            os.read(r2, 1)
        finally:
            os._exit(0)
    os.close(w)
    os.close(r2)
    try:
        with os.fdopen(r) as f:
            serving = f.readline().strip()
        assert serving == os.path.join(tmp_dir, f"{child}.sock")
        got = AgentClient().read_raw([child])
        assert child in got and got[child]["pid"] == child
    finally:
        os.write(w2, b"x")
        os.close(w2)
        os.waitpid(child, 0)
        shutil.rmtree(tmp_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# 8. torch.multiprocessing.spawn ranks get agents; their DataLoader workers do not


@pytest.mark.slow
def test_spawned_ranks_serve_from_their_first_dataloader(env: dict[str, str], tmp_path: Path) -> None:
    go = tmp_path / "go"
    with Proc([str(SCRIPTS / "ranks.py"), str(go)], env) as p:
        p.expect("ready")
        ranks = [p.expect("rank", timeout=120) for _ in range(2)]
        try:
            for rk in ranks:
                got = AgentClient().read_raw([rk["pid"]])
                assert rk["pid"] in got, f"rank {rk['rank']} has no agent"
                (ld,) = got[rk["pid"]]["loaders"]
                assert ld["batches_total"] == rk["batches"]
                assert ld["worker_pids"] == rk["worker_pids"]
                for wpid in rk["worker_pids"]:
                    assert AgentClient.find_socket(wpid) is None  # workers never serve
        finally:
            go.touch()
        p.expect("done", timeout=60)
    assert is_spawned_child(
        ["python", "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"]
    )
    assert not is_spawned_child(["python", "-c", "from multiprocessing.resource_tracker import main"])


def test_spawned_helper_is_armed_but_serves_only_once_it_iterates(
    env: dict[str, str], tmp_path: Path
) -> None:
    code = """
        import json, sys
        sys.orig_argv = [sys.executable, "-c", "...", "--multiprocessing-fork"]
        from dlmon.agent import sitecustomize_hook
        import dlmon.agent
        armed = sitecustomize_hook.maybe_start()
        before = dlmon.agent.serving_path()
        import torch
        from torch.utils.data import DataLoader
        dl = DataLoader(list(range(8)), batch_size=2)
        after_construct = dlmon.agent.serving_path()
        n = len(list(dl))
        print(json.dumps([armed, before, after_construct, dlmon.agent.serving_path() is not None, n,
                          dlmon.agent.counters()["loaders"][0]["batches_total"]]))
    """
    assert run_script(code, plain_env(env), tmp_path) == [True, None, None, True, 4, 4]


# ---------------------------------------------------------------------------------------------
# 9. replies are rate-limited


def test_a_client_polling_in_a_loop_gets_cached_replies(monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[float] = []

    def fake_build(server: Any) -> dict[str, Any]:
        builds.append(time.monotonic())
        return {"n": len(builds)}

    monkeypatch.setattr(server_mod, "build_counters", fake_build)
    srv = Server()
    replies = [srv._answer(REQUEST.strip()) for _ in range(200)]
    assert len(builds) <= REPLY_BURST + 1, len(builds)
    assert all(json.loads(r)["n"] >= 1 for r in replies)
    n = len(builds)
    time.sleep(0.25)
    assert json.loads(srv._answer(REQUEST.strip()))["n"] == n + 1  # older than 200 ms: rebuilt
    # a client polling once a second always gets a fresh reply
    srv = Server()
    builds.clear()
    for i in range(3):
        assert json.loads(srv._answer(REQUEST.strip()))["n"] == i + 1


# ---------------------------------------------------------------------------------------------
# 10. torch's own warnings: still issued, message intact. They name dlmon's __next__ wrapper as
#     their location (documented in dlmon/agent/_hooks.py: hooking _next_data instead would move
#     part of the data wait into compute).


def test_torch_warnings_still_reach_the_user(env: dict[str, str], tmp_path: Path) -> None:
    code = """
        import json, warnings
        import dlmon.agent
        dlmon.agent.start()
        from torch.utils.data import DataLoader, IterableDataset
        class DS(IterableDataset):
            def __iter__(self): return iter(range(5))
            def __len__(self): return 2
        dl = DataLoader(DS(), batch_size=None)
        len(dl)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for b in dl:
                pass
        print(json.dumps([[str(w.message), w.filename] for w in caught]))
    """
    got = run_script(code, plain_env(env), tmp_path, name="warn_site.py")
    assert len(got) == 3 and all("Length of IterableDataset" in msg for msg, _ in got), got
    assert all(f in (str(tmp_path / "warn_site.py"), _hooks.__file__) for _, f in got), got


# ---------------------------------------------------------------------------------------------
# 11. a refused attach is not retried on every batch; live loader states are capped


def test_refused_attach_is_not_retried_and_loaders_are_capped(env: dict[str, str], tmp_path: Path) -> None:
    code = """
        import json, time
        import dlmon.agent
        from dlmon.agent import _hooks, _loaders
        dlmon.agent.start()
        from torch.utils.data import DataLoader
        from torch.utils.data.dataloader import _SingleProcessDataLoaderIter
        class It(_SingleProcessDataLoaderIter):
            def __setattr__(self, k, v):
                if k == "_dlmon_st":
                    raise AttributeError("no")
                super().__setattr__(k, v)
        class DL(DataLoader):
            def _get_iterator(self):
                return It(self)
        n = sum(1 for _ in DL(list(range(3000)), batch_size=1))
        refused = len(_hooks.R.loaders)
        _loaders.MAX_LIVE_LOADERS = 5  # where _new_loader_state reads it
        keep = [DataLoader(list(range(4)), batch_size=2) for _ in range(8)]
        for dl in keep:
            assert len(list(dl)) == 2
        c = dlmon.agent.counters()
        live = [l for l in c["loaders"] if l["alive"] and l["batches_total"]]
        print(json.dumps([n, refused, len(live), "loaders" in c["degraded"]]))
    """
    n, refused, live, degraded = run_script(code, plain_env(env), tmp_path)
    assert n == 3000
    assert refused <= 1, f"{refused} loader states for one refusing iterator"
    assert live <= 5 and degraded


# ---------------------------------------------------------------------------------------------
# nits: stale sockets, ECHILD


def test_clear_stale_leaves_a_live_socket_with_a_full_backlog(tmp_path: Path) -> None:
    path = str(tmp_path / "1.sock")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen(0)
    clients = []
    try:
        for _ in range(64):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            clients.append(c)
            try:
                c.connect(path)
            except BlockingIOError:
                break  # the backlog is full: a blocking connect would wait, then time out
        t0 = time.monotonic()
        with pytest.raises(OSError):
            Server._clear_stale(path)
        assert time.monotonic() - t0 < 0.1
        assert os.path.exists(path), "a live agent's socket was removed"
    finally:
        for c in clients:
            c.close()
        live.close()


def test_sweep_does_not_remove_a_socket_rebound_after_the_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "4000001.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # stale, and old enough to be swept
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    rebound: list[socket.socket] = []

    class RacingProbe:
        """Refused, but a new agent binds the same name between the probe and the unlink."""

        def __init__(self, *args: Any) -> None:
            pass

        def setblocking(self, flag: bool) -> None:
            pass

        def connect(self, p: str) -> None:
            os.unlink(p)
            new = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            new.bind(p)
            new.listen(1)
            rebound.append(new)
            raise ConnectionRefusedError

        def close(self) -> None:
            pass

    fake_socket = type("FakeSocketModule", (), {"socket": RacingProbe, "AF_UNIX": 1, "SOCK_STREAM": 1})
    monkeypatch.setattr(server_mod, "socket", fake_socket)
    try:
        assert Server.sweep_stale(str(tmp_path), min_age_s=0) == 0
        assert os.path.exists(path), "the new agent's socket was removed"
    finally:
        for r in rebound:
            r.close()


def test_workers_that_are_not_our_children_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    st = _hooks._IterState(_hooks._LoaderState(10_000), 1, 10_000, 1)
    st.pids = (1,)  # pid 1 is not our child (as a forkserver's workers are not): waitid gives ECHILD
    monkeypatch.setattr(_hooks.R, "by_key", {10_000: st})
    monkeypatch.setattr(_hooks.R, "degraded", {})
    _hooks.scan_worker_deaths()
    assert "ECHILD" in _hooks.R.degraded.get("worker_deaths", "")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        st.pids = (child.pid,)  # a child of ours, alive: waitid works, the note goes
        _hooks.scan_worker_deaths()
        assert "worker_deaths" not in _hooks.R.degraded
    finally:
        child.kill()
        child.wait()
