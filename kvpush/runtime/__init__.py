"""The threads and hand-offs both data paths run on: the ``OwnerThread`` and its bounded
inboxes, what an endpoint hands its role (``context``), declines sent over the side channel,
timers and the deadline heap, the freeze watchdog, ``StopFlag`` (the one lock-free signal
handler) and the start-up heap freeze of a serving process."""
