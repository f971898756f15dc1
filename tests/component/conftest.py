"""Fixtures shared by component test modules."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.component.test_receiver import Rig, _make_rig, close_rig


@pytest.fixture
def make_d_rig() -> Iterator[Callable[..., Rig]]:
    """D rigs (``tests.component.test_receiver``'s) with coalescing on or off
    (``make_d_rig(coalesce=False)``), each closed at the end of the test."""
    rigs: list[Rig] = []

    def make(coalesce: bool = True) -> Rig:
        r = _make_rig(coalesce=coalesce)
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        close_rig(r)
