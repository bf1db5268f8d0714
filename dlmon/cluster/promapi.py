"""Read the nodes from a Prometheus server's HTTP API (stdlib only): one instant query per
series the view needs, the swinging per-interval figures as ``avg_over_time`` over a window,
grouped by ``instance``; two range queries for each node's trend (``read_trends``). A server that
cannot be reached, does not speak the API, or holds no dlmon series raises
:class:`PrometheusError` with one line for the user."""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.error
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dlmon.cluster.bounded import TooLarge, TooSlow, get, read_body
from dlmon.cluster.exposition import Labels, Series
from dlmon.cluster.readings import AVERAGED, NEEDED, NodeReading
from dlmon.cluster.trend import Slots, Trend, bucketed

_DROPPED = frozenset({"__name__", "instance", "job"})
# One query's answer: ~350 bytes a series, so ~90 000 series (512 nodes x 8 ranks x 20 processes
# is ~80 000 for the per-process figures); 8 queries are in flight, each parsed whole.
MAX_BODY = 32 * 1024 * 1024
MAX_ERROR_BODY = 64 * 1024


class PrometheusError(RuntimeError):
    """The server could not be read as a Prometheus: one line."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def selector(job: str | None, match: str | None) -> str:
    """The label matchers inside ``{...}``: ``job="NAME"`` and/or what ``--match`` gave."""
    parts = [f'job="{_escape(job)}"'] if job is not None else []
    if match:
        inner = match.strip()
        if inner.startswith("{") and inner.endswith("}"):
            inner = inner[1:-1]
        parts.append(inner)
    return ",".join(p for p in parts if p)


class Api:
    def __init__(self, url: str, timeout: float) -> None:
        self.base = url.rstrip("/")
        if "://" not in self.base:
            self.base = "http://" + self.base
        self.timeout = timeout

    def query(self, promql: str) -> list[dict[str, Any]]:
        return self._ask("query", {"query": promql})

    def query_range(self, promql: str, where: Slots) -> list[dict[str, Any]]:
        """A matrix: each series' values at the slots' ends, ``where.count`` of them at most."""
        params = {
            "query": promql,
            "start": f"{where.start:.3f}",
            "end": f"{where.end:.3f}",
            "step": f"{where.step_s:.3f}",
        }
        return self._ask("query_range", params)

    def _ask(self, endpoint: str, params: dict[str, str]) -> list[dict[str, Any]]:
        promql = params["query"]
        where = f"{self.base}/api/v1/{endpoint}?{urllib.parse.urlencode(params)}"
        try:
            body = get(where, self.timeout, MAX_BODY)
        except TooLarge:
            raise PrometheusError(
                f"Prometheus at {self.base} answered more than {MAX_BODY >> 20} MiB to {promql[:80]!r}: "
                "narrow it with --job or --match"
            ) from None
        except TooSlow:
            raise PrometheusError(
                f"Prometheus at {self.base} did not finish answering within {2 * self.timeout:g} s"
            ) from None
        except urllib.error.HTTPError as exc:
            body = _error_body(exc, self.timeout)  # a bad query: the API answers 400 with its error in JSON
            if not _api_error(body):
                raise PrometheusError(
                    f"{self.base} answered HTTP {exc.code} to /api/v1/{endpoint}: not a Prometheus server?"
                ) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            why = getattr(reason, "strerror", None) or str(reason)
            raise PrometheusError(f"cannot reach Prometheus at {self.base}: {why}") from None
        except (TimeoutError, OSError) as exc:
            raise PrometheusError(
                f"cannot reach Prometheus at {self.base}: {getattr(exc, 'strerror', None) or 'timed out'}"
            ) from None
        except http.client.HTTPException as exc:  # something answered, not in HTTP (an ssh port)
            raise PrometheusError(
                f"{self.base} is not a Prometheus server: it does not answer HTTP ({type(exc).__name__})"
            ) from None
        except ValueError as exc:  # a URL urllib cannot use ("http://[::1", a space in it)
            raise PrometheusError(f"cannot use {self.base} as a Prometheus URL: {exc}") from None
        return _result(self.base, promql, body)


def _error_body(exc: urllib.error.HTTPError, timeout: float) -> bytes:
    fp: Any = exc.fp  # the HTTPResponse, which has read1
    try:
        return read_body(fp, MAX_ERROR_BODY, time.monotonic() + timeout) if fp is not None else b""
    except (OSError, ValueError, AttributeError):
        return b""


def _api_error(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return str(data.get("error")) if isinstance(data, dict) and data.get("status") == "error" else None


def _result(base: str, promql: str, body: bytes) -> list[dict[str, Any]]:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        raise PrometheusError(
            f"{base} is not a Prometheus server: /api/v1/query did not answer JSON"
        ) from None
    if not isinstance(data, dict) or "status" not in data:
        raise PrometheusError(f"{base} is not a Prometheus server: /api/v1/query answered other JSON")
    if data["status"] != "success":
        raise PrometheusError(f"Prometheus at {base} refused {promql[:80]!r}: {data.get('error', '?')}")
    inner = data.get("data")
    result = inner.get("result") if isinstance(inner, dict) else None
    vector = isinstance(result, list) and all(
        isinstance(item, dict)
        and isinstance(item.get("metric", {}), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in item.get("metric", {}).items())
        for item in result
    )
    if not vector:
        raise PrometheusError(f"{base} is not a Prometheus server: no vector in its answer")
    assert isinstance(result, list)
    return result


def _labels(metric: dict[str, str]) -> Labels:
    return tuple(sorted((k, v) for k, v in metric.items() if k not in _DROPPED))


def _value(item: dict[str, Any]) -> float | None:
    """The sample's value; None for none, or one that is not finite (NaN: no figure; an infinite
    figure is no figure dlmon exports, and JSON cannot carry either)."""
    try:
        value = float(item["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def read_prometheus(
    url: str, job: str | None, match: str | None, window_s: float, timeout: float
) -> tuple[list[NodeReading], str]:
    """(one reading per instance, the source's description)."""
    api = Api(url, timeout)
    where = selector(job, match)
    window = f"{max(1, round(window_s * 1000))}ms"

    def promql(name: str) -> str:
        plain = f"{name}{{{where}}}"
        if name not in AVERAGED:
            return plain
        # a window shorter than the scrape interval may hold no sample: then the last value (``* 1``
        # drops the name as avg_over_time does, so ``or`` matches the series one to one)
        return f"avg_over_time({plain}[{window}]) or ({plain} * 1)"

    queries = [promql(name) for name in NEEDED]
    stamps, down, dlmon_jobs = len(queries), len(queries) + 1, len(queries) + 2
    queries.append(f"timestamp(dlmon_snapshot_timestamp_seconds{{{where}}})")
    queries.append(f"up{{{where}}} == 0")
    queries.append("count by (job) (dlmon_build_info)")
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(api.query, queries))
    by_instance: dict[str, list[Series]] = {}
    for name, answer in zip(NEEDED, answers, strict=False):
        for item in answer:
            metric = item.get("metric", {})
            value = _value(item)
            instance = metric.get("instance", "")
            if value is not None and instance:
                by_instance.setdefault(instance, []).append(Series(name, _labels(metric), value))
    jobs = sorted({str(item.get("metric", {}).get("job", "")) for item in answers[dlmon_jobs]})
    if not by_instance:
        which = f" for {{{where}}}" if where else ""
        known = (
            f" (jobs with dlmon series: {', '.join(jobs)})" if jobs else " (is it scraping dlmon exporters?)"
        )
        raise PrometheusError(f"Prometheus at {api.base} has no dlmon series{which}{known}")
    scraped = {item.get("metric", {}).get("instance", ""): _value(item) for item in answers[stamps]}
    readings = [
        NodeReading(instance, tuple(series), scraped.get(instance) or 0.0)
        for instance, series in sorted(by_instance.items())
    ]
    failed = {
        item.get("metric", {}).get("instance", "")
        for item in answers[down]
        # with a selector, every target it names; without, only those of the jobs that serve dlmon
        if where or item.get("metric", {}).get("job", "") in jobs
    }
    readings += [
        NodeReading(i, (), 0.0, "Prometheus's last scrape of it failed (up == 0)")
        for i in sorted(failed - set(by_instance))
        if i
    ]
    source = f"Prometheus {api.base}" + (f" {{{where}}}" if where else "")
    return readings, source


def _values(item: dict[str, Any]) -> list[tuple[float, float]]:
    """A matrix series' (time, value) pairs, those that are numbers and finite."""
    out: list[tuple[float, float]] = []
    values = item.get("values")
    for pair in values if isinstance(values, list) else []:
        if not isinstance(pair, list) or len(pair) != 2:  # a dict would raise KeyError on pair[0]
            continue
        try:
            t, value = float(pair[0]), float(pair[1])
        except (TypeError, ValueError, OverflowError):
            continue
        if math.isfinite(t) and math.isfinite(value):
            out.append((t, value))
    return out


def read_trends(
    url: str, job: str | None, match: str | None, where: Slots, timeout: float
) -> dict[str, Trend]:
    """Each instance's batches/s (per rank its training loader, else its busiest, summed over the
    node's ranks: the batch/s column's own choice, see view) and data wait (its most waiting
    rank's share of wall time) over the slots, each slot the average of the scrapes within it:
    two range queries."""
    api = Api(url, timeout)
    sel = selector(job, match)
    train = ",".join(p for p in (sel, 'role="train"') if p)
    step = f"{max(1, round(where.step_s * 1000))}ms"

    def busiest(matchers: str) -> str:
        return (
            f"max by (instance, rank) (avg_over_time(dlmon_loader_batches_per_second{{{matchers}}}[{step}]))"
        )

    rate = f"sum by (instance) ({busiest(train)} or {busiest(sel)})"
    wait = f"max by (instance) (avg_over_time(dlmon_job_data_wait_wall_ratio{{{sel}}}[{step}]))"
    with ThreadPoolExecutor(max_workers=2) as pool:
        rates, waits = pool.map(lambda q: api.query_range(q, where), (rate, wait))

    def by_instance(answer: list[dict[str, Any]]) -> dict[str, tuple[float | None, ...]]:
        out: dict[str, tuple[float | None, ...]] = {}
        for item in answer:
            instance = str(item.get("metric", {}).get("instance", ""))
            points = bucketed(_values(item), where, at_ends=True)
            if instance and points is not None:
                out[instance] = points
        return out

    got_rates, got_waits = by_instance(rates), by_instance(waits)
    return {i: Trend(got_rates.get(i), got_waits.get(i)) for i in sorted({*got_rates, *got_waits})}
