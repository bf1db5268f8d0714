"""Which files are the user's code: everything but the standard library, installed packages and dlmon.

Used off the hot path only (a loader's construction, an exception on its way out). Standard library
only, and not ``sysconfig``: its generated ``_sysconfigdata`` module is one import more in the
training. ``site`` gives the installed packages' directories, ``os.__file__`` the standard library's.
"""

from __future__ import annotations

import os
import sys

_DLMON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_prefixes: tuple[str, ...] | None = None


def library_prefixes() -> tuple[str, ...]:
    """Directories (each ending in a separator) whose files are not the user's; computed once."""
    global _prefixes
    if _prefixes is not None:
        return _prefixes
    dirs = {_DLMON_DIR, os.path.dirname(os.path.abspath(os.__file__))}
    try:
        import site

        dirs.update(site.getsitepackages())
        if site.ENABLE_USER_SITE is not False:
            dirs.add(site.getusersitepackages())
    except Exception:  # a trimmed or embedded interpreter: the path checks below still apply
        pass
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        dirs.add(os.path.join(prefix, sys.platlibdir, f"python{sys.version_info[0]}.{sys.version_info[1]}"))
    found = {os.path.abspath(d) for d in dirs if d}
    found |= {os.path.realpath(d) for d in found}
    _prefixes = tuple(sorted(d.rstrip(os.sep) + os.sep for d in found))
    return _prefixes


def is_library_file(path: str) -> bool:
    """True for dlmon's, the standard library's and installed packages' files, and ``<frozen …>``."""
    if path.startswith("<"):
        return True  # <frozen runpy>, <string>
    if f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path:
        return True
    return path.startswith(library_prefixes())
