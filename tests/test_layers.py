"""The layers stay apart: only dlmon/ui may load textual, rich or plotext, and the agent loads
nothing outside the standard library. Checked in a fresh interpreter, where nothing else could
have imported them first."""

from __future__ import annotations

import json
import subprocess
import sys

UI_MODULES = ("textual", "rich", "plotext", "textual_plotext")


def modules_after_import(*modules: str) -> set[str]:
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


def test_non_ui_layers_do_not_load_ui_libraries() -> None:
    loaded = modules_after_import(
        "dlmon.collect.sampler",
        "dlmon.collect.processes",
        "dlmon.model",
        "dlmon.model.serialize",
        "dlmon.analysis",
        "dlmon.flow.recording",
        "dlmon.flow.sources",
        "dlmon.flow.loop",
        "dlmon.launch.runner",
        "dlmon.launch.session",
        "dlmon.cli",
    )
    assert "dlmon.collect.sampler" in loaded  # the check is not vacuous
    offenders = sorted(m for m in loaded if m.split(".")[0] in UI_MODULES)
    assert offenders == []


def test_cli_help_does_not_load_the_collectors() -> None:
    """`dlmon --help` must stay fast: commands import their machinery lazily."""
    loaded = modules_after_import("dlmon.cli")
    assert "click" in loaded
    assert not {"psutil", "pynvml", "dlmon.collect.sampler", "torch"} & loaded
