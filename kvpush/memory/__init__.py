"""The KV pool: the registered torch allocation, pure block ownership (``allocator``), block ->
NIXL descriptor arithmetic (``descriptors``), and the byte pattern every push is checked
against (``pattern``). No network."""
