"""The bundled synthetic training behind ``dlmon demo`` (needs the ``demo`` extra: torch)."""
