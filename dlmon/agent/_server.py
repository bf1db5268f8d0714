"""The agent's transport: one daemon thread serving a Unix stream socket, one JSON line per request.

The protocol (requests, the shape of every reply, its version) is ``dlmon.agent.wire``: this
module only serves it. Anything but a known request gets ``{"error": ...}`` and a close; a peer
with another uid (SO_PEERCRED) is closed without a word.

Replies are cached for up to ``REPLY_CACHE_S`` when clients ask faster than ``REPLY_RATE`` a
second, so ``time_ns`` (when the reply was built) may be a little older than the request.

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

from dlmon.agent import _hooks, _journal, _rank, wire
from dlmon.agent._paths import (
    SUN_PATH_MAX,
    ensure_socket_dir,
    fits_sun_path,
    short_socket_dirs,
    socket_dir,
    socket_path,
)

READ_LIMIT = 4096
CONN_DEADLINE_S = 2.0
MAX_CONNS = 16
MAX_REPLY = 4 * 1024 * 1024
STALE_MIN_AGE_S = 10.0
ACCEPT_PAUSE_S = 1.0  # accept() failing for want of fds or memory: stop watching the listener this long
# Replies are rebuilt at most REPLY_RATE times a second on average (bursts of REPLY_BURST); between
# rebuilds a client gets the previous reply if it is younger than REPLY_CACHE_S. A dashboard polling
# once a second always gets a fresh reply; a client polling in a loop cannot slow the training down.
# Connections are accepted at most ACCEPT_RATE a second on average (bursts of ACCEPT_BURST): each
# costs the agent thread GIL time in the training process, so a client connecting in a loop (or 50
# of them) would slow the training down; beyond the rate they wait in the listen backlog.
ACCEPT_RATE = 200.0
ACCEPT_BURST = 64.0
REPLY_CACHE_S = 0.2
REPLY_RATE = 5.0
REPLY_BURST = 8.0
STACKS_MIN_GAP_S = 1.0  # stacks are built at most once a second, whoever asks
MAX_STACK_THREADS = 32
MAX_STACK_FRAMES = 40
MAX_REQUEST_BRACKETS = 8
BAD_REQUEST = wire.encode(wire.error_reply("bad request: not a JSON line"))
_SEND = wire.COUNTERS_REQUEST.decode().strip()
UNKNOWN_REQUEST = wire.encode(wire.error_reply(f"unknown request; send {_SEND}"))
TOO_LARGE = wire.encode(wire.error_reply("reply too large"))
_TRANSIENT_ACCEPT_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})


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
        self.accept_paused_until: float | None = None
        self.accept_error: str | None = None
        self.reply_cache: bytes | None = None
        self.reply_cache_t = 0.0
        self.reply_tokens = REPLY_BURST
        self.accept_tokens = ACCEPT_BURST
        self.accept_tokens_t = time.monotonic()
        self.reply_tokens_t = time.monotonic()
        self.builds = 0
        self.stacks_cache: bytes | None = None
        self.stacks_t = 0.0

    # -- setup ---------------------------------------------------------------------------------

    def open(self) -> None:
        d, path = self._place()
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
        _journal.set_directory(d, self.pid)
        self.listener = sock
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self._run, name="dlmon-agent", daemon=True)
        self.thread.start()

    def _place(self) -> tuple[str, str]:
        """(directory, socket path): the usual place, or a short one of the same privacy when the
        usual path is too long for AF_UNIX (a long TMPDIR); raises when none fits."""
        name = os.path.basename(socket_path(self.pid))
        usual = socket_dir()
        for d in (usual, *short_socket_dirs()):
            path = os.path.join(d, name)
            if fits_sun_path(path):
                return ensure_socket_dir(d), path
        raise OSError(
            errno.ENAMETOOLONG,
            f"socket path {os.path.join(usual, name)} is longer than AF_UNIX's {SUN_PATH_MAX} bytes",
        )

    @staticmethod
    def _clear_stale(path: str) -> None:
        """Remove a socket left by a dead process with our pid; refuse one that may still be served.

        Only a refused connect (ECONNREFUSED: nobody listens) makes a socket stale. A connect that
        succeeds or finds the backlog full (EAGAIN) means a live agent, perhaps of another pid
        namespace; any other error is not proof either, so the socket is left alone.
        """
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise OSError(errno.EEXIST, f"{path} is a directory")
        if stat.S_ISSOCK(st.st_mode):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.setblocking(False)
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                pass  # nobody listens: stale
            except FileNotFoundError:
                return
            except OSError as exc:
                raise OSError(
                    errno.EADDRINUSE, f"{path} may be served by a live process ({exc.strerror or exc})"
                ) from exc
            else:
                raise OSError(
                    errno.EADDRINUSE, f"{path} is served by a live process (another pid namespace?)"
                )
            finally:
                probe.close()
        _unlink_if_same(path, st)

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
                    if _unlink_if_same(path, st):  # not if another agent bound the name meanwhile
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
                _journal.sweep_old(os.path.dirname(self.path))
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
        now = time.monotonic()
        paused = self.accept_paused_until
        if paused is not None:
            if now >= paused:
                self._resume_accepting()
            else:
                timeout = min(timeout, paused - now)
        if self.conns:
            timeout = min(timeout, min(c.deadline for c in self.conns.values()) - now)
        timeout = max(0.0, timeout)
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
                except Exception as exc:  # one request's failure is that connection's alone
                    self.error = f"{type(exc).__name__}: {exc}"[:300]
                    with contextlib.suppress(Exception):
                        self._close(conn)
        now = time.monotonic()
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            self._close(conn)

    def _accept(self) -> None:
        lst = self.listener
        if lst is None or self.sel is None:
            return
        for _ in range(64):
            now = time.monotonic()
            self.accept_tokens = min(
                ACCEPT_BURST, self.accept_tokens + (now - self.accept_tokens_t) * ACCEPT_RATE
            )
            self.accept_tokens_t = now
            if self.accept_tokens < 1.0:  # over the rate: stop watching the listener until a token
                self._pause_accepting(None, (1.0 - self.accept_tokens) / ACCEPT_RATE)
                return
            try:
                sock, _addr = lst.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in _TRANSIENT_ACCEPT_ERRNOS:
                    # EMFILE, ENFILE, ENOBUFS, ENOMEM...: the connection stays in the backlog and the
                    # listener stays readable; watching it now would spin. Look again in a while.
                    self._pause_accepting(exc)
                return
            self.accept_error = None
            self.accept_tokens -= 1.0
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

    def _pause_accepting(self, exc: OSError | None, seconds: float = ACCEPT_PAUSE_S) -> None:
        if exc is not None:
            self.accept_error = f"accept: {errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}"
        self.accept_paused_until = time.monotonic() + seconds
        if self.sel is not None and self.listener is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self.sel.unregister(self.listener)

    def _resume_accepting(self) -> None:
        self.accept_paused_until = None
        if self.sel is not None and self.listener is not None:
            try:
                self.sel.register(self.listener, selectors.EVENT_READ, None)
            except KeyError:
                pass  # still registered
            except (ValueError, OSError) as exc:
                self.accept_error = f"re-register: {type(exc).__name__}: {exc}"
                self.accept_paused_until = time.monotonic() + ACCEPT_PAUSE_S

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
        # A request is one flat object: anything nested deeper is refused before parsing, so a
        # hostile line never costs a deep recursion (json.loads raises RecursionError, and would
        # overflow the C stack under a raised recursion limit).
        if line.count(b"[") + line.count(b"{") > MAX_REQUEST_BRACKETS:
            return BAD_REQUEST
        try:
            req = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError, MemoryError):
            return BAD_REQUEST
        if isinstance(req, dict) and req.get(wire.GET) == wire.STACKS:
            return self._stacks()
        if not isinstance(req, dict) or req.get(wire.GET) != wire.COUNTERS:
            return UNKNOWN_REQUEST
        now = time.monotonic()
        self.reply_tokens = min(REPLY_BURST, self.reply_tokens + (now - self.reply_tokens_t) * REPLY_RATE)
        self.reply_tokens_t = now
        cached = self.reply_cache
        if cached is not None and self.reply_tokens < 1.0 and now - self.reply_cache_t < REPLY_CACHE_S:
            return cached
        self.reply_tokens = max(0.0, self.reply_tokens - 1.0)
        self.builds += 1
        try:
            body = json.dumps(build_counters(self), separators=(",", ":"), default=str)
        except Exception as exc:
            body = json.dumps(wire.error_reply(f"internal: {type(exc).__name__}: {exc}"))
        data = body.encode("utf-8") + b"\n"
        if len(data) > MAX_REPLY:
            data = TOO_LARGE
        self.reply_cache = data
        self.reply_cache_t = time.monotonic()
        return data

    def _stacks(self) -> bytes:
        """Every thread's Python stack (main thread first), asked for only when dlmon sees a stall."""
        now = time.monotonic()
        if now - self.stacks_t < STACKS_MIN_GAP_S and self.stacks_cache is not None:
            return self.stacks_cache
        try:
            body = json.dumps(
                wire.stacks_reply(pid=os.getpid(), unix_time=time.time(), threads=thread_stacks()),
                separators=(",", ":"),
            )
        except Exception as exc:
            body = json.dumps(wire.error_reply(f"internal: {type(exc).__name__}: {exc}"))
        self.stacks_cache = body.encode("utf-8") + b"\n"
        self.stacks_t = now
        return self.stacks_cache

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


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    # inode numbers are reused at once: a socket bound after an unlink may get the same one
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns


def _unlink_if_same(path: str, st: os.stat_result) -> bool:
    """Unlink ``path`` only if it is still the file ``st`` describes (device, inode, times)."""
    try:
        if _identity(os.lstat(path)) != _identity(st):
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------------------------------------
# the reply


def _torch_version(torch_mod: Any) -> str | None:
    v = getattr(torch_mod, "__version__", None)
    return str(v) if v is not None else None


_DEVICE_STAT_KEYS = (
    ("allocated", "allocated_bytes.all.current"),  # torch.cuda.memory_allocated
    ("reserved", "reserved_bytes.all.current"),  # torch.cuda.memory_reserved
    ("peak_allocated", "allocated_bytes.all.peak"),  # torch.cuda.max_memory_allocated
)


def _device_memory(cuda: Any, d: int) -> wire.CudaDeviceWire:
    """One ``memory_stats(d)`` call (each call flattens the stats under the allocator's mutex)."""
    try:
        stats = cuda.memory_stats(d)
    except Exception:
        stats = None
    got: dict[str, int | None] = {}
    for key, stat_key in _DEVICE_STAT_KEYS:
        v = stats.get(stat_key, 0) if isinstance(stats, dict) else None
        got[key] = int(v) if isinstance(v, int) and not isinstance(v, bool) else None
    try:
        p = cuda.get_device_properties(d)
        uuid = getattr(p, "uuid", None)
        props = (str(getattr(p, "name", None) or "") or None, str(uuid) if uuid is not None else None)
    except Exception:
        props = (None, None)
    return wire.cuda_device_wire(
        device=d,
        allocated=got["allocated"],
        reserved=got["reserved"],
        peak_allocated=got["peak_allocated"],
        name=props[0],
        uuid=props[1],
    )


def _cuda_figures(
    torch_mod: Any,
) -> tuple[bool, list[wire.CudaDeviceWire], wire.PinnedWire | None, str | None]:
    """(initialized, per-device memory, pinned, error). Never initialises CUDA itself."""
    cuda = getattr(torch_mod, "cuda", None)
    if cuda is None:
        return False, [], None, None
    try:
        if not cuda.is_initialized():
            return False, [], None, None
    except Exception as exc:
        return False, [], None, f"{type(exc).__name__}: {exc}"
    devices: list[wire.CudaDeviceWire] = []
    error: str | None = None
    try:
        for d in range(int(cuda.device_count())):
            devices.append(_device_memory(cuda, d))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return True, devices, _pinned(cuda), error


# torch.cuda.host_memory_stats() (the caching host allocator's pinned pool) changed the meaning of
# its keys: torch 2.7-2.9 (c10 HostStats with reserved_bytes) give the pool as reserved_bytes and
# the part handed out as allocated_bytes; later torch (HostStats with active_bytes, 2.13 checked)
# give the pool as allocated_bytes ("active + cached") and the part handed out as active_bytes.
# The era is told by the names the dict has, never by which of its figures read: an unreadable
# pool figure must not let the in-use part be taken for the pool. reserved_bytes, where present,
# is the pool (torch's word for it in every allocator); active_bytes, where present, the part in use.
_POOL_RESERVED, _ALLOCATED, _ACTIVE = "reserved_bytes", "allocated_bytes", "active_bytes"


def _has(stats: dict[Any, Any], name: str) -> bool:
    """``stats`` has the stat ``name``, flat ("name.current") or nested ({"name": {...}})."""
    return any(isinstance(k, str) and (k == name or k.startswith(f"{name}.")) for k in stats)


def _stat(stats: dict[Any, Any], name: str) -> tuple[int, str] | None:
    """(bytes, key) of ``name``'s current value, flat or nested, with or without ``.all``."""
    for key in (f"{name}.current", f"{name}.all.current"):
        v: Any = stats.get(key)
        if v is None:  # nested form: {"allocated_bytes": {"current": ...}}
            v = stats
            for part in key.split("."):
                v = v.get(part) if isinstance(v, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v, key
    return None


def parse_host_memory_stats(stats: Any) -> tuple[int, int | None, str] | None:
    """(pool bytes, in-use bytes or None, source) from torch.cuda.host_memory_stats() output of
    any torch era (see _POOL_RESERVED), flat or nested; None if the pool is absent or unreadable."""
    if not isinstance(stats, dict):
        return None
    reserved = _has(stats, _POOL_RESERVED)
    pool_name = _POOL_RESERVED if reserved else _ALLOCATED
    in_use_name = _ACTIVE if _has(stats, _ACTIVE) else _ALLOCATED if reserved else None
    pool = _stat(stats, pool_name)
    if pool is None:
        return None
    source = f"torch.cuda.host_memory_stats:{pool[1]}"
    in_use = _stat(stats, in_use_name) if in_use_name is not None else None
    if in_use is None:
        return pool[0], None, source
    return pool[0], in_use[0], f"{source} (in use: {in_use[1]})"


def _pinned(cuda: Any) -> wire.PinnedWire | None:
    fn = getattr(cuda, "host_memory_stats", None)
    if fn is None:
        return None
    try:
        got = parse_host_memory_stats(fn())
    except Exception:
        return None
    if got is None:
        return None
    return wire.pinned_wire(bytes=got[0], in_use=got[1], source=got[2])


def _loader_wire(ls: _hooks._LoaderState, now_pc: int) -> wire.LoaderWire:
    iters: list[wire.IteratorWire] = []
    pids: list[int] = []
    pend_wait = pend_startup = pend_compute = 0
    for it in list(ls.iters.values()):
        ip = list(it.pids)
        # a call in progress (t_in: perf_counter_ns at its entry; 0 when none): what it will add
        # to the counters when it returns, as of now. The step before it counts as compute.
        t_in, in_epoch, last_ret = it.t_in, it.in_epoch, it.last_ret
        in_call = max(0, now_pc - t_in) if t_in else 0
        if in_call:
            if in_epoch:
                pend_wait += in_call
                if last_ret:
                    pend_compute += max(0, t_in - last_ret)
            else:
                pend_startup += in_call
        iters.append(wire.iterator_wire(id=it.serial, worker_pids=ip, in_call_ns=in_call))
        pids.extend(ip)
    c = list(ls.c)
    return wire.loader_wire(
        id=ls.serial,
        name=ls.name,
        file=ls.file,
        line=ls.line,
        function=ls.function,
        site=ls.site_kind,
        alive=ls.alive,
        settings=dict(ls.settings),
        batches_total=int(c[_hooks.B_BATCHES]),
        samples_total=int(c[_hooks.B_SAMPLES]),
        wait_ns_total=int(c[_hooks.B_WAIT]),
        compute_ns_total=int(c[_hooks.B_COMPUTE]),
        startup_wait_ns_total=int(c[_hooks.B_STARTUP]),
        end_wait_ns_total=int(c[_hooks.B_END]),
        epochs=int(c[_hooks.B_EPOCHS]),
        epochs_started=int(c[_hooks.B_EPOCHS_STARTED]),
        wait_ns_pending=pend_wait,
        startup_wait_ns_pending=pend_startup,
        compute_ns_pending=pend_compute,
        worker_pids=pids,
        batches_per_worker=[int(x) for x in list(ls.per_worker)],
        iterators=iters,
        role=ls.role,
        role_source=ls.role_source,
        framework=ls.framework,
        iterated=ls.iterated,
        replaced_by=ls.replaced_by,
    )


def thread_stacks() -> list[wire.ThreadWire]:
    """The Python stack of each thread (innermost call last), main thread first; bounded."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    me = threading.get_ident()
    order = sorted(frames, key=lambda ident: (ident != main_id, names.get(ident, "")))
    out: list[wire.ThreadWire] = []
    for ident in order[:MAX_STACK_THREADS]:
        if ident == me:
            continue
        stack: list[list[Any]] = []
        f: Any = frames[ident]
        while f is not None and len(stack) < MAX_STACK_FRAMES:  # no linecache: no file reads here
            stack.append([f.f_code.co_filename, f.f_lineno, f.f_code.co_name])
            f = f.f_back
        stack.reverse()
        out.append(wire.thread_wire(name=names.get(ident, str(ident)), main=ident == main_id, frames=stack))
    return out


def build_counters(server: Server | None) -> wire.CountersReply:
    """The reply to ``{"get": "counters"}``: cumulative counters, so a missed poll loses nothing."""
    R = _hooks.R
    with contextlib.suppress(Exception):
        _hooks.scan_worker_deaths()  # cheap; catches deaths the signal handler did not see
    _hooks.prune_loaders()
    torch_mod = sys.modules.get("torch")
    time_ns = time.monotonic_ns()
    unix_time = time.time()
    degraded = dict(R.degraded)
    if server is not None and server.error:
        degraded["server"] = server.error
    if server is not None and server.accept_error:
        degraded["server_accept"] = server.accept_error
    now_pc = time.perf_counter_ns()
    loaders = [_loader_wire(ls, now_pc) for ls in list(R.loaders.values())]
    deaths: list[wire.WorkerDeathWire] = [d.copy() for d in list(R.deaths)]
    cuda_init: bool = False
    devices: list[wire.CudaDeviceWire] = []
    pinned: wire.PinnedWire | None = None
    err: str | None = None
    if torch_mod is not None:
        cuda_init, devices, pinned, err = _cuda_figures(torch_mod)
    if err:
        degraded["cuda"] = err
    return wire.counters_reply(
        pid=os.getpid(),
        agent_id=server.agent_id if server is not None else None,
        time_ns=time_ns,
        unix_time=unix_time,
        python=sys.version.split()[0],
        torch_imported=torch_mod is not None,
        torch_version=_torch_version(torch_mod) if torch_mod is not None else None,
        hooks_patched=R.patched,
        hooks=sorted(k for k, v in R.hooks.items() if v),
        degraded=degraded,
        loaders=loaders,
        worker_deaths=deaths,
        cuda_initialized=cuda_init,
        cuda=devices,
        pinned=pinned,
        num_threads=R.num_threads,
        num_threads_time_ns=R.num_threads_ns,
        rank=_rank.current(),
        injected_unix_time=R.injected_unix_time,
    )
