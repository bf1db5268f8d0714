"""dlmon.analysis over synthetic histories (support.snapshots): every kind, the registry, the
incremental index."""
