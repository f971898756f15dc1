"""The one seam between the operator tools and the endpoint core: ``open_endpoint``.

Every tool that runs an endpoint in its own process (``kvpush serve-*``, ``probe --handshake``,
``kvpush.ops.node``, the bench load generator) gets it from here, so that a change in how the
core builds endpoints is a change of one line. Today the core is ``create_endpoint(cfg)`` then
``start()``; the composition change makes it ``kvpush.endpoint.open_endpoint(cfg)`` returning a
started endpoint with the same ``address``, ``incarnation``, ``cfg``, ``snapshot()``,
``failure()``, ``stop()``, ``handshake_to()`` and ``ping()``.

Runs on the caller's thread; the endpoint owns its own threads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpush.config import EndpointConfig

if TYPE_CHECKING:
    from kvpush.endpoint.core import Endpoint


def open_endpoint(cfg: EndpointConfig) -> Endpoint:
    """A started endpoint for ``cfg`` (raises the core's typed errors; nothing is left running)."""
    from kvpush.endpoint.core import create_endpoint

    ep = create_endpoint(cfg)
    ep.start()
    return ep
