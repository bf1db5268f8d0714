"""Collectors and sources on real process trees, a real cgroup, the stand-in libnvidia-ml."""
