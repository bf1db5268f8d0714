"""Runs out of file descriptors with the agent serving, for tests/integration/agent/test_agent_safety.py.

It lowers its own RLIMIT_NOFILE, opens /dev/null until open() fails, and reports its agent's
socket and serving thread. Commands on stdin: ``free`` (close those fds again), ``exit``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

import dlmon.agent

dlmon.agent.start()


def emit(ev: str, **kw: Any) -> None:
    print("@@ " + json.dumps({"ev": ev, "t": time.monotonic_ns(), **kw}), flush=True)


def main() -> None:
    srv = dlmon.agent._serving
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
    fds: list[int] = []
    try:
        while True:
            fds.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    emit("exhausted", pid=os.getpid(), tid=srv.thread.native_id, path=srv.path, opened=len(fds))
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "free":
            for fd in fds:
                os.close(fd)
            fds = []
            emit("freed")
        elif cmd == "exit":
            break


if __name__ == "__main__":
    main()
