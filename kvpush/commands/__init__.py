"""The operator's commands, one folder per command; what several share sits in ``common``.

Each command folder (``serve``, ``probe``, ``leg``, ``drive``, ``fleet``, ``demo``, ``bench``)
holds the command (``command.py``: its help text and options, and a body that imports its logic
on use, so that ``import kvpush.cli`` stays light), its logic and its view. The layers, top
down (``pyproject.toml``'s import contracts check them): ``bench`` -> ``demo`` | ``fleet`` ->
``drive`` -> ``probe`` | ``leg`` | ``serve`` -> ``common`` -> the engine (``kvpush.fleet``,
``kvpush.endpoint`` and below). The bench stands on the others' public faces and nothing but the
CLI shell (``kvpush.cli``) imports it. Nothing here runs at import time.
"""
