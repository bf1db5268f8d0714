"""dlmon.export over snapshots: the Prometheus exporter's series."""
