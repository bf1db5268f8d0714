"""The job's own files in /dev/shm: torch's ``file_system`` sharing strategy names each segment
``torch_<pid>_...`` after the process that made it; other libraries' files are not counted.

Segments of the default ``file_descriptor`` strategy are unlinked at once (only their fds hold
them): they are in RssShmem of the processes, not here. The directory is listed at most every
``REFRESH_S`` (it can hold thousands of files) and at most ``MAX_ENTRIES`` entries are looked at.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import replace

from dlmon.model.snapshot import ShmSample

REFRESH_S = 10.0
MAX_ENTRIES = 20_000


def job_segments(directory: str, pids: Iterable[int]) -> tuple[int, int] | None:
    """(segments, bytes allocated) of the ``torch_<pid>_*`` files of ``pids`` in ``directory``."""
    prefixes = tuple(f"torch_{pid}_" for pid in pids)
    if not prefixes:
        return 0, 0
    count = used = 0
    try:
        with os.scandir(directory) as it:
            for i, entry in enumerate(it):
                if i >= MAX_ENTRIES:
                    break
                if not entry.name.startswith(prefixes):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                count += 1
                used += st.st_blocks * 512
    except OSError:
        return None
    return count, used


class JobShm:
    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._last = -1e9
        self._value: tuple[int, int] | None = None

    def attach(self, shm: ShmSample | None, target: int, pids: Iterable[int]) -> ShmSample | None:
        """``shm`` with the job's segment count and bytes (refreshed every REFRESH_S)."""
        if shm is None:
            return None
        try:
            now = time.monotonic()
            if now - self._last >= REFRESH_S:
                self._last = now
                where = f"{self.proc_root}/{target}/root/dev/shm"
                self._value = job_segments(where if os.path.isdir(where) else shm.path, pids)
            if self._value is None:
                return shm
            return replace(shm, job_segments=self._value[0], job_bytes=self._value[1])
        except Exception:
            return shm
