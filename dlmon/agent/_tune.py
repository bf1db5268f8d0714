"""``dlmon tune`` inside the training: override one DataLoader's arguments from the environment.

Standard library only. ``DLMON_TUNE`` holds JSON (never pickle), e.g.
``{"num_workers": 4, "batch_size": 64, "pin_memory": true, "prefetch_factor": 2, "loader": "train.py:42"}``;
a key that is absent or null keeps the script's own value. ``loader`` picks the DataLoader by the
``file:line`` where it is constructed; without it, the first DataLoader constructed is the target.
Only loaders built at that site change (all of them: a script may build its loader every epoch).

What happened is written to the JSON file named by ``DLMON_TUNE_STATUS`` (temp file + rename):
the target's site, the script's own arguments, the applied ones, why the batch size could not be
changed (a ``batch_sampler``: "not tunable"), and a CUDA out-of-memory error that ended the run
(seen by a chained ``sys.excepthook``).

Test seam (there is no GPU here): ``DLMON_TUNE_FAKE_CUDA_OOM=N`` makes ``Tensor.backward`` raise
torch's ``OutOfMemoryError`` ("CUDA out of memory") when the tuned batch size is at least N.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

ENV_CONFIG = "DLMON_TUNE"
ENV_STATUS = "DLMON_TUNE_STATUS"
ENV_FAKE_CUDA_OOM = "DLMON_TUNE_FAKE_CUDA_OOM"
TUNED = ("num_workers", "batch_size", "pin_memory", "prefetch_factor")
MAX_SEEN = 32


class _State:
    config: dict[str, Any] | None = None
    loaded = False
    target_site: str | None = None  # every loader built there is tuned (one built per epoch too)
    status: dict[str, Any] = {}
    seen: list[str] = []
    hook_installed = False


S = _State()


def _config() -> dict[str, Any] | None:
    if not S.loaded:
        S.loaded = True
        raw = os.environ.get(ENV_CONFIG)
        if raw:
            try:
                value = json.loads(raw)
            except Exception as exc:  # ValueError, and RecursionError for deeply nested JSON
                S.status = {"error": f"{ENV_CONFIG} is not JSON: {exc}"[:300]}
                _write_status()
                return None
            S.config = value if isinstance(value, dict) else None
    return S.config


def active() -> bool:
    return _config() is not None


def _write_status() -> None:
    path = os.environ.get(ENV_STATUS)
    if not path:
        return
    with contextlib.suppress(Exception):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(S.status, fh)
        os.replace(tmp, path)


def rewrite(
    orig: Callable[..., None], site: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The DataLoader ``__init__`` arguments to use: ``(self, *args)`` and ``kwargs`` as given
    unless this loader is the tuning target. Never raises: on any doubt the arguments pass as is."""
    cfg = _config()
    if cfg is None:
        return args, kwargs
    try:
        name = site or "?"
        if S.target_site is not None:
            if name != S.target_site:
                return args, kwargs
        else:
            if len(S.seen) < MAX_SEEN:
                S.seen.append(name)
            wanted = cfg.get("loader")
            if wanted and not _site_matches(name, str(wanted)):
                S.status["seen"] = list(S.seen)
                _write_status()
                return args, kwargs
            S.target_site = name
        import inspect  # only when tuning: the agent's import stays cheap

        bound = inspect.signature(orig).bind(*args, **kwargs)
        a = bound.arguments
        extra = a.get("kwargs") if isinstance(a.get("kwargs"), dict) else None
        original = {k: _get(a, extra, k, orig) for k in TUNED}
        not_tunable: str | None = None
        batch_sampler = _get(a, extra, "batch_sampler", orig)
        if batch_sampler is not None:
            original["batch_size"] = getattr(batch_sampler, "batch_size", None)
            not_tunable = "batch_size is not tunable: the loader is built with a batch_sampler"
        elif original["batch_size"] is None:
            not_tunable = "batch_size is not tunable: the loader does not batch (batch_size=None)"
        applied: dict[str, Any] = {}
        for key in TUNED:
            value = cfg.get(key)
            if value is None or (key == "batch_size" and not_tunable):
                continue
            if not _valid(key, value):  # torch would raise: the training keeps its own value
                S.status["error"] = f"{ENV_CONFIG}: {key}={value!r} is not valid"[:300]
                continue
            _set(a, extra, key, value)
            applied[key] = value
        workers = _get(a, extra, "num_workers", orig)
        if not workers:  # torch refuses these without workers
            for key, empty in (("prefetch_factor", None), ("persistent_workers", False)):
                if _get(a, extra, key, orig) not in (None, False):
                    _set(a, extra, key, empty)
            if _get(a, extra, "multiprocessing_context", orig) is not None:
                _set(a, extra, "multiprocessing_context", None)
        S.status.update(
            {"loader": name, "original": original, "applied": applied, "not_tunable": not_tunable}
        )
        S.status["seen"] = list(S.seen)
        _write_status()
        _install_excepthook()
        _maybe_fake_cuda_oom(_get(a, extra, "batch_size", orig))
        if cfg.get("loader_only") and args:
            _iterate_only(args[0])
        return tuple(bound.args), dict(bound.kwargs)
    except Exception as exc:
        S.status["error"] = f"{type(exc).__name__}: {exc}"[:300]
        _write_status()
        return args, kwargs


def _valid(key: str, value: Any) -> bool:
    if key == "pin_memory":
        return isinstance(value, bool)
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return value >= 0 if key == "num_workers" else value > 0


def _site_matches(name: str, wanted: str) -> bool:
    """``train.py:42`` matches ``/abs/path/train.py:42`` and the reverse (basename and line)."""
    if name == wanted:
        return True
    n_file, _, n_line = name.rpartition(":")
    w_file, _, w_line = wanted.rpartition(":")
    return n_line == w_line and os.path.basename(n_file) == os.path.basename(w_file)


def _default(orig: Callable[..., None], key: str) -> Any:
    import inspect

    try:
        param = inspect.signature(orig).parameters.get(key)
    except (TypeError, ValueError):
        return None
    if param is None or param.default is inspect.Parameter.empty:
        return None
    return param.default


def _get(a: dict[str, Any], extra: dict[str, Any] | None, key: str, orig: Callable[..., None]) -> Any:
    if key in a:
        return a[key]
    if extra is not None and key in extra:
        return extra[key]
    return _default(orig, key)


def _set(a: dict[str, Any], extra: dict[str, Any] | None, key: str, value: Any) -> None:
    if extra is not None and key not in a:
        extra[key] = value
    else:
        a[key] = value


def _iterate_only(loader: Any) -> None:
    """``--loader-only``: iterating this loader consumes it epoch after epoch and never hands a
    batch to the training step, so the agent measures the input pipeline's ceiling. It ends with
    dlmon's SIGINT (KeyboardInterrupt), or returns to the script if an epoch is empty."""
    cls = type(loader)
    original = cls.__iter__
    target = weakref.ref(loader)

    def __iter__(self: Any) -> Any:
        if target() is self:
            while True:
                got = False
                for _ in original(self):
                    got = True
                if not got:
                    break
        return original(self)

    cls.__iter__ = __iter__
    S.status["loader_only"] = True
    _write_status()


def _is_cuda_oom(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(exc)


def _install_excepthook() -> None:
    if S.hook_installed:
        return
    S.hook_installed = True
    previous = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        with contextlib.suppress(Exception):
            if _is_cuda_oom(value):
                S.status["outcome"] = "cuda_oom"
                S.status["message"] = str(value).splitlines()[0][:300] if str(value) else tp.__name__
                S.status["vram_reserved_bytes"] = _torch_reserved()
                _write_status()
        previous(tp, value, tb)

    sys.excepthook = hook


def _torch_reserved() -> int | None:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return int(torch.cuda.max_memory_reserved())
    except Exception:
        return None
    return None


def _maybe_fake_cuda_oom(batch_size: Any) -> None:
    raw = os.environ.get(ENV_FAKE_CUDA_OOM)
    torch = sys.modules.get("torch")
    if not raw or torch is None or not isinstance(batch_size, int):
        return
    try:
        threshold = int(raw)
    except ValueError:
        return
    if batch_size < threshold or getattr(torch.Tensor.backward, "__wrapped__", None) is not None:
        return
    error = getattr(torch, "OutOfMemoryError", RuntimeError)
    original_backward = torch.Tensor.backward

    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise error(
            f"CUDA out of memory. Tried to allocate 2.00 GiB (fake: {ENV_FAKE_CUDA_OOM}={threshold}, "
            f"batch_size={batch_size})"
        )

    backward.__wrapped__ = original_backward  # type: ignore[attr-defined]
    torch.Tensor.backward = backward
