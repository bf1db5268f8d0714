"""Record files: one JSON object per line, flushed per line. JSON only, never pickle.

Lines are ``{"type": "snapshot", ...}`` (see docs/snapshot.md) and, last, one
``{"type": "end", "time": ..., "reason": ...}`` saying why the recording stopped.
Each line is written with a single write() so a killed writer leaves whole lines only.
"""

from __future__ import annotations

import gzip
import json
import time
from typing import Any, BinaryIO, cast

from dlmon.model import Snapshot
from dlmon.model.serialize import snapshot_to_dict

END_TARGET_EXITED = "target_exited"
END_INTERRUPTED = "interrupted"
END_DURATION = "duration"


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return _encode(snapshot_to_dict(snapshot))


def _encode(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()


def _open_gzip(path: str) -> BinaryIO:
    return cast(BinaryIO, gzip.open(path, "wb"))


class RecordWriter:
    def __init__(self, path: str) -> None:
        """Create or truncate ``path``: -o names the file this recording becomes (gzip'd if it
        ends in .gz, flushed per line so a killed writer still leaves every whole line readable)."""
        self.path = path
        self._gzip = path.endswith(".gz")
        # closed in close()
        self._fh: BinaryIO = _open_gzip(path) if self._gzip else open(path, "wb", buffering=0)  # noqa: SIM115

    def write(self, snapshot: Snapshot) -> None:
        self._write(encode_snapshot(snapshot))

    def end(self, reason: str) -> None:
        self._write(_encode({"type": "end", "time": time.time(), "reason": reason}))

    def _write(self, line: bytes) -> None:
        view = memoryview(line)
        while view:  # one write() normally; loop only on a short write
            written = self._fh.write(view)
            view = view[written or 0 :]
        if self._gzip:
            self._fh.flush()  # Z_SYNC_FLUSH: the line is decodable now, not when the file closes

    def close(self) -> None:
        self._fh.close()
