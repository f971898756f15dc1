"""``fleet check`` with no pair to check: the note says why, in the words of its source."""

from __future__ import annotations

from kvpush.commands.fleet.check import CheckConfig, check_fleet


def test_a_registry_with_no_prefill_says_none_is_registered() -> None:
    rep = check_fleet("prod", [], CheckConfig())
    assert rep.pairs == []
    assert rep.notes == ["no prefill endpoint registered: no pair to check"]


def test_a_list_with_no_prefill_seen_says_so_not_registered() -> None:
    rep = check_fleet("listed", [], CheckConfig())
    assert rep.notes == ["no prefill endpoint listed and seen: no pair to check"]
