"""Request: the scheduler's unit of work. Progress is one number, `num_computed_tokens`.

Prefill, chunked prefill, prefix hits, decode and resumption after preemption are all
"compute the next n of `token_ids`". A request needs a sampled token exactly when its
computed tokens reach the end of its known tokens.
"""
from __future__ import annotations

import enum
from typing import Any, Iterable, Sequence

from paged.errors import InvalidRequestError


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")


class Request:
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "max_tokens", "stop_token_ids",
                 "arrival_time", "priority", "extra_keys", "num_computed_tokens", "status",
                 "num_preemptions", "num_cached_tokens", "data", "arrival_seq", "priority_rank")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int = 16, *,
                 stop_token_ids: Iterable[int] = (), arrival_time: float = 0.0, priority: int = 0,
                 cache_salt: str | None = None, data: Any = None) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if len(prompt_token_ids) == 0:
            raise InvalidRequestError(f"request {request_id!r} has an empty prompt; give at least one token")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequestError(f"request {request_id!r}: max_tokens must be an integer >= 1, got {max_tokens!r}")
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        if min(self.token_ids) < 0:
            raise InvalidRequestError(f"request {request_id!r}: token ids must be >= 0")
        self.num_prompt_tokens = len(self.token_ids)
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.arrival_time = arrival_time
        self.priority = priority  # lower value = served first (as in vLLM)
        self.extra_keys = (cache_salt,) if cache_salt is not None else ()
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 before
        self.data = data             # executor's payload (e.g. sampling state)
        self.arrival_seq = 0                 # arrival order, set by the scheduler
        self.priority_rank = float(priority)  # priority policy order (lower first), set by the scheduler

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold in the cache."""
        return self.num_prompt_tokens + self.max_tokens

    def append_token(self, token_id: int) -> RequestStatus | None:
        """Append a sampled token; return the finished status if it ends the request.
        (``Scheduler.update`` inlines these two rules on its hot path: change both together.)"""
        tokens = self.token_ids
        tokens.append(token_id)
        if token_id in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(tokens) - self.num_prompt_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
