"""The Mooncake-format reader (``kvpush.commands.workload.trace``): each bad line is one problem
naming its line number and the rest is read on; a file with nothing to replay is refused up
front; the line decoder never raises, whatever the text (hypothesis)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.commands.workload.trace import (
    MAX_NUMBER,
    Problem,
    TraceRequest,
    decode_line,
    load,
    read,
)
from kvpush.errors import ConfigError


def line(ts: object = 0, n_in: object = 100, n_out: object = 10, **extra: object) -> str:
    obj = {"timestamp": ts, "input_length": n_in, "output_length": n_out, **extra}
    return json.dumps(obj)


def test_a_valid_line_is_a_request() -> None:
    got = decode_line(line(1500, 6909, 350, hash_ids=[0, 1, 2]), 7)
    assert got == TraceRequest(7, 1500.0, 6909, 350, (0, 1, 2))


def test_hash_ids_are_optional_and_unknown_keys_ignored() -> None:
    got = decode_line('{"timestamp": 0, "input_length": 5, "output_length": 0, "x": 1}', 1)
    assert got == TraceRequest(1, 0.0, 5, 0, ())


def test_a_blank_line_is_nothing() -> None:
    assert decode_line("   \n", 3) is None


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("not json at all", "line 4: not JSON (Expecting value): skipped"),
        ("[1, 2]", "line 4: not a JSON object (list): skipped"),
        ('{"input_length": 5, "output_length": 1}', "line 4: no timestamp: skipped"),
        ('{"timestamp": 0, "output_length": 1}', "line 4: no input_length: skipped"),
        ('{"timestamp": 0, "input_length": 5}', "line 4: no output_length: skipped"),
        (line(-5), "line 4: timestamp -5 is negative: skipped"),
        (line(0, -1), "line 4: input_length -1 is negative: skipped"),
        (line(0, 0), "line 4: input_length 0 is below 1: skipped"),
        (line(0, 5, -2), "line 4: output_length -2 is negative: skipped"),
        (line(0, 5.5), "line 4: input_length 5.5 is not a whole number of tokens: skipped"),
        (line("10"), "line 4: timestamp is not a number ('10'): skipped"),
        (line(0, True), "line 4: input_length is not a number (true): skipped"),
        (line(0, MAX_NUMBER + 1), f"line 4: input_length {MAX_NUMBER + 1} is too large: skipped"),
        (line(0, 5, 1, hash_ids=[1, -1]), "line 4: hash_ids holds something other than "
         "non-negative integers: skipped"),
        (line(0, 5, 1, hash_ids="ab"), "line 4: hash_ids is not a list ('ab'): skipped"),
        ('{"timestamp": NaN, "input_length": 5, "output_length": 1}',
         "line 4: timestamp is nan: skipped"),
    ],
)  # fmt: skip
def test_a_bad_line_is_one_problem_naming_its_line(text: str, said: str) -> None:
    got = decode_line(text, 4)
    assert isinstance(got, Problem)
    assert str(got) == said


def test_out_of_order_is_against_the_previous_valid_request() -> None:
    lines = [line(100), "garbage", line(50), line(100), line(99.5), line(200)]
    got = list(read(lines))
    assert [type(g).__name__ for g in got] == [
        "TraceRequest", "Problem", "Problem", "TraceRequest", "Problem", "TraceRequest",
    ]  # fmt: skip
    assert str(got[2]) == (
        "line 3: timestamp 50 ms is before the previous request's 100 ms (out of order): skipped"
    )
    assert [g.line for g in got] == [1, 2, 3, 4, 5, 6]


def test_load_names_each_bad_line_and_keeps_the_rest(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join([line(0), "{", line(10, -3), line(20), "", line(5), line(30)]) + "\n")
    said: list[str] = []
    wl = load(str(f), on_problem=lambda p: said.append(str(p)))
    assert [r.line for r in wl.requests] == [1, 4, 7]
    assert said == [str(p) for p in wl.problems]
    assert [p.line for p in wl.problems] == [2, 3, 6]


def test_start_at_and_limit(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text("".join(line(ts) + "\n" for ts in range(0, 10_000, 1000)))
    wl = load(str(f), start_at_s=3.5, limit=4)
    assert [r.timestamp_ms for r in wl.requests] == [4000, 5000, 6000, 7000]
    assert wl.before_start == 4 and wl.start_at_s == 3.5
    with pytest.raises(ConfigError, match=r"no request at or after --start-at 20 s \(10 before"):
        load(str(f), start_at_s=20)


def test_refused_up_front_when_nothing_can_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the workload") as e:
        load(str(tmp_path / "missing.jsonl"))
    assert "kvpush workload synth" in (e.value.hint or "")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n" + line(-1) + "\n")
    with pytest.raises(
        ConfigError, match=r"holds no valid request \(2 bad lines: line 1: not JSON"
    ):
        load(str(bad))
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x01\n")
    with pytest.raises(ConfigError, match="holds no valid request"):
        load(str(binary))


def test_a_request_round_trips_through_its_line() -> None:
    r = TraceRequest(1, 2500.0, 8000, 300, (4, 5))
    assert decode_line(r.to_json(), 1) == r
    assert json.loads(r.to_json())["timestamp"] == 2500  # whole ms stay integers


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.none() | st.floats(allow_nan=False, min_value=0, max_value=1e9))
def test_the_decoder_never_raises_on_any_text(text: str, last: float | None) -> None:
    got = decode_line(text, 9, last)
    assert got is None or isinstance(got, TraceRequest | Problem)
    if isinstance(got, Problem):
        assert got.line == 9 and str(got).startswith("line 9: ") and "\n" not in got.what
    if isinstance(got, TraceRequest):
        assert got.input_length >= 1 and got.output_length >= 0 and got.timestamp_ms >= 0


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=4,
)


@settings(max_examples=100, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "timestamp": JSONISH,
            "input_length": JSONISH,
            "output_length": JSONISH,
            "hash_ids": JSONISH,
        },
    )
)
def test_any_json_object_is_a_valid_request_or_one_problem(obj: dict[str, object]) -> None:
    got = decode_line(json.dumps(obj), 2)
    assert isinstance(got, TraceRequest | Problem)
    if isinstance(got, TraceRequest):
        assert got.input_length == obj["input_length"]
        assert got.timestamp_ms == obj["timestamp"]
