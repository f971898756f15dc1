"""``kvpush demo``: a local cluster started, driven and torn down, and its view."""
