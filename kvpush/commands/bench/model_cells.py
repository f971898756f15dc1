"""The shapes of scenario ``model``'s measurements: built by ``kvpush.commands.bench.model``
(one TypedDict per step: a kvpush pass, a cell's rounds, the cell), read by
``kvpush.commands.bench.model_report``. Types only; no thread runs here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict, final

if TYPE_CHECKING:
    from kvpush.commands.bench.modelgen import ChurnInfo, FragInfo


class AllocCost(TypedDict):
    """The cost of one allocator at one pool size (``model._alloc_costs``)."""

    series: str
    allocator: str
    num_blocks: int
    allocate_ns: float
    release_ns: float
    max_free_runs: float
    rounds: list[dict[str, float]]


@final
class FreshPool(TypedDict):
    """A pool that did not churn (``model._setup``)."""

    fragmentation: FragInfo


class KvPass(TypedDict):
    """One timed kvpush pass (``model._kvpush``) and the (P ids, D ids) its requests got."""

    gbps: float
    per_s: float
    failed: int
    writer_cpu_per_req_s: float
    p_cpu_per_req_s: float
    d_cpu_per_req_s: float
    descs_mean: float
    descs_max: int
    run_len_p: float
    run_len_d: float
    pairs: list[list[list[int]]]


class Rounds(TypedDict):
    """What one (size, pattern) cell's rounds measured, method by method (``model._size``)."""

    kv: list[KvPass]
    raw_on: list[float]
    raw_off: list[float]
    pvw: list[float]
    raw_cpu: list[float]


class RunLens(TypedDict):
    run_len_p: float
    run_len_d: float


class CellBase(TypedDict):
    """One (size, pattern) cell from its rounds (``model._cell``)."""

    shape: str
    tokens: int
    pattern: str
    blocks: int
    regions: int
    request_bytes: int
    inflight: int
    requests: int
    descs_unmerged: int
    descs_per_write: float
    descs_max: int
    kvpush_gbps: list[float]
    kvpush_per_s: list[float]
    kvpush_failed: int
    writer_cpu_per_req_s: list[float]
    p_cpu_per_req_s: list[float]
    d_cpu_per_req_s: list[float]
    raw_gbps: list[float]
    raw_nomerge_gbps: list[float]
    raw_cpu_per_req_s: list[float]
    pvw_gbps: list[float]


class Cell(CellBase, RunLens):
    """One (size, pattern) cell as ``model_report`` reads it: its rounds, its verified pass
    and its pools (``"p"``, ``"d"``) as the pattern left them."""

    verified: int
    verify_requests: int
    pool: dict[str, ChurnInfo | FreshPool]


class Medians(TypedDict):
    """A cell's medians over its rounds (``model_report.report``)."""

    kvpush_median_gbps: float
    kvpush_median_per_s: float
    raw_median_gbps: float
    raw_nomerge_median_gbps: float
    pvw_median_gbps: float
    kvpush_over_raw: float
    writer_ms_per_req: float
    p_ms_per_req: float
    d_ms_per_req: float
    raw_ms_per_req: float


class CellFigures(Cell, Medians):
    """A cell and its medians, as the report's tables, targets and chart read them."""
