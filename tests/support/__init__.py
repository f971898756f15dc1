"""What the test folders share, one concern a module; no test lives here.

Processes: ``procs`` (the one launcher of endpoint processes), ``ports``, ``zygote`` and
``pcycle`` (many endpoints cheaply, for the freeze stress), ``term`` (a pseudo-terminal read by
pyte), ``etcd`` / ``etcd_tls`` (a real etcd server), ``nixl_etcd_probe``. Requests: ``legs`` (both
legs, for the integration suites), ``side`` (side-channel requests and telemetry reads),
``fault_legs`` (both legs with short timeouts and a ``Result``). The fault suites: ``cluster``
(their endpoints), ``invariants``, ``procstats``, ``forger``, ``junk``, ``silent_peers``,
``hostile`` (well-formed floods), ``netns`` and ``relay`` (a slow or cut link between network
namespaces), ``waits``, ``marks``. The one faked seam, the NIXL agent, and real-socket peer
stubs: ``fakes``.
"""
