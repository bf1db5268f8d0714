"""Alert severities, exactly as they appear in JSON (``Alert.severity``)."""

from __future__ import annotations

INFO = "info"
WARNING = "warning"
CRITICAL = "critical"
SEVERITIES: tuple[str, ...] = (INFO, WARNING, CRITICAL)
SEVERITY_RANK: dict[str, int] = {INFO: 0, WARNING: 1, CRITICAL: 2}
