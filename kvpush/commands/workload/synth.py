"""Synthetic request traces in the Mooncake format, shaped like its published conversation trace.

Owns ``SynthSpec`` (seed, duration, rate, burstiness, an optional request count), ``generate``
(the requests, in timestamp order; the same spec always gives the same trace), ``input_tokens``
and ``output_tokens`` (the length distributions) and ``TraceStats`` / ``stats`` (what a trace
holds: count, span, rate, length quantiles -- ``kvpush workload stats`` and the tests).

* **Arrivals**: gaps between requests are gamma-distributed with shape ``burstiness`` and mean
  ``1 / rate`` (as vLLM's and SGLang's benchmarks do): 1 is a Poisson process, below 1 burstier
  (clusters and lulls), above 1 more even. The first request is at 0 ms; timestamps are whole
  milliseconds.
* **Prompt lengths** fit the published conversation trace (kvcache-ai/Mooncake
  ``FAST25-release``: 12,031 requests over 3,537 s; input p50 6,909, p90 27,367, p99 85,399,
  max 126,195 tokens): log(tokens) is piecewise linear in the normal quantile z through the
  three published quantiles (a log-normal between each pair, sigma 1.07 below p90 and 1.09
  above -- the data are close to one log-normal), continued past them with the nearest piece's
  slope and capped at the published max.
* **Output lengths**: only the median (350) is published; a log-normal with that median and
  sigma ``OUTPUT_SIGMA`` (an assumption), capped at ``OUTPUT_MAX``.
* **Stratified draws**: n requests take their length quantiles one from each of n equal strata
  of (0, 1) (in a seeded random order), so that even a short trace has the requested quantiles
  to within one stratum: p50 and p90 within a few % from 200 requests, p99 from 1,000.
* ``hash_ids``: one fresh id per 512-token block, never shared -- no prefix reuse is modelled
  (the published trace reuses 36.6 % of its blocks; kvpush pushes whole prompts, so reuse does
  not change what it moves).

Pure functions; ``random.Random(seed)`` only (its algorithms are stable across Python versions).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

from kvpush.commands.common.stats import percentile
from kvpush.commands.workload.trace import HASH_BLOCK_TOKENS, TraceRequest
from kvpush.config import require_positive
from kvpush.errors import ConfigError

#: The published conversation trace's prompt quantiles (tokens) and maximum.
INPUT_QUANTILES: tuple[tuple[float, float], ...] = (
    (0.50, 6909.0),
    (0.90, 27367.0),
    (0.99, 85399.0),
)
INPUT_MAX = 126_195
#: Its output median; the spread is this tool's assumption (not published).
OUTPUT_P50 = 350.0
OUTPUT_SIGMA = 1.0
OUTPUT_MAX = 16_384
#: Its mean rate (12,031 requests over 3,537 s).
CONVERSATION_RATE = 3.4

_Z = NormalDist()


@dataclass(frozen=True)
class SynthSpec:
    seed: int = 0
    duration_s: float = 60.0
    rate: float = CONVERSATION_RATE
    burstiness: float = 1.0
    requests: int | None = None  # at most this many (the trace also ends at duration_s)

    def __post_init__(self) -> None:
        require_positive("--duration", self.duration_s)
        require_positive("--rate", self.rate)
        require_positive("--burstiness", self.burstiness, "1 is a Poisson process")
        if self.requests is not None and self.requests < 1:
            raise ConfigError(f"--requests must be 1 or more, got {self.requests}")


def _anchors() -> list[tuple[float, float]]:
    return [(_Z.inv_cdf(q), math.log(v)) for q, v in INPUT_QUANTILES]


def input_tokens(u: float) -> int:
    """The prompt length at quantile ``u`` (0 < u < 1) of the conversation-like distribution."""
    z = _Z.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
    pts = _anchors()
    # the piece z falls in (the first below the first anchor, the last above the last)
    k = 0 if z <= pts[0][0] else len(pts) - 2 if z >= pts[-1][0] else _piece(pts, z)
    (z0, y0), (z1, y1) = pts[k], pts[k + 1]
    y = y0 + (z - z0) * (y1 - y0) / (z1 - z0)
    return max(1, min(INPUT_MAX, round(math.exp(y))))


def _piece(pts: Sequence[tuple[float, float]], z: float) -> int:
    return next(k for k in range(len(pts) - 1) if pts[k][0] <= z <= pts[k + 1][0])


def output_tokens(u: float) -> int:
    """The output length at quantile ``u``: log-normal, median ``OUTPUT_P50``."""
    z = _Z.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
    return max(1, min(OUTPUT_MAX, round(OUTPUT_P50 * math.exp(OUTPUT_SIGMA * z))))


def _arrivals(spec: SynthSpec, rng: random.Random) -> list[int]:
    """Timestamps (ms) from 0 up to the duration (or the request count)."""
    out: list[int] = []
    t = 0.0
    shape, scale = spec.burstiness, 1.0 / (spec.rate * spec.burstiness)
    while t <= spec.duration_s and (spec.requests is None or len(out) < spec.requests):
        out.append(round(t * 1000.0))
        t += rng.gammavariate(shape, scale)
    return out


def _strata(n: int, rng: random.Random) -> list[float]:
    """One point from each of ``n`` equal strata of (0, 1), in a random order."""
    us = [(k + rng.random()) / n for k in range(n)]
    rng.shuffle(us)
    return us


def generate(spec: SynthSpec) -> list[TraceRequest]:
    """The trace ``spec`` asks for (line numbers 1..n, as written)."""
    rng = random.Random(spec.seed)
    stamps = _arrivals(spec, rng)
    ins = _strata(len(stamps), rng)
    outs = _strata(len(stamps), rng)
    reqs = []
    next_id = 0
    for k, (ts, u_in, u_out) in enumerate(zip(stamps, ins, outs, strict=True)):
        n_in = input_tokens(u_in)
        blocks = math.ceil(n_in / HASH_BLOCK_TOKENS)
        ids = tuple(range(next_id, next_id + blocks))
        next_id += blocks
        reqs.append(TraceRequest(k + 1, float(ts), n_in, output_tokens(u_out), ids))
    return reqs


@dataclass(frozen=True)
class TraceStats:
    requests: int
    span_s: float  # first to last timestamp
    rate: float  # requests per second over the span (0 for one request)
    input_tokens: dict[str, float]  # p50, p90, p99, max (nearest rank)
    output_tokens: dict[str, float]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)  # the fields, in order


def _quantiles(xs: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "max": max(xs, default=0.0),
    }


def stats(reqs: Sequence[TraceRequest]) -> TraceStats:
    span = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000.0 if reqs else 0.0
    return TraceStats(
        requests=len(reqs),
        span_s=span,
        rate=(len(reqs) - 1) / span if span > 0 else 0.0,
        input_tokens=_quantiles([r.input_length for r in reqs]),
        output_tokens=_quantiles([r.output_length for r in reqs]),
    )
