"""Read the nodes' dlmon exporters directly: concurrently, each within its own timeout. A node
that does not answer, or answers with something else than an exposition, becomes a reading that
says so in one line; nothing here raises for a node's sake."""

from __future__ import annotations

import http.client
import socket
import time
import urllib.error
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from dlmon.cluster.bounded import TooLarge, TooSlow, get
from dlmon.cluster.exposition import NotExposition, Series, parse
from dlmon.cluster.readings import NEEDED, NodeReading, averaged

MAX_BODY = 16 * 1024 * 1024  # a node's /metrics beyond this is not dlmon's (~140 KiB for 8 ranks)
MAX_THREADS = 64
NEEDED_SET = frozenset(NEEDED)


def metrics_url(node: str) -> str:
    """``HOST:PORT`` -> its /metrics; a URL with a path is read as given."""
    if "://" in node:
        path = urllib.parse.urlsplit(node).path
        return node if path not in ("", "/") else node.rstrip("/") + "/metrics"
    return f"http://{node}/metrics"


def _why(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"answered HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urllib.error.URLError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, TimeoutError | socket.timeout):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "no answer: connection refused (is dlmon --prometheus running there?)"
    if isinstance(exc, socket.gaierror):
        return f"no such host ({exc.strerror or exc})"
    if isinstance(exc, OSError):
        return f"no answer: {exc.strerror or exc}"
    if isinstance(exc, http.client.HTTPException):
        return f"answered something that is not HTTP ({type(exc).__name__})"
    if isinstance(exc, UnicodeDecodeError):
        return "answered with bytes that are not text (not a dlmon exporter?)"
    return f"unreadable answer ({type(exc).__name__})"


def fetch(node: str, timeout: float) -> tuple[tuple[Series, ...], float] | str:
    """(series, when read) or why not, as one line."""
    try:
        body = get(metrics_url(node), timeout, MAX_BODY)
        read_at = time.time()
        return parse(body.decode(), NEEDED_SET), read_at
    except TooLarge:
        return f"answered more than {MAX_BODY >> 20} MiB (not a dlmon exporter?)"
    except TooSlow:
        return f"no complete answer within {2 * timeout:g} s (it answers, but too slowly)"
    except NotExposition as exc:
        return f"not a Prometheus exposition ({exc})"
    except (OSError, http.client.HTTPException, UnicodeDecodeError, ValueError) as exc:
        return _why(exc, timeout)


def scrape_nodes(
    nodes: Sequence[str],
    timeout: float,
    readings: int = 1,
    every_s: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> list[NodeReading]:
    """Each node read ``readings`` times ``every_s`` apart (the swinging per-interval figures
    averaged over them), all nodes at once; the order of ``nodes`` kept."""
    got: list[list[tuple[Series, ...]]] = [[] for _ in nodes]
    when = [0.0 for _ in nodes]
    errors: list[str | None] = [None for _ in nodes]
    with ThreadPoolExecutor(max_workers=max(1, min(MAX_THREADS, len(nodes)))) as pool:
        for i in range(readings):
            if i:
                sleep(every_s)
            # a node that has not answered once in this refresh is not asked again: each time
            # would cost the timeout, and a refresh with a dead node would take readings x timeout
            asked = [n for n in range(len(nodes)) if i == 0 or got[n]]
            answers = pool.map(lambda n: fetch(nodes[n], timeout), asked)
            for n, answer in zip(asked, answers, strict=True):
                if isinstance(answer, str):
                    errors[n] = answer if not got[n] else errors[n]  # a later miss keeps what came
                else:
                    got[n].append(answer[0])
                    when[n] = answer[1]
                    errors[n] = None
    return [
        NodeReading(node, averaged(got[n]), when[n] or time.time(), None if got[n] else errors[n])
        for n, node in enumerate(nodes)
    ]
