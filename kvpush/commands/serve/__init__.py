"""``kvpush serve``: the command, its options (also read from the configuration file) and its
live view."""
