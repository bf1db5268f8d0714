"""Helpers for the analysis tests: synthetic snapshots and scripts for real scenarios."""
