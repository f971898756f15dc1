"""``kvpush workload``: request traces in the Mooncake format -- read them, make synthetic ones."""
