"""What the engine hands back: per-request outputs and per-step records.

``StepOutput`` keeps its measured millisecond breakdown as attributes; ``to_row()`` is its
one-row view in the shared record schema (``paged.telemetry.STEP_COLUMNS``, seconds), the
same columns the simulator's steps have.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from paged import telemetry
from paged.core import events as ev
from paged.core.plan import PoolCounts, StepCounts


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str = ""
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None  # SamplingParams.logprobs: one dict per token


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    finish_time: float = 0.0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # SamplingParams.prompt_logprobs


@dataclass
class ChunkInfo:
    """What one scheduled chunk did in a step."""
    request_id: str
    start: int
    num_tokens: int
    is_prefill: bool
    samples: bool


@dataclass
class StepOutput(StepCounts, PoolCounts):
    """Everything that happened in one ``step()``; ``*_ms`` times in milliseconds.

    ``schedule_ms`` + ``cache_ops_ms`` + ``forward_ms`` + ``sample_ms`` ~= ``total_ms``, where
    ``sample_ms`` covers sampling and the bookkeeping after it (scheduler update, forks,
    finishing requests).

    ``prefill_ms``/``decode_ms`` are measured forward times of the step's prefill and decode
    work: for a pure step one of them is the whole forward pass and the other 0; a mixed step
    runs one pass and reports both as None, unless ``split_prefill_decode`` ran two passes
    (a decode chunk that reads a block written by a prefill chunk of the same step runs, and
    is timed, in the prefill pass).
    ``new_tokens`` maps scheduler sequence ids (``"<id>"``, ``"<id>#k"`` for sample k of n>1,
    ``"<id>#b<j>"`` for beams) to the token sampled for them this step.
    ``time_s`` is the step's start in seconds since the engine was built; queue lengths, usage
    and pool counts (``PoolCounts``) are the plan's, read right after it was made.
    """
    step: int
    scheduled: list[ChunkInfo]
    num_prefill_tokens: int
    num_decode_tokens: int
    new_tokens: dict[str, int]
    finished: list[RequestOutput]
    preempted: list[tuple[str, str]]
    num_block_copies: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    schedule_ms: float
    cache_ops_ms: float
    forward_ms: float
    prefill_ms: float | None
    decode_ms: float | None
    sample_ms: float
    total_ms: float
    time_s: float = 0.0
    events: list[ev.Event] = field(default_factory=list)
    num_compaction_copies: int = 0     # block compaction: copies applied before the step's other cache ops
    num_tier_out_blocks: int = 0       # host tier: blocks copied device -> host / host -> device
    num_tier_in_blocks: int = 0
    num_host_evicted_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    num_batched_tokens = num_tokens

    @property
    def step_time_s(self) -> float:
        return self.total_ms * 1e-3

    @property
    def num_finished(self) -> int:
        return len(self.finished)

    def to_row(self) -> dict:
        """This step as one record: exactly ``paged.telemetry.STEP_COLUMNS``."""
        return telemetry.step_row(self)
