"""dlmon tune on real training scripts."""
