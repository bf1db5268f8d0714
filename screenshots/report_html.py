"""Regenerate ``report-html-leak.png``: `dlmon report --html` of a real leaking run, rendered by
headless Chromium.

Records ``tests/scenarios/loader_job.py`` (a real DataLoader with 2 workers whose trainer keeps
4 MiB/s) under ``dlmon run --headless --record`` for 75 s, so the memory_growth verdict is raised,
then renders the report and screenshots it. Run from the repository root::

    python screenshots/report_html.py                       # ~90 s
    python screenshots/report_html.py --recording run.jsonl # an existing recording instead
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOB = [str(ROOT / "tests" / "scenarios" / "loader_job.py"), "--store", "tensor", "--items", "20000"]
JOB += ["--workers", "2", "--rate", "40", "--leak-main", str(4 << 20)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recording", help="report this recording instead of making one")
    p.add_argument("--seconds", type=float, default=75.0)
    args = p.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("needs chromium (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        recording = str(Path(args.recording).resolve()) if args.recording else "leak.jsonl"  # in tmp
        if args.recording is None:
            dlmon = [sys.executable, "-m", "dlmon", "run", "--headless", "--record", recording]
            subprocess.run([*dlmon, *JOB, "--seconds", str(args.seconds)], check=True, cwd=tmp)
        html = Path(tmp) / "report.html"
        report = [sys.executable, "-m", "dlmon", "report", recording, "--html", str(html), "--no-charts"]
        subprocess.run(report, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
        out = HERE / "report-html-leak.png"
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--screenshot={out}", "--window-size=880,2500", html.as_uri()],
            check=True, capture_output=True,
        )  # fmt: skip
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
