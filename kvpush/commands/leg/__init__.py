"""``kvpush leg``: one vLLM leg (prefill or decode) driven against a kvpush endpoint, and its
view."""
