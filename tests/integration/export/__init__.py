"""Prometheus, records, report and diff on real recordings."""
