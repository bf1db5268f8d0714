"""Unit tests: no real training, one layer at a time (its pure code, its fixtures, this process)."""
