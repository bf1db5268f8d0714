"""Hypothesis over every file format dlmon reads: procfs, sysfs, cgroup files, record lines and
the agent's replies. Whatever a file holds, a parser returns a typed value or None (a "n/a"),
never raises (parse_stat's contract is narrower: ValueError/IndexError, which its callers turn
into "process gone"). Examples are bounded so CI stays fast.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dlmon.collect import cgroup, disks, processes, system
from dlmon.collect.agent_client import AgentClient, AgentReading
from dlmon.collect.agent_decode import parse_reply
from dlmon.collect.procfs import FieldPicker, StatFields, parse_stat
from dlmon.flow.records import RecordEnd, RecordProblem, parse_line
from dlmon.model import Snapshot
from dlmon.model.serialize import SnapshotFormatError, snapshot_from_dict, snapshot_to_dict
from support.ui import make_snapshot

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

STAT = (
    b"32151 (python train.py) R 32149 32149 31091 0 -1 4194304 100 0 0 0 7 3 0 0 20 0 1 0 441316 "
    b"3133440 382 18446744073709551615 94390374846464 94390374866345 140724270486112 0 0 0 0 0 0 0 0 0 "
    b"17 0 0 0 0 0 0\n"
)
STATUS = (
    b"Name:\tpt_data_worker\nUmask:\t0022\nState:\tS (sleeping)\nPPid:\t1\nVmRSS:\t  1808 kB\n"
    b"RssAnon:\t 116 kB\nRssFile:\t 1692 kB\nRssShmem:\t 0 kB\nVmSwap:\t 0 kB\nThreads:\t1\n"
)
SMAPS = (
    b"56089988b000-7ffc6b449000 ---p 00000000 00:00 0   [rollup]\nRss:  1808 kB\nPss:  267 kB\n"
    b"Pss_Anon:  116 kB\nPss_File:  151 kB\nPss_Shmem:  0 kB\nPrivate_Clean:  44 kB\n"
    b"Private_Dirty:  116 kB\nAnonymous:  116 kB\nSwap:  0 kB\nPrivate_Hugetlb:  0 kB\n"
)
MEMINFO = (
    "MemTotal:       24684084 kB\nMemFree:         1234567 kB\nMemAvailable:   20000000 kB\n"
    "Dirty:               88 kB\nSwapTotal:             0 kB\nSwapFree:              0 kB\nShmem: 4 kB\n"
)
VMSTAT = "nr_free_pages 123\nnr_zone_inactive_anon 4\noom_kill 3\nnr_dirty 7\n"
PRESSURE = (
    "some avg10=0.89 avg60=0.02 avg300=0.02 total=6337118\nfull avg10=0.10 avg60=0.00 avg300=0.00 total=1\n"
)
DISKSTATS = (
    "   7       0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
    " 259       0 nvme0n1 1200 3 90000 400 800 10 64000 900 0 700 1300 0 0 0 0 0 0\n"
    "   8       0 sda 1 2 3 4 5 6 7 8 9 10 11\n"
)
MEMORY_STAT_V1 = (
    "cache 4096\ntotal_cache 8192\ntotal_inactive_file 4096\nhierarchical_memory_limit 9223372036854771712\n"
)
MEMORY_STAT_V2 = "anon 1\nfile 8192\ninactive_file 4096\n"
PROC_CGROUP = "12:memory:/job\n11:cpu,cpuacct:/job\n0::/job\n"
MOUNTINFO = (
    "30 25 0:26 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
    "31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    "32 25 0:28 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
)

HUGE = st.sampled_from(
    ["18446744073709551615", "9" * 40, "9" * 5000, "-1", "-0", "1e999", "nan", "inf", "0x10"]
)
GARBAGE = st.sampled_from(
    ["\x00", "\xff", "\ufffd", " \t ", "\t\t", "\n\n", ":", "=", ")", "(", "kB", "٣٤", "1_000"]
)


@st.composite
def mutated(draw: st.DrawFn, sample: str) -> str:
    """``sample`` after a few edits of the kinds a broken kernel, a race or a disk gives."""
    text = sample
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["truncate", "respace", "number", "drop_line", "garbage", "dup_line"]))
        if not text:
            break
        at = draw(st.integers(0, len(text)))
        if op == "truncate":
            text = text[:at]
        elif op == "respace":
            text = text.replace(" ", draw(st.sampled_from(["", "  ", "\t", " \t "])), draw(st.integers(1, 3)))
        elif op == "number":
            digits = [i for i, c in enumerate(text) if c.isdigit()]
            if digits:
                i = digits[draw(st.integers(0, len(digits) - 1))]
                j = i
                while j < len(text) and text[j].isdigit():
                    j += 1
                text = text[:i] + draw(HUGE) + text[j:]
        elif op == "drop_line":
            lines = text.split("\n")
            del lines[draw(st.integers(0, len(lines) - 1))]
            text = "\n".join(lines)
        elif op == "dup_line":
            lines = text.split("\n")
            k = draw(st.integers(0, len(lines) - 1))
            lines.insert(k, lines[k])
            text = "\n".join(lines)
        else:
            text = text[:at] + draw(GARBAGE) + text[at:]
    return text


def text_of(sample: str) -> st.SearchStrategy[str]:
    return st.one_of(mutated(sample), st.text(max_size=300))


def bytes_of(sample: bytes) -> st.SearchStrategy[bytes]:
    as_text = sample.decode("latin-1")
    return st.one_of(mutated(as_text).map(lambda t: t.encode("latin-1", "replace")), st.binary(max_size=300))


def int_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def count_or_none(value: object) -> bool:
    """A byte count or counter: a whole number that is not negative, or None."""
    return value is None or (int_or_none(value) and isinstance(value, int) and value >= 0)


def finite_or_none(value: object) -> bool:
    return value is None or (isinstance(value, float | int) and math.isfinite(value))


# --------------------------------------------------------------------------- procfs


@FUZZ
@given(bytes_of(STAT))
def test_parse_stat_returns_fields_or_raises_what_its_callers_catch(raw: bytes) -> None:
    try:
        fields = parse_stat(raw)
    except (ValueError, IndexError):
        return  # ProcHandle.stat turns these into ProcessGone
    assert isinstance(fields, StatFields)
    assert isinstance(fields.comm, str) and isinstance(fields.state, str)
    assert all(
        isinstance(getattr(fields, n), int) for n in ("ppid", "utime_ticks", "start_time", "rss_pages")
    )


@FUZZ
@given(bytes_of(STATUS))
def test_field_picker_on_status(raw: bytes) -> None:
    out = processes.STATUS_FIELDS(raw)
    assert all(count_or_none(v) for v in out.values())
    assert set(out) <= {"VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin", "VmSwap",
                        "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches", "FDSize"}  # fmt: skip


@FUZZ
@given(bytes_of(b"rchar: 10\nwchar: 20\nread_bytes: 4096\nwrite_bytes: 8192\n"))
def test_field_picker_on_io(raw: bytes) -> None:
    out = processes.IO_FIELDS(raw)
    assert set(out) <= {"read_bytes", "write_bytes"}
    assert all(count_or_none(v) for v in out.values())


@FUZZ
@given(bytes_of(SMAPS))
@example(b"Pss: 1 kB\n")  # the first line is a wanted key (no newline before it)
def test_parse_smaps_rollup(raw: bytes) -> None:
    values = processes.parse_smaps_rollup(raw)
    assert all(count_or_none(getattr(values, f)) for f in values.__slots__)


def test_field_picker_takes_a_key_only_at_a_line_start() -> None:
    pick = FieldPicker(("Pss",))
    assert pick(b"XPss: 5 kB\n") == {}
    assert pick(b"Pss: 5 kB\n") == {"Pss": 5 * 1024}
    assert pick(b"Rss: 1 kB\nPss: 7\n") == {"Pss": 7}


# --------------------------------------------------------------------------- system files


@FUZZ
@given(text_of(MEMINFO))
@example("MemTotal: -5 kB\nMemFree: 1_000 kB\nDirty: ٣ kB\n")
def test_parse_meminfo(text: str) -> None:
    reading = system.parse_meminfo(text)
    assert all(count_or_none(getattr(reading, f)) for f in reading.__slots__)


@FUZZ
@given(text_of(VMSTAT))
@example("oom_kill -3\n")
def test_parse_vmstat_oom_kill(text: str) -> None:
    assert count_or_none(system.parse_vmstat_oom_kill(text))


@FUZZ
@given(text_of(PRESSURE))
@example("some avg10=nan avg60=0\nfull avg10=1e999\n")
def test_parse_pressure(text: str) -> None:
    some, full = system.parse_pressure(text)
    for value in (some, full):
        assert value is None or (isinstance(value, float) and math.isfinite(value) and value >= 0)


@FUZZ
@given(text_of(DISKSTATS))
def test_parse_diskstats_and_rates(text: str) -> None:
    before = disks.parse_diskstats(text)
    for name, counters in before.items():
        assert isinstance(name, str)
        sample = disks.compute_disk_sample(name, counters, counters, 1.0)
        assert sample.name == name
    reader = disks.DiskStatsReader(proc_root="/nonexistent", sys_root="/nonexistent")
    reader.sample_text(DISKSTATS, 1.0)
    for sample in reader.sample_text(text, 2.0):  # counters that went backwards or jumped
        for value in (
            sample.read_bytes_per_s,
            sample.write_bytes_per_s,
            sample.util_percent,
            sample.r_await_ms,
        ):
            assert value is None or (math.isfinite(value) and value >= 0)


# --------------------------------------------------------------------------- cgroup files


@FUZZ
@given(text_of(PROC_CGROUP))
def test_parse_proc_cgroup(text: str) -> None:
    found = cgroup.parse_proc_cgroup(text)
    assert found.v1_memory_path is None or isinstance(found.v1_memory_path, str)
    assert found.v2_path is None or isinstance(found.v2_path, str)


@FUZZ
@given(text_of(MOUNTINFO))
def test_parse_mountinfo(text: str) -> None:
    for mount in cgroup.parse_mountinfo(text):
        assert mount.fstype in ("cgroup", "cgroup2")
        assert isinstance(mount.mount_point, str) and isinstance(mount.root, str)


def _write(directory: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (directory / name).write_bytes(text.encode("utf-8", "surrogateescape"))


@FUZZ
@given(
    text_of("1073741824\n"),
    text_of("536870912\n"),
    text_of(MEMORY_STAT_V1),
    text_of("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"),
)
def test_cgroup_v1_memory_files(tmp_path: Path, limit: str, usage: str, stat: str, oom: str) -> None:
    _write(tmp_path, {"memory.limit_in_bytes": limit, "memory.usage_in_bytes": usage,
                      "memory.stat": stat, "memory.oom_control": oom})  # fmt: skip
    mem = cgroup.read_location(cgroup.CgroupLocation(1, "/job", str(tmp_path), ()))
    assert mem is not None
    for value in (
        mem.limit_bytes,
        mem.current_bytes,
        mem.working_set_bytes,
        mem.cache_bytes,
        mem.oom_kill_count,
    ):
        assert int_or_none(value)


@FUZZ
@given(
    text_of("max\n"), text_of("536870912\n"), text_of(MEMORY_STAT_V2), text_of("low 0\noom 1\noom_kill 1\n")
)
def test_cgroup_v2_memory_files(tmp_path: Path, limit: str, current: str, stat: str, events: str) -> None:
    _write(
        tmp_path,
        {"memory.max": limit, "memory.current": current, "memory.stat": stat, "memory.events": events},
    )
    mem = cgroup.read_location(cgroup.CgroupLocation(2, "/job", str(tmp_path), ()))
    assert mem is not None
    for value in (
        mem.limit_bytes,
        mem.current_bytes,
        mem.working_set_bytes,
        mem.cache_bytes,
        mem.oom_kill_count,
    ):
        assert int_or_none(value)


@FUZZ
@given(text_of("200000 100000\n"), text_of("200000\n"), text_of("100000\n"))
@example("9" * 400 + " 1\n", "9" * 400, "1")  # a quota no float can hold
@example("-100000 100000\n", "-5", "100000")
@example("200000 100000\n", "200000\n", "9" * 330 + "\n")  # a ratio that underflows to 0.0
def test_cpu_quota_files(tmp_path: Path, cpu_max: str, quota: str, period: str) -> None:
    _write(tmp_path, {"cpu.max": cpu_max, "cpu.cfs_quota_us": quota, "cpu.cfs_period_us": period})
    for version in (1, 2):
        cores = cgroup._quota_cores(version, str(tmp_path))
        assert cores is None or (isinstance(cores, float) and math.isfinite(cores) and cores > 0)


# --------------------------------------------------------------------------- record lines


def _valid_snapshot_dict() -> dict[str, Any]:
    return dict(json.loads(json.dumps(snapshot_to_dict(make_snapshot(gpus=1)))))


def _mutate_json(value: Any, draw: st.DrawFn, depth: int = 0) -> Any:
    replacement = st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
        st.just(10**400), st.just([]), st.just({}), st.just(-1), st.just(1e300),
    )  # fmt: skip
    if isinstance(value, dict) and value:
        key = draw(st.sampled_from(sorted(value)))
        action = draw(st.sampled_from(["recurse", "replace", "delete"]))
        out = dict(value)
        if action == "delete":
            del out[key]
        elif action == "replace":
            out[key] = draw(replacement)
        else:
            out[key] = _mutate_json(value[key], draw, depth + 1)
        return out
    if isinstance(value, list) and value:
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], _mutate_json(value[i], draw, depth + 1), *value[i + 1 :]]
    return draw(replacement)


@st.composite
def mutated_snapshot_lines(draw: st.DrawFn) -> bytes:
    data: Any = _valid_snapshot_dict()
    for _ in range(draw(st.integers(1, 4))):
        data = _mutate_json(data, draw)
    text = json.dumps(data, allow_nan=True)
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]  # a torn line
    return text.encode()


@FUZZ
@given(st.one_of(mutated_snapshot_lines(), st.binary(max_size=200)))
def test_a_record_line_is_a_snapshot_an_end_or_a_problem(raw: bytes) -> None:
    record = parse_line(1, raw)
    assert isinstance(record, Snapshot | RecordEnd | RecordProblem)
    if isinstance(record, Snapshot):  # whatever the reader passes must survive a round trip
        again = snapshot_from_dict(json.loads(json.dumps(snapshot_to_dict(record))))
        assert again == record


@FUZZ
@given(mutated_snapshot_lines())
def test_snapshot_from_dict_raises_only_its_format_error(raw: bytes) -> None:
    try:
        data = json.loads(raw)
    except ValueError:
        return
    if not isinstance(data, dict):
        return
    with contextlib.suppress(SnapshotFormatError):
        snapshot_from_dict(data)


# --------------------------------------------------------------------------- the agent's replies


def _agent_reply(pid: int, time_ns: int) -> dict[str, Any]:
    return {
        "pid": pid, "time_ns": time_ns, "agent_id": "a1", "num_threads": 9, "torch_version": "2.0",
        "loaders": [{
            "id": 1, "name": "train", "num_workers": 2, "batch_size": 8, "pin_memory": False,
            "persistent_workers": False, "prefetch_factor": 2, "batches_total": 10 + time_ns // 10**8,
            "samples_total": 80, "wait_ns_total": time_ns // 4, "compute_ns_total": time_ns // 2,
            "worker_pids": [11, 12], "batches_per_worker": [5, 5], "epochs": 1, "alive": True,
            "startup_wait_ns_total": 5, "file": "train.py", "line": 3,
        }],
        "cuda": [{"device": 0, "allocated": 1, "reserved": 2, "peak_allocated": 3, "uuid": "GPU-x"}],
        "worker_deaths": [{"pid": 11, "worker_id": 0, "loader_id": 1, "signal": 9, "unix_time": 1.5e9}],
        "degraded": {"hook": "why"},
        "pinned": {"bytes": 4096, "source": "torch"},
    }  # fmt: skip


@st.composite
def mutated_replies(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    first = _agent_reply(4242, 10**9)
    second: Any = _agent_reply(4242, 2 * 10**9)
    for _ in range(draw(st.integers(1, 4))):
        second = _mutate_json(second, draw)
    return first, second


@FUZZ
@given(mutated_replies())
def test_agent_reply_conversion_keeps_types(replies: tuple[dict[str, Any], dict[str, Any]]) -> None:
    client = AgentClient()
    first, second = replies
    client.convert({4242: first})
    reading = client.convert({4242: second})
    assert isinstance(reading, AgentReading)
    for loader in reading.loaders:
        for value in (
            loader.batches_per_s,
            loader.samples_per_s,
            loader.data_wait_fraction,
            loader.startup_s_total,
        ):
            assert finite_or_none(value)
    for death in reading.worker_deaths:
        assert finite_or_none(death.time)


@FUZZ
@given(st.one_of(mutated_replies().map(lambda r: json.dumps(r[1]).encode() + b"\n"), st.binary(max_size=300)))
@example(b"[" * 100_000 + b"\n")  # valid-looking nesting no JSON parser recurses through
def test_agent_wire_decoder_returns_a_reply_or_none(data: bytes) -> None:
    parsed = parse_reply(data, 4242)
    assert parsed is None or (isinstance(parsed, dict) and parsed.get("pid") == 4242)


def test_a_number_of_5000_digits_in_a_status_file_is_skipped_not_a_crash() -> None:
    # found by test_field_picker_on_status: int() refuses more than 4300 digits with ValueError
    assert processes.STATUS_FIELDS(b"VmRSS:\t" + b"9" * 5000 + b" kB\nVmSwap:\t3 kB\n") == {"VmSwap": 3072}
