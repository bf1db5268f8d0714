"""Getting a run out of dlmon: Prometheus metrics while it runs, reports and diffs of recordings after.

No UI imports here (plotext charts for the terminal report live in ``dlmon.ui.report_charts``).
"""
