"""The roofline executor: a plan's time from the cost model, a dummy token per sampling chunk.

Memory decisions stay the scheduler's and the KV manager's; only time is modelled. Every chunk
that samples gets ``DUMMY_TOKEN`` (never a stop token here), so a request ends at its trace output
length. A plan without work takes no time and is not executed (the simulator then moves its clock
to the next arrival).
"""
from __future__ import annotations

from collections import defaultdict

from paged.core.loop import Executed
from paged.core.plan import SchedulerOutput
from paged.sim.cost_model import CostModel
from paged.sim.shapes import plan_shape

__all__ = ["DUMMY_TOKEN", "RooflineExecutor"]

DUMMY_TOKEN = 17  # first non-control id of SmolLM2's vocabulary; never a stop token here


class RooflineExecutor:
    """``execute(plan)``: the cost model's duration of the plan's shape (new tokens and cached context
    per chunk, blocks over the host link at ``block_bytes`` each, blocks copied on the device)."""

    executes_empty_plans = False

    def __init__(self, cost: CostModel, block_bytes: float) -> None:
        self.cost = cost
        self.block_bytes = block_bytes
        # the token of every chunk that samples, whatever the request: one mapping for the whole run,
        # so a step builds nothing per request (the scheduler's update reads it once per sampling chunk)
        self.tokens: defaultdict[str, int] = defaultdict(_dummy)

    def execute(self, plan: SchedulerOutput) -> Executed:
        shape = plan_shape(plan.batch, plan.num_moved_blocks, plan.num_copied_blocks, self.block_bytes)
        return Executed(self.tokens, self.cost.step_time(shape))


def _dummy() -> int:
    return DUMMY_TOKEN
