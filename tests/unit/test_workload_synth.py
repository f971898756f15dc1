"""The synthetic trace generator (``kvpush.commands.workload.synth``, ``kvpush workload
synth``): the same seed gives the same trace; its prompt and output quantiles are within 10 % of
the published conversation trace's; arrivals follow --rate and --burstiness; what it writes is
read back by the trace reader line for line."""

from __future__ import annotations

import math
import statistics
import subprocess
from itertools import pairwise
from pathlib import Path

import pytest

from kvpush.commands.common.stats import percentile
from kvpush.commands.workload.synth import (
    INPUT_MAX,
    INPUT_QUANTILES,
    OUTPUT_P50,
    SynthSpec,
    generate,
    input_tokens,
    stats,
)
from kvpush.commands.workload.trace import HASH_BLOCK_TOKENS, load
from kvpush.errors import ConfigError
from tests.support.procs import KVPUSH, clean_env


def test_the_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    spec = SynthSpec(seed=42, duration_s=120, rate=5)
    a, b = generate(spec), generate(SynthSpec(seed=42, duration_s=120, rate=5))
    assert a == b and len(a) > 300
    assert generate(SynthSpec(seed=43, duration_s=120, rate=5)) != a


@pytest.mark.parametrize("n", [1000, 2000, 12031])
def test_prompt_quantiles_are_within_10_percent_of_the_published_ones(n: int) -> None:
    reqs = generate(SynthSpec(seed=n, duration_s=1e9, requests=n))
    assert len(reqs) == n
    ins = [r.input_length for r in reqs]
    for q, want in INPUT_QUANTILES:
        got = percentile(ins, q * 100)
        assert abs(got - want) <= 0.10 * want, (q, got, want)
    assert max(ins) <= INPUT_MAX and min(ins) >= 1
    out50 = percentile([r.output_length for r in reqs], 50)
    assert abs(out50 - OUTPUT_P50) <= 0.10 * OUTPUT_P50


def test_the_length_distribution_passes_through_the_published_quantiles() -> None:
    for q, want in INPUT_QUANTILES:
        assert abs(input_tokens(q) - want) <= 1
    assert input_tokens(0.9999) == INPUT_MAX  # capped at the published max
    assert [input_tokens(u / 100) for u in range(1, 100)] == sorted(
        input_tokens(u / 100) for u in range(1, 100)
    )


def test_a_short_trace_has_its_median_and_p90() -> None:
    """Stratified draws: 200 requests already have p50 and p90 within 10 %."""
    ins = [r.input_length for r in generate(SynthSpec(seed=3, duration_s=1e9, requests=200))]
    for q, want in INPUT_QUANTILES[:2]:
        assert abs(percentile(ins, q * 100) - want) <= 0.10 * want


def test_arrivals_follow_rate_duration_and_burstiness() -> None:
    reqs = generate(SynthSpec(seed=1, duration_s=2000, rate=4))
    ts = [r.timestamp_ms for r in reqs]
    assert ts[0] == 0 and all(b >= a for a, b in pairwise(ts)) and ts[-1] <= 2_000_000
    assert all(t == int(t) for t in ts)
    st = stats(reqs)
    assert abs(st.rate - 4) <= 0.4, st.rate

    def cv(burstiness: float) -> float:
        got = generate(SynthSpec(seed=1, duration_s=2000, rate=4, burstiness=burstiness))
        gaps = [b.timestamp_ms - a.timestamp_ms for a, b in pairwise(got)]
        return statistics.pstdev(gaps) / statistics.fmean(gaps)

    # gamma gaps of shape k have a coefficient of variation 1/sqrt(k): 1 is Poisson
    assert 0.9 < cv(1.0) < 1.1
    assert cv(0.25) > 1.6 and cv(4.0) < 0.6


def test_requests_caps_the_trace_and_hash_ids_cover_each_prompt() -> None:
    reqs = generate(SynthSpec(seed=5, duration_s=1e6, requests=50))
    assert len(reqs) == 50 and [r.line for r in reqs] == list(range(1, 51))
    ids = [i for r in reqs for i in r.hash_ids]
    assert len(ids) == len(set(ids))  # fresh ids: no prefix reuse is modelled
    for r in reqs:
        assert len(r.hash_ids) == math.ceil(r.input_length / HASH_BLOCK_TOKENS)


@pytest.mark.parametrize(
    ("kw", "said"),
    [
        ({"rate": 0}, "--rate must be positive"),
        ({"duration_s": -1}, "--duration must be positive"),
        ({"burstiness": 0}, "--burstiness must be positive"),
        ({"requests": 0}, "--requests must be 1 or more"),
    ],
)
def test_bad_specs_are_refused(kw: dict[str, float], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        SynthSpec(**kw)  # type: ignore[arg-type]


def test_the_command_writes_what_the_reader_reads(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    args = ["workload", "synth", "--seed", "9", "--rate", "6", "--duration", "30"]
    r = subprocess.run([*KVPUSH, *args, "--out", str(out)], capture_output=True, text=True,
                       env=clean_env(), timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("workload synth: ") and str(out) in r.stderr
    again = subprocess.run([*KVPUSH, *args], capture_output=True, text=True, env=clean_env(),
                           timeout=60)  # fmt: skip
    assert again.stdout == out.read_text()  # the same seed, the same bytes
    wl = load(str(out))
    assert not wl.problems
    assert list(wl.requests) == generate(SynthSpec(seed=9, duration_s=30, rate=6))
