"""A dataset whose samples each burn ~2 ms of Python CPU (``--cpu-ms``), and optionally wait
``--wait-ms`` as a read from a slow disk would: more workers help (up to the cores for the CPU part)."""

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Burn(Dataset):
    def __init__(self, cpu_ms, wait_ms):
        self.cpu_s = cpu_ms / 1000
        self.wait_s = wait_ms / 1000

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        if self.wait_s:
            time.sleep(self.wait_s)
        end = time.process_time() + self.cpu_s
        x = 0
        while time.process_time() < end:
            x += 1
        return torch.full((16,), float(i % 7))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--cpu-ms", type=float, default=2.0)
    p.add_argument("--wait-ms", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=0, help="0: until interrupted")
    p.add_argument("--measure", type=float, default=0, help="print samples/s over S s after warm-up, exit")
    a = p.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(
        Burn(a.cpu_ms, a.wait_ms), batch_size=a.batch_size, num_workers=a.workers, shuffle=True
    )
    steps = 0
    first = start = None
    counted = 0
    while True:
        for x in loader:
            now = time.perf_counter()
            if a.measure:  # the manual measurement dlmon tune is compared with (benchmarks/tune_knee.py)
                first = first or now
                if start is None and steps >= 3 and now - first >= 1.0:
                    start = now
                elif start is not None:
                    counted += x.shape[0]
                    if now - start >= a.measure:
                        print(f"samples/s {counted / (now - start):.1f}", flush=True)
                        return
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            if a.steps and steps >= a.steps:
                return


if __name__ == "__main__":
    main()
