"""P's data path: a finished transfer matched with D's ``PUSH_REG``, handshaken if new, written
into D's blocks with NIXL WRITEs and a completion notification -- the owner loop (``writer``)
and what it hands work to (``legs``, ``outcomes``, ``fences``, ``acks``), its pure typed
``table``, and the group that reserves on every TP rank at once."""
