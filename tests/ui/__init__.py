"""The Textual dashboard: Pilot-driven app tests, SVG snapshots (__snapshots__/), a real tmux terminal."""
