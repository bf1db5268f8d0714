"""What the agent test modules share: a private XDG_RUNTIME_DIR for agents and their clients, and
agent replies made by the agent's wire builders."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dlmon.agent import wire
from dlmon.agent.sitecustomize_hook import pythonpath_with_bootstrap
from support.paths import ROOT


@contextmanager
def private_agent_env(prefix: str) -> Iterator[dict[str, str]]:
    """Set XDG_RUNTIME_DIR to a fresh directory (here and in the returned child environment, which
    also starts the agent through the bootstrap sitecustomize); restore it afterwards."""
    d = tempfile.mkdtemp(prefix=prefix)
    os.chmod(d, 0o755)  # the agent's own dlmon/ inside it is 0700; tests open holes next to it
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = d
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath_with_bootstrap(
        os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("DLMON_AGENT_DISABLE", None)
    try:
        yield env
    finally:
        if old is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old
        shutil.rmtree(d, ignore_errors=True)


def alive(pid: int) -> bool:
    """Running and not a zombie (a dead child not reaped yet is no longer alive)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# agent replies, made by the agent's own wire builders (never copied by hand)


def loader_reply(**given: Any) -> wire.LoaderWire:
    """A loader as the agent sends it: representative values, ``given`` ones instead."""
    args: dict[str, Any] = {
        "id": 1,
        "name": "train.py:10",
        "file": "/job/train.py",
        "line": 10,
        "function": "main",
        "site": "constructed",
        "alive": True,
        "settings": {
            "num_workers": 2,
            "batch_size": 8,
            "prefetch_factor": 2,
            "pin_memory": True,
            "pin_memory_effective": True,
            "persistent_workers": False,
            "drop_last": False,
            "timeout": 0.0,
            "multiprocessing_context": "fork",
            "dataset": "MyDataset",
            "dataset_kind": "map",
        },
        "batches_total": 10,
        "samples_total": 80,
        "wait_ns_total": 100,
        "compute_ns_total": 300,
        "startup_wait_ns_total": 5,
        "end_wait_ns_total": 0,
        "epochs": 0,
        "epochs_started": 1,
        "wait_ns_pending": 0,
        "startup_wait_ns_pending": 0,
        "compute_ns_pending": 0,
        "worker_pids": [100, 101],
        "batches_per_worker": [5, 5],
        "iterators": [],
        "role": None,
        "role_source": None,
        "framework": None,
        "iterated": True,
        "replaced_by": None,
    }
    args.update(given)
    return wire.loader_wire(**args)


def counters_reply(**given: Any) -> wire.CountersReply:
    """A counters reply as the agent sends it: representative values, ``given`` ones instead."""
    args: dict[str, Any] = {
        "pid": 42,
        "agent_id": "a",
        "time_ns": 1_000_000_000,
        "unix_time": 1.7e9,
        "python": "3.11.9",
        "torch_imported": True,
        "torch_version": "2.13.0",
        "hooks_patched": True,
        "hooks": ["iter_next"],
        "degraded": {},
        "loaders": [loader_reply()],
        "worker_deaths": [],
        "cuda_initialized": False,
        "cuda": [],
        "pinned": None,
        "num_threads": None,
        "num_threads_time_ns": None,
        "rank": None,
        "injected_unix_time": None,
    }
    args.update(given)
    return wire.counters_reply(**args)
