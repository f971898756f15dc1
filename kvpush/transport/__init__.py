"""The process's ways out: NIXL (the ``agent`` protocol and its ``nixl`` adapter) and the ZMQ side
channel (``sidechannel`` server, ``client``). The only package that imports ``nixl`` and ``zmq``."""
