"""Every way a training ends an epoch, on real DataLoaders with 2 workers, one style per loader.

Starts the agent itself and prints one JSON line: per style, what the agent counted
({epochs, epochs_started, startup_wait_ns_total, batches_total, role, role_source}) and what
the script did, plus the roles of a train/validation pair and of a zip of two loaders.
"""

from __future__ import annotations

import gc
import itertools
import json
import time

import dlmon.agent

dlmon.agent.start()

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402


class Slowish(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.002)
        return torch.tensor([float(i)])


def make(persistent: bool = False) -> DataLoader[torch.Tensor]:
    return DataLoader(Slowish(), batch_size=4, num_workers=2, persistent_workers=persistent)


def counted(loader: object) -> dict[str, object]:
    gc.collect()
    for row in dlmon.agent.counters()["loaders"]:
        if row["id"] == by_loader[id(loader)]:
            keys = ("epochs", "epochs_started", "startup_wait_ns_total", "batches_total")
            keys += ("role", "role_source")
            return {k: row.get(k) for k in keys}
    raise AssertionError("loader not reported")


by_loader: dict[int, int] = {}


def register(loader: object) -> None:
    by_loader[id(loader)] = dlmon.agent.counters()["loaders"][-1]["id"]


out: dict[str, object] = {}

# 1. StopIteration, a new iterator each epoch (persistent_workers=False)
stop = make()
register(stop)
for _ in range(3):
    for _b in stop:
        pass
out["stop_iteration"] = counted(stop)

# 2. a new iterator while the last one is mid-epoch (the old one still referenced)
fresh = make()
register(fresh)
first = iter(fresh)
next(first)
next(first)
second = iter(fresh)
next(second)
out["new_iterator"] = counted(fresh)
del first, second

# 3. _reset of a persistent iterator mid-epoch (DataLoader.__iter__ restarts the same one)
persistent = make(persistent=True)
register(persistent)
it = iter(persistent)
next(it)
for _ in range(2):
    it = iter(persistent)  # what Lightning does at each epoch start
    next(it)
    next(it)
out["persistent_reset"] = counted(persistent)
out["persistent_same_iterator"] = it is persistent._iterator

# 4. a loop that stops by length (Lightning's CombinedLoader, limit_train_batches, a break)
by_length = make()
register(by_length)
for _ in range(2):
    for _b in itertools.islice(by_length, 2):
        pass
out["stop_by_length"] = counted(by_length)

# roles from the pattern: validation bursts between the training loader's batches
train = DataLoader(torch.zeros(40, 2), batch_size=2, num_workers=1)
register(train)
val = DataLoader(torch.zeros(4, 2), batch_size=2, num_workers=1)
register(val)
for i, _b in enumerate(train):
    if i % 6 == 5:
        for _v in val:
            pass
out["pattern_train"] = counted(train)
out["pattern_val"] = counted(val)

# two loaders zipped: neither runs in the other's pauses, no role is guessed
a = DataLoader(torch.zeros(20, 2), batch_size=2)
register(a)
b = DataLoader(torch.zeros(8, 2), batch_size=2)
register(b)
for _ in range(3):
    for _x, _y in zip(a, b, strict=False):
        pass
out["zip_a"] = counted(a)
out["zip_b"] = counted(b)
print(json.dumps(out), flush=True)
