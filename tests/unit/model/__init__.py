"""dlmon.model and the formats it defines: records, the wire protocol, parsers under fuzzing."""
