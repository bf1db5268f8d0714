"""Collectors over fixtures and this machine: disks, system, GPU (fake pynvml), per-process
figures, the PSS budget."""
