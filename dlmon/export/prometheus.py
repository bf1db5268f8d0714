"""``--prometheus [HOST:]PORT``: serve the newest snapshot as Prometheus metrics.

The sampling pipeline hands every snapshot to :class:`Exporter` (a sink), which keeps the run's
counters and publishes one immutable :class:`Published` with a single attribute assignment. A
scrape renders only that object: it never walks /proc nor reads a PSS, and it takes no lock the
sampler (let alone the training) could wait on. Series of processes that are gone vanish with the
next snapshot, because each scrape renders only the current one.
"""

from __future__ import annotations

import gzip
import ipaddress
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer, choose_encoder, generate_latest, gzip_accepted
from prometheus_client.registry import Collector

from dlmon import __version__
from dlmon.analysis.events import CLEARED, events
from dlmon.analysis.wait import wall_wait
from dlmon.export.metrics import GROUPS, Published
from dlmon.model import Snapshot

DEFAULT_HOST = "127.0.0.1"


class AddressError(ValueError):
    """A --prometheus value that is not [HOST:]PORT."""


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    @property
    def explicit_host(self) -> bool:
        return self.host != DEFAULT_HOST

    @property
    def loopback(self) -> bool:
        """Reachable from this machine only: 127.0.0.0/8, ::1 or the name localhost."""
        if self.host.lower() in ("localhost", "localhost.", "ip6-localhost"):
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_address(text: str) -> Address:
    """``9108``, ``0.0.0.0:9108``, ``[::1]:9108`` or ``localhost:9108``; 127.0.0.1 by default.
    Port 0 picks a free port (printed at start)."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep:
        host = DEFAULT_HOST
    elif host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not _is_ip(host):
            raise AddressError(f"--prometheus {text!r}: {host!r} in brackets is not an IPv6 address")
    elif not host:
        raise AddressError(f"--prometheus {text!r}: a host before ':' is missing (or give only a PORT)")
    elif ":" in host:
        raise AddressError(f"--prometheus {text!r}: write an IPv6 address in brackets, [::1]:PORT")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise AddressError(f"--prometheus {text!r}: PORT must be a number from 0 to 65535")
    return Address(host, int(port_text))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Exporter:
    """The pipeline sink: keeps run-long counters, publishes the newest state atomically."""

    def __init__(self, *, pid_labels: bool = False) -> None:
        self._pid_labels = pid_labels
        self._previous: Snapshot | None = None
        self._raised: dict[tuple[str, str], int] = {}
        self._wait_s: dict[str, float] = {}
        self.latest: Published | None = None  # read by scrapes; replaced whole, never mutated

    def __call__(self, snapshot: Snapshot) -> None:
        previous = self._previous.alerts if self._previous is not None else ()
        for event in events(previous, snapshot.alerts):
            if event.action != CLEARED:
                key = (event.alert.kind, event.alert.severity)
                self._raised[key] = self._raised.get(key, 0) + 1
        current = {loader.id for loader in snapshot.loaders}
        self._wait_s = {lid: seconds for lid, seconds in self._wait_s.items() if lid in current}  # bounded
        if snapshot.interval_s:
            for loader in snapshot.loaders:
                share = wall_wait(loader)  # of wall time: a validation burst's own ratio over-counts
                if share is not None:
                    waited = share * snapshot.interval_s
                    self._wait_s[loader.id] = self._wait_s.get(loader.id, 0.0) + waited
                else:
                    self._wait_s.setdefault(loader.id, 0.0)
        self._previous = snapshot
        self.latest = Published(
            snapshot,
            MappingProxyType(dict(self._raised)),
            MappingProxyType(dict(self._wait_s)),
            self._pid_labels,
        )


# ``--all-jobs``: (job pid, its published state) per job; every series then gets a ``job`` label
JobsPublished = tuple[tuple[str, Published], ...]
Latest = Published | JobsPublished | None


class Publisher(Protocol):
    """What a scrape renders from (its ``latest``): an :class:`Exporter`, or
    ``dlmon.export.jobs.JobsExporter`` for every job of the user. (A source of snapshots is
    ``dlmon.flow.sources.Source``.)"""

    @property
    def latest(self) -> Latest: ...


class SnapshotCollector(Collector):
    """Renders one published state (``exporter.latest`` unless told which)."""

    def __init__(self, exporter: Publisher) -> None:
        self._exporter = exporter
        self.pinned: Latest = None

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("dlmon_build_info", "dlmon's version.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        published = self.pinned if self.pinned is not None else self._exporter.latest
        if isinstance(published, tuple):
            yield from render_jobs(published)
        elif published is not None:
            yield from render(published)


def render(published: Published) -> Iterator[Metric]:
    yield from _render(((None, published),))


def render_jobs(jobs: JobsPublished) -> Iterator[Metric]:
    """Several jobs in one exposition: each family once (one HELP/TYPE), a ``job`` label first."""
    yield from _render(jobs)


def _render(jobs: tuple[tuple[str | None, Published], ...]) -> Iterator[Metric]:
    with_job = any(job is not None for job, _ in jobs)
    for group in GROUPS:
        series = [(job, list(group.items(published))) for job, published in jobs]
        for metric in group.metrics:
            family_type = CounterMetricFamily if metric.counter else GaugeMetricFamily
            names = ["job", *group.labels] if with_job else list(group.labels)
            family: Any = family_type(metric.name, metric.help, labels=names)
            for job, items in series:
                for labels, obj in items:
                    value = metric.read(obj)
                    if value is not None:
                        family.add_metric([job, *labels] if with_job else list(labels), value)
            if family.samples:
                yield family


def registry_for(exporter: Publisher) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(exporter))
    return registry


def exposition(exporter: Exporter) -> bytes:
    """The /metrics body in the classic text format, rendered afresh."""
    return generate_latest(registry_for(exporter))


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], list[bytes]]


def metrics_app(exporter: Publisher) -> WsgiApp:
    """/metrics, rendered at most once per published snapshot and format: formatting ~700 series
    costs milliseconds (prometheus-client), so repeated scrapes (HA pairs, curl) get the cached
    bytes. The lock is only between HTTP threads; the sampler never takes it."""
    collector = SnapshotCollector(exporter)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    cache: dict[tuple[str, bool], tuple[Latest, list[tuple[str, str]], bytes]] = {}
    lock = threading.Lock()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET, HEAD")])
            return [b"dlmon serves /metrics to GET and HEAD only\n"]
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"dlmon serves /metrics\n"]
        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        zipped = gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", ""))
        with lock:
            published = exporter.latest
            hit = cache.get((content_type, zipped))
            if hit is None or hit[0] is not published or published is None:
                collector.pinned = published
                body = encoder(registry)
                headers = [("Content-Type", content_type)]
                if zipped:
                    body = gzip.compress(body, compresslevel=1)
                    headers.append(("Content-Encoding", "gzip"))
                hit = (published, headers, body)
                cache[(content_type, zipped)] = hit
        start_response("200 OK", [*hit[1], ("Content-Length", str(len(hit[2])))])
        return [] if method == "HEAD" else [hit[2]]

    return app


@dataclass
class Server:
    address: Address
    port: int
    _shutdown: Callable[[], None]

    @property
    def url(self) -> str:
        host = f"[{self.address.host}]" if ":" in self.address.host else self.address.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._shutdown()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log on dlmon's stderr (it is the dashboard's or the alert log's)."""


def serve(exporter: Publisher, address: Address) -> Server:
    """Serve /metrics on a daemon thread; raises OSError when the address cannot be bound."""
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET

    class Server_(ThreadingWSGIServer):
        address_family = family

    httpd = make_server(address.host, address.port, metrics_app(exporter), Server_, _QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="dlmon-metrics", daemon=True)
    thread.start()

    def shutdown() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)

    return Server(address, int(httpd.server_port), shutdown)


def start_line(server: Server) -> str:
    """What dlmon prints at start: always the URL, and a warning when it is not loopback-only."""
    line = f"dlmon: serving Prometheus metrics on {server.url}"
    if server.address.explicit_host and server.address.loopback:
        line += f" (bound to {server.address.host}, as asked: loopback, reachable from this machine only)"
    elif not server.address.loopback:
        line += f" (bound to {server.address.host}, as asked: reachable by whoever can reach that address)"
    return line


__all__ = [
    "DEFAULT_HOST",
    "Address",
    "AddressError",
    "Exporter",
    "Server",
    "SnapshotCollector",
    "exposition",
    "parse_address",
    "render",
    "render_jobs",
    "serve",
    "start_line",
]
