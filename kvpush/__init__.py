"""kvpush: push KV-cache blocks from a prefill engine (P) to a decode engine (D) over NIXL.

Importing the package is cheap: it pulls in no torch, nixl or zmq. Heavy modules are imported by
the endpoint, adapter and side-channel modules themselves.
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1

__all__ = ["PROTOCOL_VERSION", "__version__"]
