"""Every alert kind is its detector module and one registry line, and nothing about a kind is missing.

A kind's module holds its name, its detector and its numbers; its registry line names all three.
Forgetting the line leaves a detector (or a numbers class) of the package that no line names:
the first test fails. A detector reading numbers no line names fails on every job
(``Thresholds`` refuses them), the healthy one at the end included."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import pickle
import pkgutil
import re
import sys

import pytest

import dlmon.analysis.detectors as detectors_package
from dlmon.analysis import Analyzer
from dlmon.analysis.detectors import DEFAULT_THRESHOLDS, Context, Thresholds
from dlmon.analysis.detectors.registry import (
    CAUSE_ORDER,
    DEFAULT_HOLDS,
    DETECTORS,
    ENDINGS,
    NUMBERS,
    SPEC_BY_KIND,
    SPECS,
    STATES,
)
from dlmon.analysis.detectors.stall import StallNumbers, StallState
from dlmon.analysis.kinds import KINDS
from dlmon.model import Pressure, Snapshot
from support.paths import ROOT
from support.snapshots import GIB, MAIN_PID, MIB, disk, gpu, loader, proc, snap

DOC = ROOT / "docs" / "detectors.md"


def test_every_kind_has_exactly_one_spec_in_the_order_of_kinds() -> None:
    assert tuple(s.name for s in SPECS) == KINDS
    assert len(SPEC_BY_KIND) == len(SPECS)


def _package_members() -> tuple[set[object], set[type], set[type]]:
    """Every ``detect_*`` function, ``*Numbers`` and ``*State`` dataclass defined in a module of
    dlmon/analysis/detectors."""
    detectors: set[object] = set()
    numbers: set[type] = set()
    states: set[type] = set()
    for info in pkgutil.iter_modules(detectors_package.__path__):
        module = importlib.import_module(f"{detectors_package.__name__}.{info.name}")
        for name, value in vars(module).items():
            if getattr(value, "__module__", None) != module.__name__:
                continue  # imported from elsewhere
            if name.startswith("detect_") and inspect.isfunction(value):
                detectors.add(value)
            if name.endswith("Numbers") and inspect.isclass(value) and dataclasses.is_dataclass(value):
                numbers.add(value)
            if name.endswith("State") and inspect.isclass(value) and dataclasses.is_dataclass(value):
                states.add(value)
    return detectors, numbers, states


def test_every_detector_and_its_numbers_are_in_a_registry_line() -> None:
    """A new kind's module without its KindSpec line (or a line without its ``numbers=`` or
    ``state=``) fails here."""
    detectors, numbers, states = _package_members()
    assert detectors, "the premise: the package's detectors are found"
    assert {d.__name__ for d in detectors} - {s.detector.__name__ for s in SPECS} == set()
    assert {n.__name__ for n in numbers} - {n.__name__ for n in NUMBERS} == set()
    assert {n.__name__ for n in states} - {n.__name__ for n in STATES} == set()


def test_a_kinds_name_and_numbers_live_in_its_detectors_module() -> None:
    for spec in SPECS:
        module = sys.modules[spec.detector.__module__]
        assert spec.name in {v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)}, (
            spec.name
        )
        if spec.numbers is not None:
            assert spec.numbers.__module__ == module.__name__, spec.name
            assert dataclasses.is_dataclass(spec.numbers), spec.name
            spec.numbers()  # every number has its default
        if spec.state is not None:
            assert spec.state.__module__ == module.__name__, spec.name
    names = [f.name for n in NUMBERS for f in dataclasses.fields(n)]
    assert len(names) == len(set(names)), "a number's name alone must say whose it is (Thresholds.<name>)"


def test_numbers_no_registry_line_names_are_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class StrayNumbers:
        limit: float = 1.0

    ctx = Context.from_history(_healthy_job(2))
    with pytest.raises(LookupError, match="StrayNumbers"):
        ctx.numbers(StrayNumbers)
    with pytest.raises(LookupError, match="StrayNumbers"):
        Thresholds(StrayNumbers())


def test_thresholds_stay_data_a_copy_keeps_them_and_equal_numbers_are_equal() -> None:
    """Before issue 22 ``Thresholds`` was a frozen dataclass: it pickled, deep-copied and compared
    by its numbers. The holder of overrides must too (a run's settings copied, or compared with
    the defaults, must not raise or tell apart what decides the same)."""
    given = Thresholds(StallNumbers(stall_critical_s=60.0))
    for copied in (pickle.loads(pickle.dumps(given)), copy.deepcopy(given), copy.copy(given)):
        assert copied == given and copied.of(StallNumbers).stall_critical_s == 60.0
    assert Thresholds(StallNumbers()) == DEFAULT_THRESHOLDS == Thresholds()
    assert hash(Thresholds(StallNumbers())) == hash(DEFAULT_THRESHOLDS)
    assert given != DEFAULT_THRESHOLDS


def test_a_detectors_state_is_the_analyzers_and_starts_over_with_a_new_target() -> None:
    """Cross-tick memory is one typed object per stateful detector, made by the Analyzer from the
    registry (never a cache in the digest), and a new target gets new ones."""

    @dataclasses.dataclass
    class StrayState:
        seen: int = 0

    analyzer = Analyzer(cores=8, strict=True)
    job = _healthy_job(30)
    for s in job:
        analyzer(s)
    stall = analyzer.states.of(StallState)
    assert set(stall.loaders) == {job[-1].loaders[0].id}
    assert {type(analyzer.states.of(cls)) for cls in STATES} == set(STATES)
    with pytest.raises(LookupError, match="StrayState"):
        analyzer.states.of(StrayState)
    analyzer(dataclasses.replace(job[-1], target=dataclasses.replace(job[-1].target, pid=MAIN_PID + 99)))
    assert analyzer.states.of(StallState) is not stall  # the old target's memory is gone with it


def test_every_spec_is_complete() -> None:
    for spec in SPECS:
        assert callable(spec.detector), spec.name
        assert spec.hold.raise_after_s >= 0 and spec.hold.clear_after_s >= 0, spec.name
        if spec.silences is not None:
            assert spec.silences.kind in KINDS and spec.silences.kind != spec.name
            assert callable(spec.silences.keys)
        if spec.resumption is not None:
            assert callable(spec.resumption.over)
            assert 0 <= spec.resumption.clear_after_s <= spec.hold.clear_after_s
        # what the exit keeps, or what says how the training ended, is something the verdict can name
        assert not (spec.last_words or spec.ending) or spec.cause is not None, spec.name
    assert DETECTORS.keys() == DEFAULT_HOLDS.keys()


def test_the_exit_verdicts_causes_have_distinct_ranks() -> None:
    ranks = sorted(s.cause for s in SPECS if s.cause is not None)
    assert ranks == list(range(ranks[0], ranks[0] + len(ranks))), ranks  # distinct, no gap
    # a signal's death first: the exception torch raises for a killed worker is its echo
    assert CAUSE_ORDER == (
        "trainer_died",
        "worker_died",
        "stall",
        "exception_death",
        "fd_exhaustion",
        "orphan_worker",
    )
    assert {"exception_death", "worker_died", "trainer_died"} == ENDINGS


def test_every_kind_has_a_section_in_the_detector_docs() -> None:
    headings = set(re.findall(r"^### (\w+)", DOC.read_text(), flags=re.MULTILINE))
    assert set(KINDS) - headings == set()


def test_the_documented_hold_table_is_the_registrys() -> None:
    """docs/detectors.md's table of holds, row by row, against DEFAULT_HOLDS (a kind added
    without its row, or a hold changed without the doc, fails here)."""
    rows = re.findall(r"^\| (\w+) \| (\d+(?:\.\d+)?) s\b[^|]*\| (\d+(?:\.\d+)?) s\b", DOC.read_text(), re.M)
    table = {kind: (float(up), float(down)) for kind, up, down in rows}
    held = {kind: (h.raise_after_s, h.clear_after_s) for kind, h in DEFAULT_HOLDS.items()}
    assert table == held


def _healthy_job(seconds: int = 400) -> list[Snapshot]:
    """A training doing well, with every input a detector reads: the trainer and four persistent
    workers at flat memory (PSS read every 10 s), their DataLoader delivering at a steady pace
    with a small wait, a GPU at a twentieth of its memory, a disk at 5%, low pressure, open fds far
    from their limit, /dev/shm mostly free."""
    workers = [MAIN_PID + 1 + i for i in range(4)]
    out = []
    for t in range(seconds):
        age = float(t % 10)
        main = proc(
            MAIN_PID, "main", uss=600 * MIB, pss=700 * MIB, rss=900 * MIB, age=age, cpu=95.0, threads=12
        )
        procs = [dataclasses.replace(main, num_fds=40, fd_limit=1024, torch_threads=8)]
        procs += [
            dataclasses.replace(
                proc(
                    pid,
                    uss=60 * MIB,
                    pss=200 * MIB,
                    rss=700 * MIB,
                    age=age,
                    cpu=40.0,
                    worker_id=i,
                    shmem=8 * MIB,
                ),
                num_fds=20,
                fd_limit=1024,
            )
            for i, pid in enumerate(workers)
        ]
        batches = 10 * t
        load = dataclasses.replace(
            loader(worker_pids=workers, wait=0.02),
            batches_total=batches,
            samples_total=64 * batches,
            batches_per_worker=tuple(batches // 4 for _ in workers),
            epochs=t // 100,
            epochs_started=t // 100 + 1,
            in_call_s=0.0,
            in_startup=False,
            wall_wait_fraction=0.02,
            startup_s_total=1.0,
        )
        out.append(
            snap(
                t,
                procs,
                interval=1.0 if t else None,
                loaders=[load],
                gpus=[gpu(used=4 * GIB, allocated=3 * GIB, reserved=3.5 * GIB, pids=(MAIN_PID,))],
                disks=[disk(util=5.0)],
                pressure=Pressure(io_some_avg10=0.5, memory_some_avg10=0.0, cpu_some_avg10=2.0),
            )
        )
    return out


def test_every_kind_stays_quiet_on_a_healthy_job() -> None:
    """A false alarm costs as much as a wrong number: every kind in the registry, a new one
    included without a line of this test, runs on a healthy job and must raise nothing."""
    analyzer = Analyzer(cores=8, strict=True)
    outs = [analyzer(s) for s in _healthy_job()]
    raised = sorted({f"{a.kind}: {a.message}" for s in outs for a in s.alerts})
    assert raised == []
    assert analyzer.errors == 0
