"""Verdicts on real jobs sampled by the real Sampler: caught, and quiet when healthy."""
