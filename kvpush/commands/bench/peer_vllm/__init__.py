"""vLLM's side of ``kvpush bench peer``: vLLM 0.33's own ``NixlPushConnector``, P -> D.

``driver.py`` runs inside the vLLM virtualenv (run by path with that virtualenv's python; it
imports the standard library, torch and vllm only, and is never imported here); ``pair`` is the
orchestrator's side: it finds that python, starts a P and a D driver, drives their rounds and
always stops them. Importing this package is cheap.
"""

from __future__ import annotations

from pathlib import Path

DRIVER = Path(__file__).resolve().with_name("driver.py")
