"""What the in-process agent costs a fast DataLoader: batches/s with and without its hooks.

Each measurement runs in a fresh interpreter: "off" imports torch and iterates; "on" calls
``dlmon.agent.start()`` first (the hooks go in through the import hook, the socket is served)
and iterates the same loader. Runs are interleaved (off, on, off, on, ...; the order inside a
pair alternates) so that drift in the machine's load hits both alike; the ratio is taken per
pair and the median reported.

The loader: num_workers=0 over an in-memory TensorDataset, so the loader itself is as fast
as torch allows and the hook's share is as large as it gets for a real batch size.

    python benchmarks/agent_overhead.py                 # default scenarios, 7 pairs each
    python benchmarks/agent_overhead.py --pairs 11 --scenarios bs64
    DLMON_BENCH_WORKERS=2 python benchmarks/agent_overhead.py --scenarios bs64   # with 2 workers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SCENARIOS = {
    # name: (batch_size, batches per run). bs64 is the target case (several thousand batches/s);
    # bs4 is a stress case (tens of thousands of batches/s), reported but not held to the target.
    "bs64": (64, 15_000),
    "bs4": (4, 60_000),
}
TARGET = 0.99
CHUNKS = 5  # each run is timed in this many chunks; the fastest counts


def child(agent: bool, batch_size: int, batches: int) -> None:
    if agent:
        import dlmon.agent

        dlmon.agent.start()
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    n = batch_size * 2000
    ds = TensorDataset(torch.randn(n, 16), torch.arange(n))
    # DLMON_BENCH_WORKERS=2: forked workers, so the agent's worker hooks (stack-dump handler) run too
    workers = int(os.environ.get("DLMON_BENCH_WORKERS", "0"))
    dl = DataLoader(
        ds, batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=workers > 0
    )

    def run(k: int) -> float:
        done = 0
        t0 = time.perf_counter()
        while done < k:
            for _batch in dl:
                done += 1
                if done >= k:
                    break
        return time.perf_counter() - t0

    run(min(2000, batches // 5))  # warm-up
    chunk = max(1, batches // CHUNKS)
    rates = [chunk / run(chunk) for _ in range(CHUNKS)]
    # best chunk: the machine is shared, and interference only ever makes a run slower
    out: dict[str, float | None] = {"rate": max(rates), "median_rate": statistics.median(rates)}
    out["hook_ns"] = None
    if agent:
        out["hook_ns"] = hook_cost_ns()
        import dlmon.agent

        loaders = dlmon.agent.counters()["loaders"]
        out["counted"] = loaders[0]["batches_total"] if loaders else None
    print(json.dumps(out))


def hook_cost_ns() -> float:
    """The wrapper's own cost per __next__, measured on a trivial iterator (best of 5)."""
    import timeit

    from dlmon.agent import _hooks

    class _Tensorish:
        shape = (64, 16)

    batch = (_Tensorish(), _Tensorish())

    class _It:
        _num_yielded = 1

        def __next__(self) -> object:
            return batch

    it = _It()
    ls = _hooks._LoaderState(0)
    ls.settings = {"collated": True, "batch_size": 64}
    it._dlmon_st = _hooks._IterState(ls, 0, id(it), 64)  # type: ignore[attr-defined]
    raw = _It.__next__
    wrapped = _hooks._make_next(raw)
    n = 200_000
    best = float("inf")
    for _ in range(5):
        a = timeit.timeit(lambda: raw(it), number=n)
        b = timeit.timeit(lambda: wrapped(it), number=n)
        best = min(best, (b - a) / n * 1e9)
    return best


def in_process_ab(batch_size: int, batches: int, rounds: int = 40) -> float:
    """on/off ratio measured inside one process: the same iterator, hooked and original
    ``__next__`` alternating in small blocks, so that load on the machine hits both alike."""
    import dlmon.agent

    dlmon.agent.start()
    import torch
    import torch.utils.data.dataloader as dl_mod
    from torch.utils.data import DataLoader, TensorDataset

    n = batch_size * (batches + 1000)
    it = iter(DataLoader(TensorDataset(torch.randn(n, 16), torch.arange(n)), batch_size=batch_size))
    hooked = dl_mod._BaseDataLoaderIter.__next__
    original = getattr(hooked, "__dlmon_orig__")  # noqa: B009 -- not in torch's type stubs
    block = max(1, batches // (2 * rounds))
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for on in (True, False) if r % 2 else (False, True):
            f = hooked if on else original
            t0 = time.perf_counter_ns()
            for _ in range(block):
                f(it)
            times[on].append((time.perf_counter_ns() - t0) / block)
    return statistics.median(times[False]) / statistics.median(times[True])


def measure(agent: bool, batch_size: int, batches: int) -> dict[str, float]:
    env = dict(os.environ)
    env.pop("DLMON_AGENT_DISABLE", None)
    cmd = [sys.executable, __file__, "--child", "on" if agent else "off", str(batch_size), str(batches)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--child", nargs=3, metavar=("AGENT", "BATCH_SIZE", "BATCHES"), help=argparse.SUPPRESS)
    ap.add_argument("--ab", nargs=2, metavar=("BATCH_SIZE", "BATCHES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0] == "on", int(args.child[1]), int(args.child[2]))
        return
    if args.ab:
        print(json.dumps({"ratio": in_process_ab(int(args.ab[0]), int(args.ab[1]))}))
        return

    print(f"$ python {' '.join(sys.argv)}")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, pairs={args.pairs}")
    summary = []
    for name in args.scenarios.split(","):
        bs, batches = SCENARIOS[name]
        print(f"\n[{name}] batch_size={bs}, num_workers=0, {batches} batches per run")
        print(f"{'pair':>4}  {'order':>6}  {'off b/s':>10}  {'on b/s':>10}  {'on/off':>7}")
        ratios: list[float] = []
        extra_ns: list[float] = []
        hook_ns: list[float] = []
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {agent: measure(agent, bs, batches) for agent in order}
            off, on = got[False]["rate"], got[True]["rate"]
            ratios.append(on / off)
            extra_ns.append((1 / on - 1 / off) * 1e9)
            if got[True].get("hook_ns") is not None:
                hook_ns.append(got[True]["hook_ns"])
            label = "off,on" if order[0] is False else "on,off"
            print(f"{i:>4}  {label:>6}  {off:>10.0f}  {on:>10.0f}  {on / off:>7.4f}")
        ab_cmd = [sys.executable, __file__, "--ab", str(bs), str(batches)]
        ab = json.loads(subprocess.run(ab_cmd, capture_output=True, text=True, check=True).stdout)["ratio"]
        print(f"in-process A/B (hooked vs original __next__, alternating blocks): on/off = {ab:.4f}")
        med = statistics.median(ratios)
        summary.append(
            (name, bs, med, ab, statistics.median(extra_ns), statistics.median(hook_ns) if hook_ns else 0)
        )
        print(
            f"median on/off = {med:.4f}; median extra time per batch = {statistics.median(extra_ns):.0f} ns"
        )
    head = ("scenario", "bs", "median on/off", "in-process A/B", "extra ns/batch", "hook ns (isolated)")
    print("\n{:>8}  {:>4}  {:>13}  {:>14}  {:>14}  {:>18}".format(*head))
    for name, bs, med, ab, extra, hns in summary:
        flag = "" if name != "bs64" else ("  >= target" if med >= TARGET else f"  < target {TARGET}")
        print(f"{name:>8}  {bs:>4}  {med:>13.4f}  {ab:>14.4f}  {extra:>14.0f}  {hns:>18.0f}{flag}")


if __name__ == "__main__":
    main()
