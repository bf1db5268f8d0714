"""``--prometheus [HOST:]PORT``: serve the newest snapshot as Prometheus metrics.

The sampling pipeline hands every snapshot to :class:`Exporter` (a sink), which keeps the run's
counters and publishes one immutable :class:`Published` with a single attribute assignment. A
scrape renders only that object: it never walks /proc nor reads a PSS, and it takes no lock the
sampler (let alone the training) could wait on. Series of processes that are gone vanish with the
next snapshot, because each scrape renders only the current one.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest, start_http_server
from prometheus_client.registry import Collector

from dlmon import __version__
from dlmon.analysis.events import CLEARED, events
from dlmon.export.metrics import GROUPS, Published
from dlmon.model import Snapshot

DEFAULT_HOST = "127.0.0.1"
Analyzer = Callable[[Snapshot], Snapshot]


class AddressError(ValueError):
    """A --prometheus value that is not [HOST:]PORT."""


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    @property
    def explicit_host(self) -> bool:
        return self.host != DEFAULT_HOST


def parse_address(text: str) -> Address:
    """``9108``, ``0.0.0.0:9108``, ``[::1]:9108`` or ``localhost:9108``; 127.0.0.1 by default.
    Port 0 picks a free port (printed at start)."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep:
        host = DEFAULT_HOST
    elif host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif not host:
        raise AddressError(f"--prometheus {text!r}: a host before ':' is missing (or give only a PORT)")
    if ":" in host and not _is_ip(host):
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

    def __init__(self) -> None:
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
        if snapshot.interval_s:
            for loader in snapshot.loaders:
                if loader.data_wait_fraction is not None:
                    waited = loader.data_wait_fraction * snapshot.interval_s
                    self._wait_s[loader.id] = self._wait_s.get(loader.id, 0.0) + waited
                else:
                    self._wait_s.setdefault(loader.id, 0.0)
        self._previous = snapshot
        self.latest = Published(
            snapshot, MappingProxyType(dict(self._raised)), MappingProxyType(dict(self._wait_s))
        )

    def wrap(self, analyzer: Analyzer | None) -> Analyzer:
        """An analyzer step that also publishes: how a pipeline owned elsewhere (the dashboard's
        live source) feeds the exporter without a new parameter."""

        def analyze_and_publish(snapshot: Snapshot) -> Snapshot:
            if analyzer is not None:
                snapshot = analyzer(snapshot)
            self(snapshot)
            return snapshot

        return analyze_and_publish


class SnapshotCollector(Collector):
    """Renders ``exporter.latest`` on each scrape: the only work a scrape does."""

    def __init__(self, exporter: Exporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("dlmon_build_info", "dlmon's version.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        published = self._exporter.latest
        if published is None:
            return
        yield from render(published)


def render(published: Published) -> Iterator[Metric]:
    for group in GROUPS:
        series = list(group.items(published))
        for metric in group.metrics:
            family_type = CounterMetricFamily if metric.counter else GaugeMetricFamily
            family: Any = family_type(metric.name, metric.help, labels=list(group.labels))
            for labels, obj in series:
                value = metric.read(obj)
                if value is not None:
                    family.add_metric(list(labels), value)
            if family.samples:
                yield family


def registry_for(exporter: Exporter) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(exporter))
    return registry


def exposition(exporter: Exporter) -> bytes:
    """The /metrics body, as a scrape would get it."""
    return generate_latest(registry_for(exporter))


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


def serve(exporter: Exporter, address: Address) -> Server:
    """Serve /metrics on a daemon thread; raises OSError when the address cannot be bound."""
    httpd, thread = start_http_server(address.port, address.host, registry_for(exporter))

    def shutdown() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)

    return Server(address, int(httpd.server_port), shutdown)


def start_line(server: Server) -> str:
    """What dlmon prints at start: always the URL, and a warning when it is not loopback-only."""
    line = f"dlmon: serving Prometheus metrics on {server.url}"
    if server.address.explicit_host:
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
    "serve",
    "start_line",
]
