"""The fleet: endpoints registered in etcd, and the tools that see and check them.

Owns the registry records and key layout v2 (``record``: membership and load apart), the etcd
access (``config``'s ``Access``, ``etcd``: kvpush's own client of etcd's JSON gateway, one per
process), the reading of a cluster into typed events (``store``, the one classification), an
endpoint's registration (``registrar``), its watch of the membership and the hints it checks
(``member``, ``suspects``) and ``--prewarm`` (``prewarm``). The registry is never on the data
path: nothing here is called by a writer or receiver thread. ``import kvpush.cli`` loads none of
it (the etcd client is imported when a fleet-aware command runs).
"""
