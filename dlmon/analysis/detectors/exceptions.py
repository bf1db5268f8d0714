"""exception_death: the training died of an exception, named with what dlmon measured then.

The agent writes each exception that leaves a DataLoader's ``__next__`` and each uncaught one
(main thread, other threads) to its journal (``Snapshot.exceptions``). Only an ended training
is judged, and only an exception it died of:

- the main thread's uncaught exception (it went through ``sys.excepthook``): the process died of it;
- else, when the training exited non-zero (not by a signal), the last exception that left a
  DataLoader after which that loader delivered no batch (one the program caught and then went on
  from is not it), or else a thread's uncaught one.

A worker's death by a signal raises in the trainer too ("DataLoader worker (pid N) is killed by
signal"): that exception is its echo, and worker_died names the cause. Families: shared memory
exhausted, too many open files, host memory, CUDA out of memory, CUDA in a forked worker, a bug in
the program's code.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from dlmon.analysis.detectors._base import Candidate, Context, describe_headroom, headroom, size
from dlmon.analysis.severity import CRITICAL
from dlmon.model import LoaderSample, Snapshot
from dlmon.model.snapshot import TrainingException

EXCEPTION_DEATH = "exception_death"

SHM = "shm_exhausted"
FDS = "too_many_open_files"
HOST_MEMORY = "host_memory"
CUDA_OOM = "cuda_oom"
CUDA_FORK = "cuda_in_forked_worker"
BUG = "bug"
WORKER_ECHO = "worker_died"  # torch's word that a worker died (the death itself is worker_died's)
TIMEOUT = "loader_timeout"
OTHER = "exception"

FAMILIES = (SHM, FDS, HOST_MEMORY, CUDA_OOM, CUDA_FORK, BUG, WORKER_ECHO, TIMEOUT, OTHER)
SHOWN_CHARS = 160  # of the exception's message, in the alert's sentence
PLENTY_LEFT = 1 << 30  # a MemoryError with this much memory left was no host running out
FIGURES_WINDOW_S = 30.0  # how far before the exception its figures are looked for
ECHO_WINDOW_S = 30.0  # an exception this soon after a worker's death is the death's echo


def family(e: TrainingException) -> str:
    """Which of the families users hit this exception belongs to (from its type and text)."""
    kind = e.worker_type or e.type
    text = f"{e.worker_message or ''}\n{e.message}"
    low = text.lower()
    if (
        "unable to allocate shared memory" in low
        or "unable to write to file </torch_" in low
        or ("no space left on device" in low and ("/dev/shm" in low or "shm" in low or "</torch_" in low))
    ):
        return SHM
    if "too many open files" in low or "[errno 24]" in low or "received 0 items of ancdata" in low:
        return FDS
    if "cuda out of memory" in low or kind.endswith("OutOfMemoryError"):
        return CUDA_OOM
    if "cannot re-initialize cuda in forked subprocess" in low:  # torch.cuda._lazy_init's words
        return CUDA_FORK
    if kind.endswith("MemoryError") or "defaultcpuallocator: can't allocate memory" in low:
        return HOST_MEMORY
    if "dataloader worker (pid" in low and ("exited unexpectedly" in low or "killed by signal" in low):
        return WORKER_ECHO
    if "dataloader timed out after" in low:
        return TIMEOUT
    if e.file is not None and e.raised_there is not False:
        return BUG  # the program's own line raised it (a library under it: OTHER, with the line)
    return OTHER


def final_exception(ctx: Context) -> TrainingException | None:
    """The exception the ended training died of, if the agent saw one (the module's rules)."""
    s = ctx.latest
    if s.target.alive or not s.exceptions:
        return None
    code = s.target.exit_code
    if code == 0 or (code is not None and code > 128):
        return None  # a clean exit, or a signal (trainer_died names it)
    fatal = [e for e in s.exceptions if e.origin == "main"]
    if fatal:
        return min(fatal, key=lambda e: e.time or 0.0)
    if code is None:
        return None  # attached: without the exit status only an uncaught exception is a death
    last_of_loader = [e for e in s.exceptions if e.origin == "next" and not _delivered_after(ctx, e)]
    if last_of_loader:
        return max(last_of_loader, key=lambda e: e.time or 0.0)
    threads = [e for e in s.exceptions if e.origin == "thread"]
    return max(threads, key=lambda e: e.time or 0.0) if threads else None


def _after_a_death(s: Snapshot, e: TrainingException) -> bool:
    """A worker of the job died (by a signal, or exited non-zero) in the ECHO_WINDOW_S before ``e``."""
    when = e.time if e.time is not None else s.time
    return any(d.time is not None and when - ECHO_WINDOW_S <= d.time <= when + 1.0 for d in s.worker_deaths)


def _delivered_after(ctx: Context, e: TrainingException) -> bool:
    """The loader returned batches after ``e`` left it, or any loader did between the first poll
    after ``e`` and the last one (a new DataLoader): the program caught it and went on."""
    if e.batches is not None and e.loader_id is not None:
        for snap in reversed(ctx.recent):
            for loader in snap.loaders:
                if loader.id == e.loader_id and loader.batches_total is not None:
                    if loader.batches_total > e.batches:
                        return True
                    break
            else:
                continue
            break
    if e.time is None:
        return False
    # the same process's loaders only: another rank of a DDP job goes on a while as one dies
    polled = [
        [x for x in snap.loaders if x.pid == e.reported_by] for snap in ctx.recent if snap.time >= e.time
    ]
    polled = [got for got in polled if got]
    if len(polled) < 2:
        return False
    first = {x.id: x.batches_total or 0 for x in polled[0]}
    return any((x.batches_total or 0) > first.get(x.id, 0) for x in polled[-1])


def _loader(ctx: Context, loader_id: str | None) -> LoaderSample | None:
    if loader_id is None:
        return None
    for snap in reversed(ctx.recent):
        for loader in snap.loaders:
            if loader.id == loader_id:
                return loader
    return None


def _companion(s: Snapshot, e: TrainingException) -> TrainingException:
    """For the main thread's exception: the same one as it left the DataLoader (which knows the
    loader and its batch size), if the agent saw it there."""
    if e.origin == "next":
        return e
    for other in reversed(s.exceptions):
        if (
            other.origin == "next"
            and other.reported_by == e.reported_by
            and other.type == e.type
            and other.message == e.message
            and (other.time or 0.0) <= (e.time or 0.0)
        ):
            return other
    return e


def _before(ctx: Context, when: float | None) -> list[Snapshot]:
    """The snapshots of the FIGURES_WINDOW_S before ``when`` (the latest alone if none)."""
    at = ctx.now if when is None else when + 0.5
    got = [snap for snap in ctx.recent if at - FIGURES_WINDOW_S <= snap.time <= at and snap.target.alive]
    return got or [ctx.latest]


def _clip(text: str, limit: int = SHOWN_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _who(e: TrainingException, source: TrainingException, loader: LoaderSample | None) -> tuple[str, str]:
    """(the sentence's subject, the alert's subject)."""
    name = loader.name if loader is not None else source.loader_name
    of = f" (loader {name})" if name else ""
    if e.worker_origin == "pin_memory":
        pid = e.reported_by
        return f"The pin-memory thread of the trainer (pid {pid}){of}", f"trainer (pid {pid})"
    if e.worker_id is not None:
        return f"DataLoader worker {e.worker_id}{of}", f"worker {e.worker_id}"
    if e.origin == "thread":
        return (
            f"Thread '{e.thread}' of the trainer (pid {e.reported_by})",
            f"thread {e.thread} (pid {e.reported_by})",
        )
    if e.origin == "next":
        return f"The DataLoader{of} in the trainer (pid {e.reported_by})", f"trainer (pid {e.reported_by})"
    return f"The trainer (pid {e.reported_by})", f"trainer (pid {e.reported_by})"


def _what(e: TrainingException) -> str:
    kind = e.worker_type or e.type
    text = e.worker_message if e.worker_type else e.message
    return f"{kind}: {_clip(text)}" if text else kind


def _where(e: TrainingException) -> str:
    if e.file is None:
        return ""
    return f"{os.path.basename(e.file)}:{e.line} in {e.function}"


def detect_exception_death(ctx: Context) -> list[Candidate]:
    e = final_exception(ctx)
    if e is None:
        return []
    s = ctx.latest
    fam = family(e)
    if fam == WORKER_ECHO and (s.worker_deaths or any(k.kind == "oom_kill" for k in s.kernel_events)):
        return []  # worker_died names the death and how; this is torch's word of it
    if _after_a_death(s, e):
        return []  # raised as a worker died (a reset connection, a broken queue): an echo too
    source = _companion(s, e)
    loader = _loader(ctx, source.loader_id)
    who, subject = _who(e, source, loader)
    window = _before(ctx, e.time)
    evidence: dict[str, float | int | str | None] = {
        "cause": fam,
        "origin": e.origin,
        "type": e.worker_type or e.type,
        "message": _clip((e.worker_message or "") if e.worker_type else e.message, 300),
        "worker_id": e.worker_id,
        "pid": e.reported_by,
        "file": e.file,
        "line": e.line,
        "function": e.function,
        "thread": e.thread,
        "time": e.time,
        "exit_code": s.target.exit_code,
    }
    where = _where(e)
    at = f" at {where}" if where and fam != BUG else ""
    head = f"{who} raised {_what(e)}{at}"
    if fam == SHM:
        message, advice = _shm(window, source, loader, head, evidence)
    elif fam == FDS:
        message, advice = _fds(window, e, source, head, evidence)
    elif fam == HOST_MEMORY:
        message, advice = _host_memory(window, e, head, evidence)
    elif fam == CUDA_OOM:
        message, advice = _cuda(window, head, evidence)
    elif fam == CUDA_FORK:
        message, advice = _cuda_fork(head, from_worker=e.worker_id is not None or e.worker_type is not None)
    elif fam == BUG:
        kind = e.worker_type or e.type
        text = e.worker_message if e.worker_type else e.message
        # KeyError's text is the key's repr: "KeyError 'label'", as the users write it
        sep = " " if kind == "KeyError" else ": "
        message = f"{who} raised an exception at {where}: {kind}{sep + _clip(text) if text else ''}."
        advice = (
            "A bug in the program's own code at that line (not a resource dlmon watches); the whole "
            "traceback is in the training log."
        )
        if e.worker_id is not None:
            advice += (
                " To step through it, run the loader with num_workers=0: the Dataset raises in the trainer."
            )
    elif fam == WORKER_ECHO:
        message = (
            f"{head}; dlmon did not see how the worker died (no death in the agent's journal, "
            "none in the kernel log)."
        )
        advice = "Look in dmesg for the OOM killer and in the log for a signal; check memory headroom."
    elif fam == TIMEOUT:
        message = f"{head}."
        advice = "A worker took longer than the DataLoader's timeout for a batch: the log says what it did."
    else:
        message = f"{head}."
        advice = "The whole traceback is in the training log."
    if e.origin == "thread":
        code = s.target.exit_code
        message = message[:-1] + f" (uncaught: the thread ended, and the training exited {code} after it)."
    key = f"exception:{e.reported_by}"
    return [Candidate(EXCEPTION_DEATH, key, CRITICAL, subject, message, advice, evidence)]


def _shm(
    window: Sequence[Snapshot],
    e: TrainingException,
    loader: LoaderSample | None,
    head: str,
    evidence: dict[str, float | int | str | None],
) -> tuple[str, str]:
    shms = [snap.shm for snap in window if snap.shm is not None and snap.shm.used_bytes is not None]
    figures = ""
    if shms:
        shm = max(shms, key=lambda x: x.used_bytes or 0)
        path = "/dev/shm" if shm.path.endswith("/dev/shm") else shm.path  # not /proc/PID/root/dev/shm
        figures = f" — {path} was {size(shm.used_bytes)} of {size(shm.total_bytes)}"
        if shm.job_segments:
            figures += f" (the job's segments {size(shm.job_bytes)})"
        evidence.update(
            shm_used_bytes=shm.used_bytes, shm_total_bytes=shm.total_bytes, shm_job_bytes=shm.job_bytes
        )
    else:
        figures = " — dlmon has no reading of /dev/shm from before it"
    workers = loader.num_workers if loader is not None and loader.num_workers else e.num_workers
    prefetch = loader.prefetch_factor if loader is not None and loader.prefetch_factor else e.prefetch_factor
    if e.batch_bytes and workers and prefetch:
        flight = workers * prefetch
        figures += (
            f"; each batch takes ≈ {size(e.batch_bytes)} of it, and {workers} workers x prefetch_factor "
            f"{prefetch} keep {flight} in flight ({size(e.batch_bytes * flight)})"
        )
        evidence.update(batch_bytes=e.batch_bytes, num_workers=workers, prefetch_factor=prefetch)
    advice = (
        "Give /dev/shm more room: run the container with a bigger --shm-size (docker run --shm-size=8g; "
        "Kubernetes: an emptyDir with medium Memory on /dev/shm), or lower num_workers, prefetch_factor "
        "or the batch size; batches the program keeps alive keep their shared memory too."
    )
    return f"{head}{figures}.", advice


def _fds(
    window: Sequence[Snapshot],
    e: TrainingException,
    source: TrainingException,
    head: str,
    evidence: dict[str, float | int | str | None],
) -> tuple[str, str]:
    opened, limit, whose = e.open_fds, e.fd_limit, "the trainer"
    if e.worker_id is not None or opened is None:
        # a worker's (its process's own figures), or the agent could not count: the sampler's
        pids = {e.reported_by} if e.worker_id is None else _worker_pids(window, source.loader_id, e.worker_id)
        if e.worker_id is not None:
            whose = f"worker {e.worker_id}"
        rows = [p for snap in window for p in snap.processes if p.pid in pids and p.num_fds is not None]
        if rows:
            top = max(rows, key=lambda p: p.num_fds or 0)
            opened, limit = top.num_fds, top.fd_limit if top.fd_limit is not None else limit
        elif e.worker_id is not None:
            opened = limit = None
    strategy = e.sharing_strategy
    if opened is not None:
        figures = f" — {whose} had {opened} files open"
        figures += f" of its limit of {limit} (RLIMIT_NOFILE)" if limit is not None else ""
    else:
        figures = f" — dlmon has no count of {whose}'s open files"
    if strategy == "file_descriptor":
        figures += (
            "; torch's sharing strategy is 'file_descriptor' (each tensor in flight from a worker holds one)"
        )
    elif strategy:
        figures += f"; torch's sharing strategy is '{strategy}'"
    evidence.update(open_fds=opened, fd_limit=limit, sharing_strategy=strategy)
    advice = "Raise the limit (ulimit -n 65536 before the training; docker run --ulimit nofile=65536:65536)"
    if strategy == "file_system":
        advice += (
            "; the strategy is already 'file_system': the program's own files are the suspects (a leak?)."
        )
    else:
        advice += (
            ", or call torch.multiprocessing.set_sharing_strategy('file_system') at the start of the "
            "program (tensors then travel by name, not by descriptor)."
        )
    return f"{head}{figures}.", advice


def _worker_pids(window: Sequence[Snapshot], loader_id: str | None, worker_id: int) -> set[int]:
    pids: set[int] = set()
    for snap in window:
        for loader in snap.loaders:
            if (loader_id is None or loader.id == loader_id) and worker_id < len(loader.worker_pids):
                pids.add(loader.worker_pids[worker_id])
    return pids


def _host_memory(
    window: Sequence[Snapshot], e: TrainingException, head: str, evidence: dict[str, float | int | str | None]
) -> tuple[str, str]:
    rooms = [(h, snap) for snap in window if (h := headroom(snap)) is not None]
    if rooms:
        room, _snap = min(rooms, key=lambda x: x[0].bytes)
        figures = f" — the least headroom dlmon measured before it: {describe_headroom(room)}"
        if room.bytes >= PLENTY_LEFT and e.address_space_limit is None:
            figures += (
                "; with that much left, a limit of the process (ulimit -v, RLIMIT_AS) or one huge "
                "allocation is likelier than the host running out"
            )
        evidence.update(headroom_bytes=room.bytes, headroom_source=room.source, limit_bytes=room.limit_bytes)
    else:
        figures = " — dlmon has no memory figures from before it"
    if e.address_space_limit is not None:
        figures += f"; the process's address-space limit (ulimit -v) is {size(e.address_space_limit)}"
        evidence["address_space_limit"] = e.address_space_limit
        advice = (
            "An address-space limit (ulimit -v, RLIMIT_AS) fails allocations long before memory runs out "
            "(torch and CUDA reserve large virtual ranges): raise or remove it; else lower the job's memory."
        )
    else:
        advice = (
            "Lower the job's memory (batch size, num_workers, per-worker copies of big Python objects: "
            "copy-on-read) or give it more (a bigger cgroup limit, a machine with more memory)."
        )
    return f"{head}{figures}.", advice


def _cuda(
    window: Sequence[Snapshot], head: str, evidence: dict[str, float | int | str | None]
) -> tuple[str, str]:
    snap = window[-1]
    gpus = [
        g
        for g in snap.gpus
        if g.memory_used_bytes is not None and g.memory_total_bytes and not g.is_mig_parent
    ]
    if gpus:
        parts = []
        for g in gpus[:4]:
            part = f"GPU {g.key} {size(g.memory_used_bytes)} of {size(g.memory_total_bytes)} used"
            if g.torch_reserved_bytes is not None:
                alloc, reserved = size(g.torch_allocated_bytes), size(g.torch_reserved_bytes)
                part += f" (torch: {alloc} allocated, {reserved} reserved)"
            parts.append(part)
        figures = " — " + "; ".join(parts)
        evidence.update(gpu_used_bytes=gpus[0].memory_used_bytes, gpu_total_bytes=gpus[0].memory_total_bytes)
    else:
        why = (snap.gpu.reason or "no GPU figures").rstrip(". ")
        figures = f" — dlmon measured no VRAM figures ({why})"
    advice = (
        "Lower the batch size (gradient accumulation keeps the effective batch), use mixed precision "
        "(torch.autocast) or activation checkpointing; when torch reserves far more than it allocates, "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lessens fragmentation."
    )
    return f"{head}{figures}.", advice


def _cuda_fork(head: str, *, from_worker: bool) -> tuple[str, str]:
    if not from_worker:  # a Pool or Process of the program's own, started with fork
        message = (
            f"{head} — CUDA was used in a process forked from one that had already started CUDA (a "
            "multiprocessing Pool or Process started with fork), which a forked process cannot do."
        )
        advice = (
            "Keep CUDA out of the forked processes' work, or start them with "
            "multiprocessing.get_context('spawn') (torch.multiprocessing's too): a spawned process "
            "then holds a CUDA context of its own, hundreds of MiB of VRAM."
        )
        return message, advice
    message = (
        f"{head} — CUDA was used in a DataLoader worker forked from a trainer that had already "
        "started CUDA, which a forked process cannot do: the Dataset or collate_fn touched CUDA."
    )
    advice = (
        "Keep CUDA out of the Dataset and collate_fn: return CPU tensors and move the batch to the GPU "
        "in the training loop (pin_memory=True and .to(device, non_blocking=True) keep the copy fast). "
        "Only if a worker must use CUDA, start the workers with DataLoader(..., "
        "multiprocessing_context='spawn'): each worker then holds a CUDA context of its own, hundreds "
        "of MiB of VRAM."
    )
    return message, advice
