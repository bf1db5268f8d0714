"""dlmon: a live terminal dashboard for PyTorch training jobs."""

__version__ = "0.1.0"
