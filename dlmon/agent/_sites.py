"""Where a loader comes from: the user's code that built it, the framework and the role.

Standard library only, and never on the per-batch path: these walk the calling stack when a
loader or an iterator is built, or a persistent iterator restarts.
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import FrameType
from typing import Any

from dlmon.agent._code_paths import is_library_file
from dlmon.agent._registry import R, _LoaderState

_AGENT_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_site(skip_self: Any = None) -> tuple[str | None, int | None, str | None]:
    """The first frame of the user's code: outside torch, dlmon, installed packages (torchdata,
    accelerate, lightning, transformers...: site-packages, dist-packages) and the standard
    library, and outside ``__init__`` of the object being built. When every frame is in one of
    those (a loader built by a library's own script), the first frame outside torch and dlmon's
    agent, as before."""
    try:
        f: FrameType | None = sys._getframe(2)
    except Exception:
        return None, None, None
    tdir = R.torch_dir
    fallback: tuple[str | None, int | None, str | None] = (None, None, None)
    depth = 0
    while f is not None and depth < 64:
        depth += 1
        fn = f.f_code.co_filename
        inside = fn.startswith(_AGENT_DIR) or (tdir is not None and fn.startswith(tdir))
        if not inside and skip_self is not None and f.f_code.co_name == "__init__":
            with contextlib.suppress(Exception):
                inside = f.f_locals.get("self") is skip_self  # a DataLoader subclass's __init__
        if not inside:
            if not is_library_file(fn):
                return fn, f.f_lineno, f.f_code.co_name
            if fallback[0] is None:
                fallback = (fn, f.f_lineno, f.f_code.co_name)
        f = f.f_back
    return fallback


def _built_by_library(skip_self: Any) -> bool:
    """Whether the code that built ``skip_self`` (the first frame outside torch, dlmon's agent and
    its own ``__init__``) is an installed package's (accelerate's prepare, Lightning's re-creation),
    not the user's. At construction only."""
    try:
        f: FrameType | None = sys._getframe(1)
        tdir = R.torch_dir
        depth = 0
        while f is not None and depth < 64:
            depth += 1
            fn = f.f_code.co_filename
            inside = fn.startswith(_AGENT_DIR) or (tdir is not None and fn.startswith(tdir))
            if not inside and f.f_code.co_name == "__init__":
                inside = f.f_locals.get("self") is skip_self
            if not inside:
                return is_library_file(fn)
            f = f.f_back
    except Exception:
        pass
    return False


# Frameworks by a path fragment of their files; the outermost one seen on the stack is named.
_FRAMEWORK_PATHS: tuple[tuple[str, str], ...] = (
    ("/transformers/", "HF Trainer"),
    ("/lightning/", "Lightning"),
    ("/pytorch_lightning/", "Lightning"),
    ("/lightning_fabric/", "Lightning"),
    ("/accelerate/", "accelerate"),
    ("/torchdata/", "torchdata"),
)
_HF_ROLES = {
    "get_train_dataloader": "train",
    "get_eval_dataloader": "validation",
    "get_test_dataloader": "test",
}
_LIGHTNING_ROLES = {
    "train": "train",
    "sanity_check": "validation",
    "validate": "validation",
    "test": "test",
    "predict": "other",
}


def _framework_context() -> tuple[str | None, str | None]:
    """(framework, role) from the calling stack: HF Trainer's ``get_*_dataloader``, Lightning's
    trainer stage (``trainer.state.stage`` of the loop that builds or restarts the iterator).
    Called when a loader or an iterator is built, or a persistent iterator restarts: never per batch."""
    try:
        f: FrameType | None = sys._getframe(2)
    except Exception:
        return None, None
    framework: str | None = None
    role: str | None = None
    depth = 0
    while f is not None and depth < 96:
        depth += 1
        fn = f.f_code.co_filename
        for part, name in _FRAMEWORK_PATHS:
            if part in fn:
                framework = name  # the outermost wins (HF Trainer around accelerate)
                if role is None:
                    role = _frame_role(f, name)
                break
        f = f.f_back
    return framework, role


def _frame_role(f: FrameType, framework: str) -> str | None:
    if framework == "HF Trainer":
        return _HF_ROLES.get(f.f_code.co_name)
    if framework != "Lightning":
        return None
    try:
        owner = f.f_locals.get("self")
        trainer = getattr(owner, "trainer", None) or (owner if hasattr(owner, "state") else None)
        stage = getattr(getattr(getattr(trainer, "state", None), "stage", None), "value", None)
        return _LIGHTNING_ROLES.get(stage) if isinstance(stage, str) else None
    except Exception:
        return None


def _note_context(ls: _LoaderState, framework: str | None, role: str | None) -> None:
    if framework is not None and ls.framework in (None, "accelerate", "torchdata"):
        ls.framework = framework
    if role is not None and ls.role_source != "framework":
        ls.role = role
        ls.role_source = "framework"


def _loader_class_framework(loader: Any) -> str | None:
    mod = getattr(type(loader), "__module__", "") or ""
    for prefix, name in (("torchdata", "torchdata"), ("accelerate", "accelerate")):
        if mod.startswith(prefix):
            return name
    return None


def _set_site(ls: _LoaderState, site: tuple[str | None, int | None, str | None], kind: str) -> None:
    fn, line, func = site
    if fn is None:
        return
    ls.file = fn
    ls.line = line
    ls.function = func
    ls.site_kind = kind
    base = os.path.basename(fn) if not fn.startswith("<") else fn
    ls.name = f"{base}:{line}"


def _tune_site(loader: Any) -> str | None:
    try:
        fn, line, _ = _user_site(loader)
    except Exception:
        return None
    return f"{fn}:{line}" if fn is not None else None
