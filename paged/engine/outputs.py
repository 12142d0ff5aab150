"""What the engine hands back: per-request outputs and per-step records.

``StepOutput`` is the step loop's ``StepRecord`` (the shared record schema, seconds, the same
fields the simulator's steps have; ``to_row()`` is it as a dict of exactly ``STEP_COLUMNS``) plus what only a real engine
has: the plan, the sampled tokens, the finished requests' outputs, the events and the measured
millisecond breakdown.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from paged.core import events as ev
from paged.core.plan import ScheduledChunk, SchedulerOutput
from paged.core.record import StepRecord


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
class StepOutput(StepRecord):
    """Everything that happened in one ``step()``: the record's fields, then (``*_s`` in
    seconds, like every time of the record) ``schedule_s`` + ``cache_ops_s`` + ``forward_s`` + ``sample_s`` =
    ``step_time_s``, where ``sample_s`` is the rest of the step (sampling and the bookkeeping after
    it: scheduler update, forks, finishing requests).

    ``prefill_s``/``decode_s`` are measured forward times of the step's prefill and decode
    work: for a pure step one of them is the whole forward pass and the other 0; a mixed step
    runs one pass and reports both as None, unless ``split_prefill_decode`` ran two passes
    (a decode chunk that reads a block written by a prefill chunk of the same step runs, and
    is timed, in the prefill pass).
    ``new_tokens`` maps scheduler sequence ids (``"<id>"``, ``"<id>#k"`` for sample k of n>1,
    ``"<id>#b<j>"`` for beams) to the token sampled for them this step; ``num_finished`` counts
    the user requests in ``finished``.
    """
    plan: SchedulerOutput
    new_tokens: dict[str, int]
    finished: list[RequestOutput]
    schedule_s: float
    cache_ops_s: float
    forward_s: float
    prefill_s: float | None
    decode_s: float | None
    sample_s: float
    events: list[ev.Event] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledChunk]:
        """The plan's chunks (views)."""
        return self.plan.scheduled

    @property
    def preempted(self) -> list[tuple[str, str]]:
        return self.plan.preempted

    @property
    def num_tokens(self) -> int:
        return self.num_batched_tokens
