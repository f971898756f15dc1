"""The size limits and constrained field types every kvpush message is declared with.

Owns the frame and notification size limits (checked before anything is decoded) and the
``Annotated`` types (bounded strings, ports, block ids and lists of them) that make msgspec
reject an oversized or out-of-range field while decoding, so nothing from the network reaches
the engine unchecked. Declarations only: no I/O, no threads (imported by the message modules,
``kvpush.wire.protocol`` and ``kvpush.wire.vllm``).
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

MAX_FRAME_BYTES = 4 * 1024 * 1024
MAX_NOTIF_BYTES = 64 * 1024
MAX_AGENT_METADATA_BYTES = 2 * 1024 * 1024

Str128 = Annotated[str, Meta(max_length=128)]
Str256 = Annotated[str, Meta(max_length=256)]
Str1k = Annotated[str, Meta(max_length=1024)]
Port = Annotated[int, Meta(ge=0, le=65535)]
NonNeg = Annotated[int, Meta(ge=0)]
Pos = Annotated[int, Meta(ge=1)]
SmallPos = Annotated[int, Meta(ge=1, le=1 << 16)]
BlockId = Annotated[int, Meta(ge=0, lt=1 << 31)]
BlockList = Annotated[list[BlockId], Meta(max_length=1 << 16)]
Groups = Annotated[list[BlockList], Meta(max_length=64)]
Addr = Annotated[int, Meta(ge=0)]
# Times from the wire, range-checked while decoding: inf, nan, a negative or a huge value is
# refused at once (``bad_value``) and never reaches a timer.
Seconds = Annotated[float, Meta(ge=0, le=3600)]  # a wait or a delay: at most an hour
DeadlineSeconds = Annotated[float, Meta(ge=0, le=86400)]  # a request's deadline: at most a day
Clock = Annotated[float, Meta(ge=0, le=1e12)]  # a timestamp someone else's clock gave
