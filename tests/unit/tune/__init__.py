"""dlmon tune's pure parts."""
