"""The jobs the tests and benchmarks run as real processes (a DataLoader trainer, one whose worker
dies); the synthetic snapshots are in support/snapshots.py."""
