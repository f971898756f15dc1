"""Every byte that crosses a process boundary: kvpush's versioned envelope and bounded
decoders (``protocol``), vLLM 0.33's forms (``vllm``), HMAC and the replay window
(``auth``), and the sealing of NIXL notifications (``notifs``). No sockets: the transports
carry what this encodes."""
