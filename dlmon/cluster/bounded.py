"""One HTTP GET read whole within a deadline and a size bound: a per-read socket timeout alone lets
a server that sends a byte every second keep a refresh waiting forever."""

from __future__ import annotations

import time
import urllib.request
from typing import Protocol

CHUNK = 256 * 1024


class TooLarge(ValueError):
    """The answer was longer than the bound."""


class TooSlow(TimeoutError):
    """The answer did not end within the deadline (each read was in time, the whole was not)."""


class _Readable(Protocol):
    def read1(self, n: int = ..., /) -> bytes: ...


def read_body(response: _Readable, max_bytes: int, deadline: float) -> bytes:
    """The body, read as it arrives (``read1``: never waiting for a full chunk), until its end;
    raises TooLarge past ``max_bytes``, TooSlow past ``deadline`` (monotonic)."""
    parts: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() > deadline:
            raise TooSlow
        part = response.read1(CHUNK)
        if not part:
            return b"".join(parts)
        size += len(part)
        if size > max_bytes:
            raise TooLarge
        parts.append(part)


def get(url: str, timeout: float, max_bytes: int) -> bytes:
    """GET ``url``: connected and answered within ``timeout`` (each read), whole within twice it.
    Raises what urlopen raises, TooLarge or TooSlow."""
    deadline = time.monotonic() + 2 * timeout
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return read_body(response, max_bytes, deadline)
