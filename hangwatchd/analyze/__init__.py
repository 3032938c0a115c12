"""Per-process and cross-rank verdicts from what was captured."""
