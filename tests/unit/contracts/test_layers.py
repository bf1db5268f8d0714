"""The layers stay apart: only dlmon/ui may load textual, rich or plotext, and the agent loads
nothing outside the standard library. Checked in a fresh interpreter, where nothing else could
have imported them first."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT

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
        "dlmon.cluster.command",
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


# ---- the import contracts, read from the source (lazy imports inside functions included) -------------
PACKAGES = (
    "agent",
    "model",
    "collect",
    "analysis",
    "flow",
    "launch",
    "export",
    "tune",
    "cluster",
    "ui",
    "cli",
)
# what each layer may import of dlmon besides itself; data flows one way: collect -> model ->
# analysis -> ui / export, and the agent (inside the training) stands alone
MAY_IMPORT: dict[str, frozenset[str]] = {
    "agent": frozenset(),
    "model": frozenset(),
    "collect": frozenset({"model", "agent"}),  # the agent's wire shapes
    "analysis": frozenset({"model"}),
    "flow": frozenset({"model", "collect", "analysis"}),
    "launch": frozenset({"model", "collect", "analysis", "flow", "agent"}),
    "export": frozenset({"model", "collect", "analysis", "flow", "agent"}),
    "tune": frozenset({"model", "collect", "launch", "agent"}),
    "cluster": frozenset({"model", "analysis"}),  # other nodes' exporters over HTTP; never the UI
    "ui": frozenset({"model", "analysis", "flow", "export", "tune", "cluster"}),  # never a /proc read
    "cli": frozenset(PACKAGES) - {"cli"},
}


def dlmon_imports(path: Path) -> set[str]:
    """The dlmon packages ``path`` imports anywhere in its body (absolute imports; dlmon uses no
    relative ones). ``from dlmon import __version__`` (the top package holds only that) is not one."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names = [node.module or ""]
        found |= {name.split(".")[1] for name in names if name.startswith("dlmon.")}
    return found


def layer_of(path: Path, package: Path) -> str | None:
    parts = path.relative_to(package).with_suffix("").parts
    return parts[0] if parts[0] in PACKAGES else None


def contract_breaches(package: Path) -> list[str]:
    breaches = []
    for path in sorted(package.rglob("*.py")):
        layer = layer_of(path, package)
        if layer is None:
            continue
        for target in sorted(dlmon_imports(path) - {layer}):
            if target not in MAY_IMPORT[layer]:
                breaches.append(f"{path.relative_to(package.parent)} ({layer}) imports dlmon.{target}")
    return breaches


def test_each_layer_imports_only_the_layers_below_it() -> None:
    package = ROOT / "dlmon"
    assert {layer_of(p, package) for p in package.rglob("*.py")} >= set(PACKAGES)  # every layer was read
    assert contract_breaches(ROOT / "dlmon") == []


def test_the_contract_check_sees_a_breach(tmp_path: Path) -> None:
    """A collector importing the analysis (the commonest slip) is caught, lazily imported or not."""
    fake = tmp_path / "dlmon" / "collect"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text("def f():\n    from dlmon.analysis.kinds import STALL\n    return STALL\n")
    assert contract_breaches(tmp_path / "dlmon") == ["dlmon/collect/x.py (collect) imports dlmon.analysis"]


def proc_paths(package: Path) -> list[str]:
    """Every string (f-strings too) in ``package``'s code that starts with a /proc or /sys path."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            string = node.value if isinstance(node, ast.Constant) else None
            if isinstance(string, str) and string.startswith(("/proc", "/sys/")):
                found.append(f"{path.relative_to(package.parent.parent)}: {string}")
    return found


def test_the_dashboard_reads_no_proc_file_of_its_own() -> None:
    """dlmon/ui gets everything it shows from snapshots or from the CLI (the boot time of a live
    source): the import contract above cannot see an open() of a /proc path, this can."""
    assert proc_paths(ROOT / "dlmon" / "ui") == []
    assert proc_paths(ROOT / "dlmon" / "collect")  # the check is not vacuous


def test_the_cli_hands_a_live_dashboard_the_boot_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from dlmon import cli, ui
    from dlmon.collect.procfs import read_boot_time

    seen: list[dict[str, object]] = []
    monkeypatch.setattr(ui, "run_dashboard", lambda source, **kw: seen.append(kw))

    class Live:
        live = True

    class Replay:
        live = False

    cli.dashboard(Live(), rank=None)  # type: ignore[arg-type]
    cli.dashboard(Replay())  # type: ignore[arg-type]
    assert seen == [{"rank": None, "boot_time": read_boot_time()}, {}]
