"""Which distributed rank this process is, from the launcher's environment (standard library only).

torchrun, accelerate and Lightning set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
``GROUP_RANK`` (torchrun's node index) or ``NODE_RANK`` (Lightning, accelerate); under SLURM
without them, ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS`` and ``SLURM_NODEID`` say the same.

Read when the agent starts and served with every reply (``rank`` in the counters). Some launch
modes set the variables only after the agent started (Lightning's and accelerate's own process
launchers write ``os.environ`` in the child before it initialises the process group): while
nothing was found, ``current()`` reads the environment again, at most once a second. It runs in
the agent's server thread when a reply is built, never on the training's path.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from dlmon.agent import wire

RETRY_S = 1.0

# (source, rank, local rank, world size, node rank candidates): the first source with a rank wins
_SOURCES: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    ("env", "RANK", "LOCAL_RANK", "WORLD_SIZE", ("GROUP_RANK", "NODE_RANK")),
    ("slurm", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", ("SLURM_NODEID",)),
)

_found: wire.RankWire | None = None
_read_at: float | None = None


def _whole(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw or len(raw) > 9 or not raw.isascii() or not raw.isdigit():  # '²'.isdigit()
        return None
    return int(raw)


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = _whole(environ, name)
        if value is not None:
            return value
    return None


def read_rank(environ: Mapping[str, str]) -> wire.RankWire | None:
    """``{"rank", "local_rank", "world_size", "node_rank", "source"}`` (ints or None), or None
    when the environment names no rank. torchrun's variables win over SLURM's: under
    ``srun torchrun`` SLURM_PROCID is the launcher's task, not the rank."""
    for source, rank_var, local_var, world_var, node_vars in _SOURCES:
        rank = _whole(environ, rank_var)
        if rank is None:
            continue
        world = _whole(environ, world_var)
        if world is not None and rank >= world:
            world = None  # inconsistent: keep the rank, drop what contradicts it
        return wire.rank_wire(
            rank=rank,
            local_rank=_whole(environ, local_var),
            world_size=world,
            node_rank=_first(environ, node_vars),
            source=source,
        )
    return None


def current(now: float | None = None) -> wire.RankWire | None:
    """This process's rank: read once when found, re-read at most every RETRY_S while not. Never raises."""
    global _found, _read_at
    try:
        if _found is not None:
            return _found.copy()
        t = time.monotonic() if now is None else now
        if _read_at is not None and t - _read_at < RETRY_S:
            return None
        _read_at = t
        _found = read_rank(os.environ)
        return _found.copy() if _found is not None else None
    except Exception:
        return None


def reset() -> None:
    """Forget what was read (a forked child re-reads its own environment; tests)."""
    global _found, _read_at
    _found = None
    _read_at = None
