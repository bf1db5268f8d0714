"""A bounded history of snapshots: memory stays flat however long dlmon runs."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from dlmon.model.snapshot import Snapshot


class History:
    """The newest ``capacity`` snapshots, oldest first."""

    def __init__(self, capacity: int = 3600) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._items: deque[Snapshot] = deque(maxlen=capacity)

    def append(self, snapshot: Snapshot) -> None:
        self._items.append(snapshot)

    @property
    def capacity(self) -> int:
        maxlen = self._items.maxlen
        assert maxlen is not None
        return maxlen

    def latest(self) -> Snapshot | None:
        return self._items[-1] if self._items else None

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Snapshot]:
        return iter(self._items)
