"""Deaths and hangs: real trainings that die, their last words, the probe's stack dumps and kernel
log, and the causes not claimed (synthetic histories through the real Analyzer)."""
