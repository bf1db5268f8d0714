"""The agent's transport: one daemon thread serving a Unix stream socket, one JSON line per request.

Protocol: the client connects, sends ``{"get": "counters"}\\n``, reads one JSON line, and the
agent closes the connection. Anything else gets ``{"error": ...}`` and a close; a peer with
another uid (SO_PEERCRED) is closed without a word.

Reply (wire version ``v`` 1; every counter cumulative since the agent started; ns are
``time.perf_counter_ns`` durations, ``time_ns`` is ``time.monotonic_ns()`` at the reply)::

    v, pid, agent_id (random per agent: a new one behind the same pid means pid reuse),
    time_ns, unix_time, python, torch_imported, torch_version, hooks_patched,
    hooks [names that work], degraded {hook: reason},
    loaders [{id, name ("file.py:line"), file, line, function, site ("constructed" |
              "first_iterated"), alive, num_workers, batch_size, prefetch_factor, pin_memory,
              pin_memory_effective, persistent_workers, drop_last, timeout,
              multiprocessing_context, dataset, dataset_kind, batches_total, samples_total,
              wait_ns_total, compute_ns_total, startup_wait_ns_total, end_wait_ns_total,
              epochs, epochs_started, worker_pids, batches_per_worker,
              iterators [{id, worker_pids}]}],
    worker_deaths [{pid, worker_id, loader_id, iterator_id, signal, signal_name, exit_code,
                    core_dumped, time_ns, unix_time}],
    cuda_initialized, cuda [{device, allocated, reserved, peak_allocated, name, uuid}],
    pinned {bytes, source} | null, num_threads, num_threads_time_ns

The thread never blocks the training: non-blocking sockets under one ``selectors`` loop, at most
``MAX_CONNS`` connections, a 4 KiB read limit and a deadline per connection. The only time it
holds the GIL for long is while it builds a reply (tens of microseconds).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import selectors
import socket
import stat
import struct
import sys
import threading
import time
from typing import Any

from dlmon.agent import _hooks
from dlmon.agent._paths import ensure_socket_dir, socket_path

WIRE_VERSION = 1
READ_LIMIT = 4096
CONN_DEADLINE_S = 2.0
MAX_CONNS = 16
MAX_REPLY = 4 * 1024 * 1024
STALE_MIN_AGE_S = 10.0


class _Conn:
    __slots__ = ("buf", "deadline", "out", "sock")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.deadline = deadline
        self.out: memoryview | None = None


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end (Linux SO_PEERCRED); None when it cannot be known."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    size = struct.calcsize("3i")
    raw = sock.getsockopt(socket.SOL_SOCKET, opt, size)
    _pid, uid, _gid = struct.unpack("3i", raw[:size])
    return int(uid)


class Server:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.path: str | None = None
        self.inode: tuple[int, int] | None = None
        self.agent_id = os.urandom(8).hex()
        self.started_ns = time.monotonic_ns()
        self.listener: socket.socket | None = None
        self.sel: selectors.BaseSelector | None = None
        self.conns: dict[int, _Conn] = {}
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.error: str | None = None
        self.allowed_uids = {os.geteuid(), os.getuid(), 0}  # root may read /proc/PID/mem anyway
        self.served = 0
        self.refused = 0

    # -- setup ---------------------------------------------------------------------------------

    def open(self) -> None:
        d = ensure_socket_dir()
        path = os.path.join(d, os.path.basename(socket_path(self.pid)))
        self._clear_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o600)
            sock.listen(16)
            sock.setblocking(False)
            st = os.stat(path)
        except BaseException:
            sock.close()
            raise
        self.path = path
        self.inode = (st.st_dev, st.st_ino)
        self.listener = sock
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self._run, name="dlmon-agent", daemon=True)
        self.thread.start()

    @staticmethod
    def _clear_stale(path: str) -> None:
        """Remove a socket left by a dead process with our pid; refuse one that is still answered."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise OSError(errno.EEXIST, f"{path} is a directory")
        if stat.S_ISSOCK(st.st_mode):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(0.2)
            try:
                probe.connect(path)
            except OSError:
                pass  # nobody listens: stale
            else:
                raise OSError(
                    errno.EADDRINUSE, f"{path} is served by a live process (another pid namespace?)"
                )
            finally:
                probe.close()
        os.unlink(path)

    @staticmethod
    def sweep_stale(directory: str, min_age_s: float = STALE_MIN_AGE_S, limit: int = 512) -> int:
        """Remove sockets nobody listens on any more (their process was killed: no atexit ran).

        A socket counts as stale when a connect is refused, which holds across pid namespaces,
        and when it is older than ``min_age_s``, so that an agent between bind() and listen()
        is never taken for a dead one.
        """
        removed = 0
        now = time.time()
        try:
            names = os.listdir(directory)[:limit]
        except OSError:
            return 0
        for name in names:
            if not name.endswith(".sock"):
                continue
            path = os.path.join(directory, name)
            try:
                st = os.lstat(path)
                if not stat.S_ISSOCK(st.st_mode) or now - st.st_mtime < min_age_s:
                    continue
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                probe.setblocking(False)
                try:
                    probe.connect(path)
                except ConnectionRefusedError:
                    os.unlink(path)
                    removed += 1
                except OSError:
                    pass  # EAGAIN: a live agent with a full backlog
                finally:
                    probe.close()
            except OSError:
                continue
        return removed

    # -- loop ----------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.path is not None:
            with contextlib.suppress(Exception):
                self.sweep_stale(os.path.dirname(self.path))
        failures = 0
        while not self.stopping:
            try:
                self._step()
                failures = 0
            except Exception as exc:  # never let the thread die; back off if something loops
                failures += 1
                self.error = f"{type(exc).__name__}: {exc}"
                time.sleep(min(1.0, 0.01 * failures))

    def _step(self) -> None:
        sel = self.sel
        if sel is None:
            self.stopping = True
            return
        timeout = 0.5
        if self.conns:
            now = time.monotonic()
            timeout = max(0.0, min(timeout, min(c.deadline for c in self.conns.values()) - now))
        for key, mask in sel.select(timeout):
            if key.data is None:
                self._accept()
            else:
                conn: _Conn = key.data
                try:
                    if mask & selectors.EVENT_READ:
                        self._read(conn)
                    elif mask & selectors.EVENT_WRITE:
                        self._write(conn)
                except OSError:
                    self._close(conn)
        now = time.monotonic()
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            self._close(conn)

    def _accept(self) -> None:
        lst = self.listener
        if lst is None or self.sel is None:
            return
        for _ in range(64):
            try:
                sock, _addr = lst.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            try:
                uid = peer_uid(sock)
            except OSError:
                uid = -1
            if uid is not None and uid not in self.allowed_uids:
                self.refused += 1
                sock.close()
                continue
            if len(self.conns) >= MAX_CONNS:  # evict the oldest: idle clients cannot lock others out
                self._close(min(self.conns.values(), key=lambda c: c.deadline))
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + CONN_DEADLINE_S)
            self.conns[sock.fileno()] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(READ_LIMIT)
        except (BlockingIOError, InterruptedError):
            return
        if not chunk:
            self._close(conn)
            return
        conn.buf += chunk
        nl = conn.buf.find(b"\n")
        if nl < 0:
            if len(conn.buf) >= READ_LIMIT:
                self._close(conn)
            return
        reply = self._answer(bytes(conn.buf[:nl]))
        conn.buf = bytearray()
        conn.out = memoryview(reply)
        if self.sel is not None:
            self.sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        out = conn.out
        if out is None:
            self._close(conn)
            return
        try:
            n = conn.sock.send(out)
        except (BlockingIOError, InterruptedError):
            return
        conn.out = out[n:]
        if not len(conn.out):
            self.served += 1
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        try:
            fd = conn.sock.fileno()
            if self.sel is not None and fd >= 0:
                with contextlib.suppress(KeyError, ValueError):
                    self.sel.unregister(conn.sock)
            self.conns.pop(fd, None)
        finally:
            conn.sock.close()

    def _answer(self, line: bytes) -> bytes:
        try:
            req = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return b'{"error": "bad request: not a JSON line"}\n'
        if not isinstance(req, dict) or req.get("get") != "counters":
            return b'{"error": "unknown request; send {\\"get\\": \\"counters\\"}"}\n'
        try:
            body = json.dumps(build_counters(self), separators=(",", ":"), default=str)
        except Exception as exc:
            body = json.dumps({"error": f"internal: {type(exc).__name__}: {exc}"})
        data = body.encode("utf-8") + b"\n"
        if len(data) > MAX_REPLY:
            return b'{"error": "reply too large"}\n'
        return data

    # -- teardown ------------------------------------------------------------------------------

    def close(self, unlink: bool) -> None:
        """Stop serving. ``unlink`` removes the socket file if it is still the one we bound."""
        self.stopping = True
        for conn in list(self.conns.values()):
            with contextlib.suppress(Exception):
                conn.sock.close()
        self.conns.clear()
        if self.listener is not None:
            with contextlib.suppress(Exception):
                self.listener.close()
        if self.sel is not None:
            with contextlib.suppress(Exception):
                self.sel.close()
        self.sel = None
        self.listener = None
        if unlink and self.path is not None and os.getpid() == self.pid:
            try:
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self.inode:
                    os.unlink(self.path)
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# the reply


def _torch_version(torch_mod: Any) -> str | None:
    v = getattr(torch_mod, "__version__", None)
    return str(v) if v is not None else None


def _cuda_figures(torch_mod: Any) -> tuple[bool, list[dict[str, Any]], dict[str, Any] | None, str | None]:
    """(initialized, per-device memory, pinned, error). Never initialises CUDA itself."""
    cuda = getattr(torch_mod, "cuda", None)
    if cuda is None:
        return False, [], None, None
    try:
        if not cuda.is_initialized():
            return False, [], None, None
    except Exception as exc:
        return False, [], None, f"{type(exc).__name__}: {exc}"
    devices: list[dict[str, Any]] = []
    error: str | None = None
    try:
        for d in range(int(cuda.device_count())):
            dev: dict[str, Any] = {"device": d}
            for key, fn in (
                ("allocated", "memory_allocated"),
                ("reserved", "memory_reserved"),
                ("peak_allocated", "max_memory_allocated"),
            ):
                try:
                    dev[key] = int(getattr(cuda, fn)(d))
                except Exception:
                    dev[key] = None
            try:
                props = cuda.get_device_properties(d)
                dev["name"] = str(getattr(props, "name", None) or "") or None
                uuid = getattr(props, "uuid", None)
                dev["uuid"] = str(uuid) if uuid is not None else None
            except Exception:
                dev["name"] = None
                dev["uuid"] = None
            devices.append(dev)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return True, devices, _pinned(cuda), error


_PINNED_KEYS = (
    "allocated_bytes.current",  # torch >= 2.5: pinned blocks owned by the host allocator
    "allocated_bytes.all.current",
    "reserved_bytes.current",
    "reserved_bytes.all.current",
)


def parse_host_memory_stats(stats: Any) -> tuple[int, str] | None:
    """(bytes, key) from torch.cuda.host_memory_stats() output, flat or nested; None if absent."""
    if not isinstance(stats, dict):
        return None
    for key in _PINNED_KEYS:
        v: Any = stats.get(key)
        if v is None:  # nested form: {"allocated_bytes": {"current": ...}}
            v = stats
            for part in key.split("."):
                v = v.get(part) if isinstance(v, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v, key
    return None


def _pinned(cuda: Any) -> dict[str, Any] | None:
    fn = getattr(cuda, "host_memory_stats", None)
    if fn is None:
        return None
    try:
        got = parse_host_memory_stats(fn())
    except Exception:
        return None
    if got is None:
        return None
    return {"bytes": got[0], "source": f"torch.cuda.host_memory_stats:{got[1]}"}


def _loader_wire(ls: _hooks._LoaderState) -> dict[str, Any]:
    c = list(ls.c)
    iters = []
    pids: list[int] = []
    for it in list(ls.iters.values()):
        ip = list(it.pids)
        iters.append({"id": it.serial, "worker_pids": ip})
        pids.extend(ip)
    s = dict(ls.settings)
    return {
        "id": ls.serial,
        "name": ls.name,
        "file": ls.file,
        "line": ls.line,
        "function": ls.function,
        "site": ls.site_kind,
        "alive": ls.alive,
        "num_workers": s.get("num_workers"),
        "batch_size": s.get("batch_size"),
        "prefetch_factor": s.get("prefetch_factor"),
        "pin_memory": s.get("pin_memory"),
        "pin_memory_effective": s.get("pin_memory_effective"),
        "persistent_workers": s.get("persistent_workers"),
        "drop_last": s.get("drop_last"),
        "timeout": s.get("timeout"),
        "multiprocessing_context": s.get("multiprocessing_context"),
        "dataset": s.get("dataset"),
        "dataset_kind": s.get("dataset_kind"),
        "batches_total": int(c[_hooks.B_BATCHES]),
        "samples_total": int(c[_hooks.B_SAMPLES]),
        "wait_ns_total": int(c[_hooks.B_WAIT]),
        "compute_ns_total": int(c[_hooks.B_COMPUTE]),
        "startup_wait_ns_total": int(c[_hooks.B_STARTUP]),
        "end_wait_ns_total": int(c[_hooks.B_END]),
        "epochs": int(c[_hooks.B_EPOCHS]),
        "epochs_started": int(c[_hooks.B_EPOCHS_STARTED]),
        "worker_pids": pids,
        "batches_per_worker": [int(x) for x in list(ls.per_worker)],
        "iterators": iters,
    }


def build_counters(server: Server | None) -> dict[str, Any]:
    """The reply to ``{"get": "counters"}``: cumulative counters, so a missed poll loses nothing."""
    R = _hooks.R
    with contextlib.suppress(Exception):
        _hooks.scan_worker_deaths()  # cheap; catches deaths the signal handler did not see
    _hooks.prune_loaders()
    torch_mod = sys.modules.get("torch")
    out: dict[str, Any] = {
        "v": WIRE_VERSION,
        "pid": os.getpid(),
        "agent_id": server.agent_id if server is not None else None,
        "time_ns": time.monotonic_ns(),
        "unix_time": time.time(),
        "python": sys.version.split()[0],
        "torch_imported": torch_mod is not None,
        "torch_version": _torch_version(torch_mod) if torch_mod is not None else None,
        "hooks_patched": R.patched,
        "hooks": sorted(k for k, v in R.hooks.items() if v),
        "degraded": dict(R.degraded),
    }
    if server is not None and server.error:
        out["degraded"]["server"] = server.error
    out["loaders"] = [_loader_wire(ls) for ls in list(R.loaders.values())]
    out["worker_deaths"] = [dict(d) for d in list(R.deaths)]
    cuda_init: bool = False
    devices: list[dict[str, Any]] = []
    pinned: dict[str, Any] | None = None
    err: str | None = None
    if torch_mod is not None:
        cuda_init, devices, pinned, err = _cuda_figures(torch_mod)
    if err:
        out["degraded"]["cuda"] = err
    out["cuda_initialized"] = cuda_init
    out["cuda"] = devices
    out["pinned"] = pinned
    out["num_threads"] = R.num_threads
    out["num_threads_time_ns"] = R.num_threads_ns
    return out
