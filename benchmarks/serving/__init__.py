"""Serving benchmark (``python -m benchmarks.serving``); the code is in ``cli`` for now."""

from benchmarks.serving.cli import *  # noqa: F401,F403
