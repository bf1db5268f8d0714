"""Each process's open-file limit (RLIMIT_NOFILE), from ``/proc/PID/limits``, read rarely.

A limit changes only by ``setrlimit``/``prlimit``; it is re-read every ``REFRESH_S`` per process
(and at once for a new one), so the cost is one small file per process per minute.
"""

from __future__ import annotations

REFRESH_S = 60.0
MAX_TRACKED = 4096


def parse_nofile(text: str) -> int | None:
    """The soft limit of the "Max open files" line; None when unlimited or absent."""
    for line in text.splitlines():
        if line.startswith("Max open files"):
            fields = line[len("Max open files") :].split()
            if fields and fields[0].isdigit():
                return int(fields[0])
            return None
    return None


class FdLimits:
    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._cache: dict[tuple[int, int], tuple[float, int | None]] = {}

    def _limit(self, pid: int, start_time: int, now: float) -> int | None:
        key = (pid, start_time)
        hit = self._cache.get(key)
        if hit is not None and now - hit[0] < REFRESH_S:
            return hit[1]
        try:
            with open(f"{self.proc_root}/{pid}/limits", encoding="ascii", errors="replace") as f:
                limit = parse_nofile(f.read(8192))
        except OSError:
            limit = hit[1] if hit is not None else None
        if len(self._cache) >= MAX_TRACKED:
            self._cache.clear()
        self._cache[key] = (now, limit)
        return limit

    def limit(self, pid: int, start_time: int, now: float) -> int | None:
        """The soft open-files limit of one process (cached ``REFRESH_S``); None when unknown.
        Never raises: the limit is a detail of a row, not worth a tick."""
        try:
            return self._limit(pid, start_time, now)
        except Exception:
            return None

    def keep_only(self, live: set[tuple[int, int]]) -> None:
        """Forget processes that are gone, once the cache holds many more than are alive."""
        if len(self._cache) > 2 * len(live) + 64:
            self._cache = {k: v for k, v in self._cache.items() if k in live}
