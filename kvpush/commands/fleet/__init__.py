"""``kvpush fleet``: ``ls``, ``watch`` and ``check`` over the registry, their logic and their
views."""
