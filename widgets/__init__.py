"""Jupyter views over a spectool Trace (live or loaded from disk)."""
