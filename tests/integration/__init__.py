"""Integration tests: real processes, real DataLoaders, frameworks, gdb, Prometheus, a cluster."""
