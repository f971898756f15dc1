"""What an endpoint says about itself: one vocabulary of counters, gauges and failure kinds
(``names``), the store workers bump, the frozen snapshot, the Prometheus exporter with
``/healthz`` and ``/readyz``, and a request's phases."""
