"""The Prometheus text exposition format, parsed into (name, labels, value) series: enough for
what dlmon's exporter writes, and strict enough that a page which is not an exposition (an HTML
login page, a JSON error) is told apart instead of read as nothing."""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
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
    found = _LABEL.findall(text)
    # every character of the set is in a pair, a comma or a space: else it is not a label set
    if sum(len(k) + len(v) for k, v in found) + 3 * len(found) < len(text.replace(",", "").replace(" ", "")):
        raise NotExposition(f"not a label set: {line[:80]!r}")
    return tuple(sorted((k, _unescape(v)) for k, v in found))


def _value(text: str, line: str) -> float:
    try:
        return float(text)  # also +Inf, -Inf, NaN as Prometheus writes them (dropped by parse)
    except ValueError:
        raise NotExposition(f"not a sample value: {line[:80]!r}") from None


def parse(body: str, names: Collection[str] | None = None) -> tuple[Series, ...]:
    """Every sample with a finite value of an exposition (of the families in ``names`` only, when
    given: the rest is skipped before its labels are read); raises NotExposition on a line that is
    neither a comment nor a sample."""
    out: list[Series] = []
    skipping = False  # inside a family (after its # TYPE line) that ``names`` does not hold
    for raw in body.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if names is not None and len(parts) >= 3 and parts[1] == "TYPE":
                skipping = parts[2] not in names and f"{parts[2]}_total" not in names  # OpenMetrics
            continue
        if skipping:
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise NotExposition(f"not a Prometheus sample line: {line[:80]!r}")
        name = match.group(1)
        if names is not None and name not in names:
            continue
        value = _value(match.group(3), line)
        if not math.isfinite(value):  # no figure the view reads; JSON could not carry it either
            continue
        out.append(Series(name, _labels(match.group(2) or "", line), value))
    return tuple(out)
