"""The Prometheus text exposition format, parsed into (name, labels, value) series: enough for
what dlmon's exporter writes, and strict enough that a page which is not an exposition (an HTML
login page, a JSON error) is told apart instead of read as nothing."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = re.compile(r"\\(.)")


class NotExposition(ValueError):
    """A body that is not in the Prometheus text format."""


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    labels: Labels
    value: float

    def label(self, key: str) -> str:
        for k, v in self.labels:
            if k == key:
                return v
        return ""


def _unescape(text: str) -> str:
    if "\\" not in text:
        return text
    return _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def _labels(text: str, line: str) -> Labels:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if match is None:
            raise NotExposition(f"not a label set: {line[:80]!r}")
        out.append((match.group(1), _unescape(match.group(2))))
        pos = match.end()
    return tuple(sorted(out))


def _value(text: str, line: str) -> float:
    try:
        return float(text)  # also +Inf, -Inf, NaN as Prometheus writes them
    except ValueError:
        raise NotExposition(f"not a sample value: {line[:80]!r}") from None


def parse(body: str, prefix: str = "") -> tuple[Series, ...]:
    """Every sample (whose name starts with ``prefix``) of an exposition; raises NotExposition
    on the first line that is neither a comment nor a sample."""
    out: list[Series] = []
    for raw in body.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise NotExposition(f"not a Prometheus sample line: {line[:80]!r}")
        name = match.group(1)
        if not name.startswith(prefix):
            continue
        value = _value(match.group(3), line)
        if math.isnan(value):
            continue
        out.append(Series(name, _labels(match.group(2) or "", line), value))
    return tuple(out)
