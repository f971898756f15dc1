"""``kvpush drive``: the command, the load driver and what it needs (health, readmission,
preflight, admission, the trace, the registry targets) and its view."""
