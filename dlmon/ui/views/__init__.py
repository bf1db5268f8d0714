"""What each panel says, as styled lines: pure functions of the dashboard state (no UI imports).

A line is a tuple of ``(text, style)`` spans; the style names map to component classes of the
widgets (``dlmon.tcss``), so colour lives in the stylesheet and every meaning is also in the
words (NO_COLOR shows the same information). Panels compare the lines they get with the ones
they show and repaint only when they differ. One module per panel; the workers table's columns
are defined in ``dlmon/ui/columns.py``.
"""

from __future__ import annotations

from dlmon.ui.columns import COLUMNS, Column, pss_stale, row_state
from dlmon.ui.text import text_of  # the tests read panels with it
from dlmon.ui.views.alerts import alert_lines, analysis_failed_lines, sorted_alerts
from dlmon.ui.views.common import STYLES, label
from dlmon.ui.views.detail import detail_lines, stack_lines
from dlmon.ui.views.gpu import gpu_lines
from dlmon.ui.views.header import HeaderInfo, header_line
from dlmon.ui.views.io import io_lines
from dlmon.ui.views.memory import (
    LIMIT_IN_REACH,
    MemoryChartPlan,
    memory_chart_plan,
    memory_lines,
    memory_trend,
)
from dlmon.ui.views.throughput import AGENT_HINT, AGENT_HINT_SHORT, throughput_lines
from dlmon.ui.views.workers import (
    rank_line,
    sort_caption,
    stall_of,
    stuck_line,
    table_cells,
    table_columns,
    table_header,
)

__all__ = [
    "AGENT_HINT",
    "AGENT_HINT_SHORT",
    "COLUMNS",
    "LIMIT_IN_REACH",
    "STYLES",
    "Column",
    "HeaderInfo",
    "MemoryChartPlan",
    "alert_lines",
    "analysis_failed_lines",
    "detail_lines",
    "gpu_lines",
    "header_line",
    "io_lines",
    "label",
    "memory_chart_plan",
    "memory_lines",
    "memory_trend",
    "pss_stale",
    "rank_line",
    "row_state",
    "sort_caption",
    "sorted_alerts",
    "stack_lines",
    "stall_of",
    "stuck_line",
    "table_cells",
    "table_columns",
    "table_header",
    "text_of",
    "throughput_lines",
]
