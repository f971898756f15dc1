"""D's data path: one request's life on a decode rank -- allocated, registered with P
(``PUSH_REG``), completed or abandoned -- and the group that runs it on every TP rank at once.

The receiver is the owner loop (``kvpush.runtime.owner``); ``requests`` is its pure typed table,
``join`` the pure join of the ranks' shares, ``completer`` verifies off the owner thread."""
