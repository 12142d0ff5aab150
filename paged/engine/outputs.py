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
    """Everything that happened in one ``step()``: the record's fields, then (``*_ms`` in
    milliseconds) ``schedule_ms`` + ``cache_ops_ms`` + ``forward_ms`` + ``sample_ms`` =
    ``total_ms``, where ``sample_ms`` is the rest of the step (sampling and the bookkeeping after
    it: scheduler update, forks, finishing requests); ``total_ms`` is ``step_time_s`` in ms.

    ``prefill_ms``/``decode_ms`` are measured forward times of the step's prefill and decode
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
    schedule_ms: float
    cache_ops_ms: float
    forward_ms: float
    prefill_ms: float | None
    decode_ms: float | None
    sample_ms: float
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

    @property
    def total_ms(self) -> float:
        return self.step_time_s * 1e3
