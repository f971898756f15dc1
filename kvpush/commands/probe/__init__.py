"""``kvpush probe``: the command, the probes of a kvpush endpoint and of a vLLM peer, the
probe report and its view."""
