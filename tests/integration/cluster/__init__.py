"""dlmon cluster and ranks: real torchrun jobs, real exporters, a real Prometheus."""
