"""What the commands do, without the CLI: run an endpoint, the demo's cluster, ``drive``'s load
and its results, ``probe``'s diagnoses of kvpush and vLLM peers, the fleet checks and watch,
and the one launcher of child processes (``launch``). Called by ``kvpush.cli``, which renders
what they return."""
