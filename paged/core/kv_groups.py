"""KV-cache groups: how a model's layers hold their cache, and what a request costs in the pool.

A model's cache layers fall into kinds (``FULL`` attention, ``SLIDING`` window attention, fixed
per-request ``STATE`` of Mamba / linear-attention layers). As in vLLM v1's hybrid KV-cache manager
(``vllm/v1/core/kv_cache_utils.py``, ``_get_kv_cache_groups_uniform_page_size``), layers of one kind
are split into groups of ``layers_per_group`` layers (the smallest kind's count, or the largest when
it is under 1.5x the smallest; the last group of a kind is padded), so every group's page, one
block of ``block_size`` tokens of its layers, has the same bytes and one pool holds them all. A
request has one block table per group: full groups keep every block, sliding groups keep the
blocks that some future query can still see, state groups keep a fixed number of pages.

Invariants:
- ``KVLayout.page_bytes`` is the same for every attention group: ``block_size x layers_per_group x
  bytes_per_token`` (one layer's bytes per token, equal across attention groups);
- a sliding group of window ``w`` skips (may free) the first ``max(0, n - w + 1)`` tokens once
  ``n`` are computed: the next query, at position ``n``, attends to positions ``n - w + 1 .. n``
  (``vllm/v1/core/single_type_kv_cache_manager.py``, ``SlidingWindowManager.get_num_skipped_tokens``);
- a state group holds ``state_pages`` pages per request whatever its length; vLLM instead grows the
  attention block size until one state fits one page (we keep the block size and round up).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from paged.errors import ConfigError

__all__ = ["FULL", "SLIDING", "STATE", "KINDS", "KVGroupSpec", "KVLayout", "make_layout"]

FULL, SLIDING, STATE = "full", "sliding", "state"
KINDS = (FULL, SLIDING, STATE)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """One group of cache layers of one kind. ``num_layers``: real layers (the rest of the group's
    ``layers_per_group`` is padding); ``window``: tokens a sliding query attends, its own included;
    ``state_bytes``: bytes of one layer's fixed state per request."""

    kind: str
    num_layers: int
    window: int = 0
    state_bytes: int = 0

    def skipped_tokens(self, num_computed: int) -> int:
        """Leading tokens no future query of this group reads once ``num_computed`` are computed."""
        if self.kind == SLIDING:
            return max(0, num_computed - self.window + 1)
        return 0


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The groups of a model's cache on one GPU, for one block size (see the module docstring).
    ``bytes_per_token``: one attention layer's bytes per token (0 when no layer attends)."""

    groups: tuple[KVGroupSpec, ...]
    layers_per_group: int
    block_size: int
    bytes_per_token: int

    # ---- shape -------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        """Anything but one full-attention group: the pool needs ``HybridKVCacheManager`` (a table
        per group, window retirement)."""
        return len(self.groups) > 1 or self.groups[0].kind != FULL

    @property
    def num_padding_layers(self) -> int:
        return sum(self.layers_per_group - g.num_layers for g in self.groups)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (block) of the pool: ``block_size`` tokens of one group's layers."""
        if self.bytes_per_token:
            return self.block_size * self.layers_per_group * self.bytes_per_token
        return max(g.state_bytes for g in self.groups) * self.layers_per_group  # state only: a page per state

    def state_pages(self, group: KVGroupSpec) -> int:
        """Pages one request's state takes in ``group`` (rounded up to whole pages)."""
        return _cdiv(self.layers_per_group * group.state_bytes, self.page_bytes) if group.kind == STATE else 0

    # ---- per request ---------------------------------------------------------------
    def group_pages(self, group: KVGroupSpec, num_tokens: int) -> int:
        """Pages ``group`` holds for a request with ``num_tokens`` computed tokens, once the blocks
        outside its window are freed (what ``HybridKVCacheManager`` holds after each step)."""
        if group.kind == STATE:
            return self.state_pages(group) if num_tokens else 0
        blocks = _cdiv(num_tokens, self.block_size)
        return blocks - min(blocks, group.skipped_tokens(num_tokens) // self.block_size)

    def request_pages(self, num_tokens: int) -> int:
        """Pool pages a request of ``num_tokens`` computed tokens holds, all groups."""
        return sum(self.group_pages(g, num_tokens) for g in self.groups)

    def request_bytes(self, num_tokens: int) -> int:
        """Pool bytes of ``request_pages`` (padding layers and partial blocks included)."""
        return self.request_pages(num_tokens) * self.page_bytes

    def content_bytes(self, num_tokens: int) -> int:
        """Bytes the real layers need for a request of ``num_tokens`` tokens, without padding layers or
        rounding to blocks: full layers every token, sliding layers their window, state layers
        their state."""
        total = 0
        for g in self.groups:
            if g.kind == STATE:
                total += g.num_layers * g.state_bytes if num_tokens else 0
            else:
                held = num_tokens - g.skipped_tokens(num_tokens)
                total += g.num_layers * held * self.bytes_per_token
        return total


def make_layout(kinds: Sequence[str], bytes_per_token: int, block_size: int, *, window: int = 0,
                state_bytes: int = 0) -> KVLayout:
    """Group per-layer ``kinds`` (one of ``KINDS`` per cache layer, in layer order) as vLLM v1 does:
    ``layers_per_group`` = the smallest kind's layer count (the largest when under 1.5x it), each
    kind split into ``ceil(count / layers_per_group)`` groups, layers dealt round-robin, the last
    groups padded. Raises ConfigError for an unknown kind or a missing window/state size."""
    if not kinds:
        raise ConfigError("a KV layout needs at least one cache layer")
    bad = sorted({k for k in kinds if k not in KINDS})
    if bad:
        raise ConfigError(f"unknown layer kinds {bad}; use {list(KINDS)}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
    counts = {k: kinds.count(k) for k in KINDS if k in kinds}
    if SLIDING in counts and window < 1:
        raise ConfigError("sliding layers need a positive window (tokens each query attends)")
    if STATE in counts and state_bytes < 1:
        raise ConfigError("state layers need their state's size in bytes per request (state_bytes > 0)")
    if (FULL in counts or SLIDING in counts) and bytes_per_token < 1:
        raise ConfigError("attention layers need bytes_per_token > 0")
    size = min(counts.values())
    if max(counts.values()) < 1.5 * size:
        size = max(counts.values())
    groups: list[KVGroupSpec] = []
    for kind, n in counts.items():
        num = _cdiv(n, size)
        for i in range(num):
            layers = len(range(i, n, num))  # round-robin: layers i, i + num, ... (vLLM's layers[i::num])
            groups.append(KVGroupSpec(kind, layers, window if kind == SLIDING else 0,
                                      state_bytes if kind == STATE else 0))
    return KVLayout(tuple(groups), size, block_size, bytes_per_token if (FULL in counts or SLIDING in counts) else 0)
