"""Runnable examples (importable so tests can run their logic)."""
