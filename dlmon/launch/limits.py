"""dlmon's open-files limit: raised at start for dlmon, the original kept for the training.

Imported by the CLI entry before anything else (cheap: ``resource`` only), so the original
limit is captured before it is raised.
"""

from __future__ import annotations

import contextlib
import resource

# the limit dlmon was started with: the training gets this one, whatever dlmon raised its own to
_ORIGINAL_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)


def raise_open_files_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit (one syscall pair); returns (old soft, new soft).

    dlmon holds a few fds per watched process: 8 ranks x 40 workers break a soft limit of 1024.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


def limit_was_raised() -> bool:
    return resource.getrlimit(resource.RLIMIT_NOFILE) != _ORIGINAL_NOFILE


def restore_open_files_limit() -> None:
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, _ORIGINAL_NOFILE)
