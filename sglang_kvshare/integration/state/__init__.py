"""State the scheduler process keeps: the session, per-request and per-forward state."""
