"""KVCacheParts: what a paged KV manager is built from, and what can be read of it without a table.

From its settings (checked by ``CacheConfig``'s rules, the one place they are written) it builds the parts: the GPU pool (``BlockPool``: blocks,
ref counts, hash index), the per-request prefix-cache bookkeeping (``PrefixIndex``), the CPU pool
(``SwapSpace``) and, with ``enable_host_tier=True``, the host tier (``HostTier``: the CPU pool also keeps
cached-free prefix blocks an allocation would evict). It answers the questions a plan, telemetry
or a view asks about them (counts, usage, the host tier's planned copies) and runs the operations
that need no block table. ``KVCacheManager`` adds the tables and every change to them.
"""
from __future__ import annotations

from typing import Iterable

from . import events as ev
from .block import BlockMapping
from .block_pool import BlockPool
from .config import CacheConfig, SchedulerConfig  # the settings' rules, written once there
from .eviction import EvictionPolicy
from .host_tier import HostTier
from .prefix_cache import DEFAULT_HASH_FN, HashFn
from .prefix_index import PrefixIndex
from .request import Request
from .swap_space import SwapSpace
from paged.errors import InvalidRequestError

__all__ = ["KVCacheParts", "check_request_fits"]


def check_request_fits(request: Request, max_model_len: int, block_size: int, num_blocks: int) -> None:
    """Raise InvalidRequestError if `request` can never fit a cache of ``num_blocks`` blocks of
    ``block_size`` tokens with context ``max_model_len`` (every KV cache's admission rule)."""
    total = request.max_total_tokens
    if request.num_prompt_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt of {request.num_prompt_tokens} tokens exceeds max_model_len={max_model_len}; "
            "raise max_model_len or truncate the prompt")
    if total > max_model_len:
        raise InvalidRequestError(
            f"prompt ({request.num_prompt_tokens}) + max_tokens ({request.max_tokens}) = {total} exceeds "
            f"max_model_len={max_model_len}; lower max_tokens or raise max_model_len")
    need = -(-total // block_size)
    if need > num_blocks:
        raise InvalidRequestError(
            f"request needs up to {need} blocks of {block_size} tokens but the pool has only "
            f"{num_blocks}; give the cache more blocks or lower max_tokens")


class KVCacheParts:
    """The parts of a paged KV cache and its read-only counts (see module docstring)."""

    def __init__(self, num_blocks: int, block_size: int = 16, *, enable_prefix_caching: bool = True,
                 hash_fn: str | HashFn = DEFAULT_HASH_FN, eviction: str | EvictionPolicy = "lru",
                 num_cpu_blocks: int = 0, max_model_len: int | None = None,
                 recorder: ev.Recorder | None = None, enable_host_tier: bool = False,
                 host_eviction: str | EvictionPolicy = "lru", host_tier_threshold: float = 1.0) -> None:
        CacheConfig(block_size=block_size, num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=enable_prefix_caching,
                    enable_host_tier=enable_host_tier, host_tier_threshold=host_tier_threshold)
        SchedulerConfig(max_model_len=max_model_len)
        self.swap_space = SwapSpace(num_cpu_blocks)
        self.recorder = recorder if recorder is not None else ev.NullRecorder()
        self.host: HostTier | None = None  # with a host tier, the pool offers it each block it evicts
        if enable_host_tier:
            self.host = HostTier(self.swap_space.free, eviction=host_eviction, recorder=self.recorder)
        self.host_tier_threshold = host_tier_threshold
        self.pool = BlockPool(num_blocks, eviction=eviction, recorder=self.recorder,
                              on_evict=self.host.demote if self.host is not None else None)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len if max_model_len is not None else num_blocks * block_size
        self.prefix = PrefixIndex(self.pool, block_size, hash_fn, host=self.host)
        self.hasher = self.prefix.hasher

    # ---- checks on input ---------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """Raise InvalidRequestError if `request` can never be served by this cache."""
        check_request_fits(request, self.max_model_len, self.block_size, self.num_blocks)

    # ---- counts ------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.pool.cached_free)

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.swap_space.num_free

    @property
    def has_host_tier(self) -> bool:
        return self.host is not None

    @property
    def num_host_cached_blocks(self) -> int:
        """Prefix blocks held in the host tier (0 without one)."""
        return len(self.host) if self.host is not None else 0

    @property
    def kv_cache_usage_perc(self) -> float:
        """Share of blocks in use (vLLM's `kv_cache_usage_perc`, in [0, 1])."""
        return self.pool.num_used / self.num_blocks

    @property
    def token_usage(self) -> float:
        """Slots holding tokens / slots in used blocks; the gap is internal fragmentation."""
        used = self.pool.num_used
        return self.pool.num_filled_slots / (used * self.block_size) if used else 0.0

    def is_swapped(self, request_id: str) -> bool:
        return self.swap_space.holds(request_id)

    def swapped_request_ids(self) -> list[str]:
        """Requests swapped out to the CPU pool, in the order they left."""
        return self.swap_space.request_ids()

    def swapped_host_blocks(self, request_id: str) -> list[int]:
        """The CPU-pool block ids a swapped-out request holds, in table order (read-only: the
        engine's swap prefetch copies them early)."""
        return self.swap_space.blocks_of(request_id)

    def num_swapped_blocks(self, request_id: str) -> int:
        """Blocks a swapped-out request holds in the CPU pool."""
        return self.swap_space.num_blocks_of(request_id)

    def take_freed_blocks(self) -> list[int]:
        """Blocks freed since the last call that are still free now, sorted (the scheduler puts
        them in its plan, for a runner whose cache format keeps per-block state outside the
        blocks, e.g. KIVI staging; a block freed and reused in between starts a new life
        through its new owner's write, copy or swap)."""
        return self.pool.take_freed() if self.pool.freed else []  # twice a step: no call when none

    # ---- host tier (paged.core.host_tier) ---------------------------------------------
    def demote_above_threshold(self) -> int:
        """With ``host_tier_threshold`` t < 1: move cached-free blocks (GPU policy order) to the
        host tier until used + cached-free GPU blocks are at most t x num_blocks, so later
        allocations find plain free blocks; 1.0 (default): demote only on eviction. Returns
        blocks moved (their copies are in the next ``take_tier_ops``)."""
        if self.host is None or self.host_tier_threshold >= 1.0:
            return 0
        return self.host.demote_excess(self.pool, int(self.host_tier_threshold * self.num_blocks))

    def take_tier_ops(self) -> tuple[BlockMapping, BlockMapping, int]:
        """The host-tier copies planned since the last call: (gpu, cpu) tier-out pairs to apply
        before anything writes those GPU blocks, (cpu, gpu) tier-in pairs to apply before the
        forward pass, and the number of host evictions; ([], [], 0) without a host tier."""
        return self.host.take_ops() if self.host is not None else ([], [], 0)

    def drop_host_blocks(self, cpu_blocks: Iterable[int]) -> int:
        """Drop host-tier entries whose copy never completed (a failed step). Returns how many."""
        return self.host.drop_blocks(list(cpu_blocks)) if self.host is not None else 0

    # ---- prefix cache ------------------------------------------------------------------
    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; only when no block is in use."""
        return self.pool.reset() + (self.host.reset() if self.host is not None else 0)

    def uncache_blocks(self, block_ids: Iterable[int]) -> int:
        """Drop the prefix-cache entries of GPU blocks ``block_ids`` whose K/V was never written
        (a failed step: its chunks, or the swap-in it never applied). Returns how many were dropped."""
        return sum(self.pool.uncache(bid) for bid in block_ids)

    # ---- checks --------------------------------------------------------------------
    def check_parts(self) -> None:
        """Assert the parts' invariants (the pool, the CPU pool, the host tier; O(blocks))."""
        self.pool.check_invariants()
        if self.host is not None:
            self.host.check(self.pool, self.swap_space.held_blocks(), self.num_cpu_blocks)
        else:
            self.swap_space.check()
