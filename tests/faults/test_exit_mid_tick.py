"""The target (and its workers) exiting at any point of a tick: no exception escapes the sampler, and
the last snapshot says the target exited."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

from dlmon.collect.sampler import NoSuchProcess, Sampler

from .support import children_of, tree_of_sleepers

ROUNDS = 30


def test_the_target_exiting_at_random_points_of_ticks_never_raises() -> None:
    rng = random.Random(13)
    code = textwrap.dedent(tree_of_sleepers(3))
    exited_seen = 0
    for round_ in range(ROUNDS):
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
            try:
                sampler = Sampler(proc.pid)
            except NoSuchProcess:
                continue
            sampler.sample()
            # kill the workers first half of the time (orphans mid-tick), then the target, each at a
            # random offset while the test thread samples back to back
            delay = rng.uniform(0.0, 0.03)
            kill_workers_first = round_ % 2 == 0

            def killer(
                target: subprocess.Popen[str] = proc, d: float = delay, first: bool = kill_workers_first
            ) -> None:
                time.sleep(d)
                if first:
                    for child in children_of(target.pid):
                        os.kill(child, signal.SIGKILL)
                    time.sleep(d / 3)
                target.send_signal(signal.SIGKILL)

            t = threading.Thread(target=killer)
            t.start()
            deadline = time.monotonic() + 5
            while t.is_alive() and time.monotonic() < deadline:
                sampler.sample()  # must never raise, whatever the kill interrupted
            t.join()
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
            zombie = sampler.sample()  # not reaped yet: a zombie
            assert not zombie.target.alive
            proc.wait()
            final = sampler.sample()  # reaped: gone
            assert not final.target.alive
            exited_seen += 1
            sampler.close()
        finally:
            with contextlib.suppress(ProcessLookupError):  # the round's tree, orphans included
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert exited_seen >= ROUNDS - 2
