"""The code base's own rules: layers, lint and types, the export layer's imports."""
