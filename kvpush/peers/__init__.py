"""What P and D know of each other: a peer's connection and state, the checks of what it
announces, the notif-only and full handshakes (one short thread each), the TP mapping of ranks,
and the wire ``dialect`` (kvpush's or vLLM 0.33's) the engine asks instead of testing which
wire it speaks."""
