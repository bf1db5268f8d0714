"""A process that never imports torch, for the transport tests in tests/integration/agent/test_agent.py.

Commands on stdin: ``fork`` (fork a child that reports whether it serves, then exits through
sys.exit so that its atexit handlers run), ``modules`` (report whether torch is imported),
``exit``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def emit(ev: str, **kw: Any) -> None:
    print("@@ " + json.dumps({"ev": ev, "t": time.monotonic_ns(), **kw}), flush=True)


def main() -> None:
    if "--start" in sys.argv:
        import dlmon.agent

        dlmon.agent.start()
    import dlmon.agent

    emit("ready", pid=os.getpid(), serving=dlmon.agent.serving_path(), torch="torch" in sys.modules)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "fork":
            r, w = os.pipe()
            child = os.fork()
            if child == 0:
                os.close(r)
                os.write(w, json.dumps({"serving": dlmon.agent.serving_path()}).encode())
                os.close(w)
                time.sleep(0.5)
                sys.exit(0)  # runs atexit in the child: it must not remove the parent's socket
            os.close(w)
            with os.fdopen(r) as f:
                got = json.loads(f.read())
            emit("forked", child=child, child_serving=got["serving"])
            os.waitpid(child, 0)
            emit("child_exited", child=child)
        elif cmd == "modules":
            emit("modules", torch="torch" in sys.modules, dataloader="torch.utils.data" in sys.modules)
        elif cmd == "exit":
            break


if __name__ == "__main__":
    main()
