"""What is wrong with the job, from the snapshots alone: alerts with the numbers behind them.

Pure analysis: no I/O, no UI. ``Analyzer`` is the per-tick entry point (a
``dlmon.model.SnapshotStep``, what ``dlmon.flow.sources`` and the exporter take); the detectors are pure
functions over a history (``dlmon.analysis.detectors``); ``advise`` turns a short history into
sizing advice; ``events`` lists what changed between two ticks' alerts for headless output.
"""

from __future__ import annotations

from dlmon.analysis.advice import Advice, AdviceLine, PeakEstimate, advice_to_dict, advise, format_advice
from dlmon.analysis.analyzer import Analyzer, default_cores
from dlmon.analysis.detectors import DETECTORS, Candidate, Context, Thresholds, detect
from dlmon.analysis.detectors.registry import DEFAULT_HOLDS, SPECS, Hold, KindSpec
from dlmon.analysis.events import CLEARED, ESCALATED, RAISED, AlertEvent, events, format_event
from dlmon.analysis.kinds import CRITICAL, INFO, KINDS, SEVERITIES, WARNING

__all__ = [
    "CLEARED",
    "CRITICAL",
    "DEFAULT_HOLDS",
    "DETECTORS",
    "ESCALATED",
    "INFO",
    "KINDS",
    "RAISED",
    "SEVERITIES",
    "SPECS",
    "WARNING",
    "Advice",
    "AdviceLine",
    "AlertEvent",
    "Analyzer",
    "Candidate",
    "Context",
    "Hold",
    "KindSpec",
    "PeakEstimate",
    "Thresholds",
    "advice_to_dict",
    "advise",
    "default_cores",
    "detect",
    "events",
    "format_advice",
    "format_event",
]
