"""HF Trainer's eval loader built anew at each evaluation, the earlier one still alive (accelerate
keeps it): the new one goes on in the earlier one's row. The earlier one dying later must not
mark that row dead while the new one is in use. Prints the row as one JSON line."""

from __future__ import annotations

import gc
import json

import dlmon.agent

dlmon.agent.start()

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from dlmon.agent import _loaders  # noqa: E402

# the role as HF Trainer's get_eval_dataloader gives it (its stack cannot exist without HF),
# set where the construction hooks look it up
_loaders._framework_context = lambda: ("HF Trainer", "validation")


def make() -> DataLoader[torch.Tensor]:
    return DataLoader(torch.zeros(8, 2), batch_size=2)


first = make()
for _ in first:
    pass
second = make()
for _ in second:
    pass
rows = dlmon.agent.counters()["loaders"]
del first
gc.collect()
after = [r for r in dlmon.agent.counters()["loaders"] if r["iterated"]]
print(json.dumps({"rows_before": len(rows), "rows": after}), flush=True)
for _ in second:  # still in use
    pass
