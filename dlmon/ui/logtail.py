"""Follow a growing log file incrementally, with bounded reads and memory (no UI imports).

Each :meth:`LogTail.poll` reads only what was appended since the last one (at most
``max_read`` bytes; a burst bigger than that skips ahead and says so), splits it into lines,
keeps a partial last line for the next poll, and folds carriage-return progress bars (tqdm) to
their last state. A truncated or replaced file is read again from the start.
"""

from __future__ import annotations

import os
import re

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*(\x07|\x1b\\)")


class LogTail:
    def __init__(self, path: str, *, max_read: int = 256 * 1024, max_partial: int = 8192) -> None:
        self.path = path
        self.max_read = max_read
        self.max_partial = max_partial
        self.offset = 0
        self._partial = b""
        self._ident: tuple[int, int] | None = None

    def poll(self) -> list[str]:
        """New complete lines since the last poll (empty when nothing changed or unreadable)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return []
        ident = (st.st_dev, st.st_ino)
        lines: list[str] = []
        if ident != self._ident or st.st_size < self.offset:
            if self._ident is not None:
                lines.append("[dlmon: the log was truncated or replaced; reading it from the start]")
            self._ident = ident
            self.offset = 0
            self._partial = b""
        if st.st_size == self.offset:
            return lines
        start = self.offset
        if st.st_size - start > self.max_read:
            skipped = st.st_size - self.max_read - start
            lines.append(f"[dlmon: skipped {skipped} bytes of log output]")
            start = st.st_size - self.max_read
            self._partial = b""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(start)
                data = fh.read(self.max_read)
        except OSError:
            return lines
        self.offset = start + len(data)
        data = self._partial + data
        *complete, partial = data.split(b"\n")
        self._partial = partial[-self.max_partial :]
        lines.extend(clean_line(raw) for raw in complete)
        return lines

    @property
    def partial(self) -> str:
        """The unfinished last line (a progress bar, a prompt), cleaned."""
        return clean_line(self._partial)


def clean_line(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").rstrip("\r")
    if "\r" in text:
        text = text.rsplit("\r", 1)[-1]
    return _ANSI.sub("", text).expandtabs(4)
