"""Pure renderers of the CLI: data in, rich renderables or strings out (no I/O, no clocks).

``live`` draws an endpoint's telemetry snapshot as a dashboard, ``lines`` as one plain or JSON
line, both reading it through ``readings``; ``reports`` draws probe, drive and demo
results. The commands own the consoles and print what these return.
"""
