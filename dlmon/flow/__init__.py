"""How snapshots flow: sources (live, run, replay), the sampling loop, and record files. No UI imports."""
