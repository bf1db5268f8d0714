"""The agent loaded into a running job (gdb, mid-epoch, stacks read from outside)."""
