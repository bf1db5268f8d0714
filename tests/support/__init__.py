"""What the tests share (not tests): snapshot factories, agent/export/NVML helpers, paths."""
