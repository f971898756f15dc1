"""The one seam between the operator tools and the endpoint core: ``open_endpoint``.

Every tool that runs an endpoint in its own process (``kvpush serve-*``, ``probe --handshake``,
``kvpush.ops.node``) gets it from here (the bench's load generator: through
``kvpush.endpoint.facade``), so that a change in how the
core builds endpoints is a change of one line. The endpoint comes back started (with
``address``, ``incarnation``, ``cfg``, ``role``, ``snapshot()``, ``failure()``, ``stop()``,
``handshake_to()`` and ``ping()``), or the core's typed error is raised with nothing left running.

Runs on the caller's thread; the endpoint owns its own threads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpush.config import EndpointConfig
from kvpush.instruments import NO_INSTRUMENTS, Instruments

if TYPE_CHECKING:
    from kvpush.endpoint.core import Endpoint


def open_endpoint(
    cfg: EndpointConfig, instruments: Instruments = NO_INSTRUMENTS
) -> Endpoint[Any, Any]:
    """A started endpoint for ``cfg`` (``instruments``: test hooks, never from a serve command)."""
    from kvpush import endpoint

    return endpoint.open_endpoint(cfg, instruments)
