"""The fleet: endpoints registered in etcd, and the tools that see and check them.

Owns the registry record and key layout (``record``), the etcd access (``store``), an endpoint's
registration (``registrar``), the watch of a cluster (``watch``). The registry is never on the data
path: nothing here is called by a writer or receiver thread. ``import kvpush.cli`` loads none of it
(the etcd client is imported when a fleet-aware command runs).
"""
