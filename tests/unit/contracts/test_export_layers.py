"""dlmon/export stays out of the UI layer, and the CLI's --help does not pay for it."""

from __future__ import annotations

import json
import subprocess
import sys

UI_MODULES = ("textual", "rich", "plotext", "textual_plotext")


def modules_after_import(*modules: str) -> set[str]:
    code = "import json, sys\n" + "".join(f"import {m}\n" for m in modules)
    code += "print(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_export_loads_no_ui_library() -> None:
    loaded = modules_after_import(
        "dlmon.export.prometheus",
        "dlmon.flow.summary",
        "dlmon.export.text",
        "dlmon.export.html",
        "dlmon.export.diff",
    )
    assert "prometheus_client" in loaded and "dlmon.flow.summary" in loaded  # not vacuous
    assert sorted(m for m in loaded if m.split(".")[0] in UI_MODULES) == []


def test_cli_import_does_not_load_the_exporter() -> None:
    loaded = modules_after_import("dlmon.cli")
    assert not {"prometheus_client", "dlmon.flow.summary", "dlmon.export.prometheus"} & loaded


def test_new_commands_are_listed() -> None:
    out = subprocess.run([sys.executable, "-m", "dlmon", "--help"], capture_output=True, text=True).stdout
    for command in ("export", "report", "diff"):
        assert f"  {command} " in out, out


def test_fail_on_specs_parse() -> None:
    from dlmon.export.diff import Limit, parse_limit

    assert parse_limit("memory+10%") == Limit("memory", 1, 10.0, "%", "memory+10%")
    assert parse_limit(" throughput-5% ") == Limit("throughput", -1, 5.0, "%", "throughput-5%")
    assert parse_limit("data-wait+2.5pp") == Limit("data-wait", 1, 2.5, "pp", "data-wait+2.5pp")
    assert parse_limit("alerts+0") == Limit("alerts", 1, 0.0, "", "alerts+0")
