"""The dashboard's state, text and columns, without a terminal."""
