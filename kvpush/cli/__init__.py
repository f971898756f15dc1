"""The command-line layer of kvpush (typer, rich, exit statuses).

It depends on the core (``kvpush.*``), never the reverse, and stays cheap to import: typer
re-runs the program on every Tab press, so torch, nixl and zmq are only imported inside
command bodies.
"""
