"""The threads and hand-offs both data paths run on: the ``OwnerThread`` and its bounded
inboxes, what an endpoint hands its role (``context``), declines sent over the side channel,
timers, the freeze watchdog, and ``StopFlag`` (the one lock-free signal handler)."""
