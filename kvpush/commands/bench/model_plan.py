"""The plan of scenario ``model`` (``kvpush.commands.bench.model``): its shapes, request sizes,
pools, budgets, rounds and churn, full or quick -- apart so that its report
(``kvpush.commands.bench.model_report``) reads the plan without importing the scenario.

Pure data; any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.commands.bench.churn import ChurnSpec
from kvpush.memory.shapes import SHAPES, Shape

FULL_TOKENS = (512, 2048, 8192)
QUICK_TOKENS = (512,)
#: Pool blocks per shape (P and D alike): 3.0, 2.5 and 2.7 GiB.
FULL_POOL_BLOCKS = {"llama-8b": 1536, "llama-70b-tp8": 4096, "mla": 640}
QUICK_POOL_BLOCKS = 1024
QUICK_LAYERS = 2
FULL_BUDGET = 512 << 20  # bytes per measurement (at least 2 x in flight requests)
QUICK_BUDGET = 16 << 20
FULL_ROUNDS = 5
FULL_CHURN = ChurnSpec(seed=1, steps=4000, occupancy=0.9, min_tokens=64, max_tokens=8192)
QUICK_CHURN = ChurnSpec(seed=1, steps=600, occupancy=0.9, min_tokens=64, max_tokens=2048)


@dataclass(frozen=True)
class Plan:
    quick: bool
    shapes: tuple[Shape, ...]
    tokens: tuple[int, ...]
    pool_blocks: dict[str, int]
    budget: int
    rounds: int
    churn: ChurnSpec

    @staticmethod
    def make(quick: bool) -> Plan:
        if quick:
            shapes = tuple(s.with_layers(QUICK_LAYERS) for s in SHAPES.values())
            return Plan(
                True,
                shapes,
                QUICK_TOKENS,
                {s.name: QUICK_POOL_BLOCKS for s in shapes},
                QUICK_BUDGET,
                1,
                QUICK_CHURN,
            )
        return Plan(
            False,
            tuple(SHAPES.values()),
            FULL_TOKENS,
            dict(FULL_POOL_BLOCKS),
            FULL_BUDGET,
            FULL_ROUNDS,
            FULL_CHURN,
        )
