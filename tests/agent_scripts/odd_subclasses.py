"""DataLoader subclasses defined after the hooks, in ways a user may write them: ``__init__``
as a functools.partialmethod, a chained ``__init_subclass__`` with a class keyword. They must
behave exactly as without dlmon. Prints what they gave as one JSON line."""

from __future__ import annotations

import functools
import json
from typing import Any

import dlmon.agent

dlmon.agent.start()

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


class Fours(DataLoader[Any]):
    __init__ = functools.partialmethod(DataLoader.__init__, batch_size=4)  # type: ignore[assignment]


class Tagging(DataLoader[Any]):
    def __init_subclass__(cls, tag: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.tag = tag  # type: ignore[attr-defined]


class Tagged(Tagging, tag="x"):
    pass


print(
    json.dumps(
        {
            "fours": sum(1 for _ in Fours(torch.zeros(8, 2))),
            "tag": Tagged.tag,  # type: ignore[attr-defined]
            "tagged": sum(1 for _ in Tagged(torch.zeros(4, 1))),
        }
    ),
    flush=True,
)
