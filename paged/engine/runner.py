"""ModelRunner: the real-model executor. Owns the paged K/V tensors, applies a plan's cache
operations, builds batch metadata and runs the model through our kernels.

Per step (order fixed by the scheduler's contract): swap_out (device -> host pool), block
copies (copy-on-write), swap_in (host -> device), then one forward pass over the plan's batch.
The runner reads the plan only: block ids come with the batch (``Batch.tables``), never from the
KV manager. Every attention layer first writes the new tokens' K/V through ``slot_mapping``
(``kernels.write_kv``) and then reads the whole context through block tables
(``paged_prefill_attention``; ``paged_decode_attention`` when every chunk is one decode
token). Only the rows that sample a token pay for the LM head.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from paged._kernels import kernels
from .batch import BatchMetadata, build_batch
from . import torch_attention
from .swap import SwapExecutor
from .kv_sharing import cache_index, check_share_map, owner_layers

from paged.core.plan import Batch, SchedulerOutput
from paged.models.llama import LlamaForCausalLM


class PagedAttention:
    """The model's attention backend for one step: write K/V, then attend over the cache."""

    def __init__(self, layers: Sequence[kernels.KVCacheLayer], meta: BatchMetadata,
                 backend: str | None, shared: frozenset[int] = frozenset()) -> None:
        self.layers = layers  # per model layer; a shared layer's entry is its owner's cache
        self.meta = meta
        self.backend = backend
        self.decode_only = meta.max_query_len == 1
        self.shared = shared  # layers that read their owner's cache and write nothing

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layer, m = self.layers[layer_idx], self.meta
        if layer_idx not in self.shared:
            kernels.write_kv(k, v, layer, m.slot_mapping, backend=self.backend, positions=m.positions)
        if self.decode_only:
            return kernels.paged_decode_attention(q, layer, None, m.block_tables, m.seq_lens, backend=self.backend)
        return kernels.paged_prefill_attention(q, layer, None, m.block_tables, m.seq_lens, m.query_start_loc,
                                               backend=self.backend)


@dataclass(slots=True)
class ForwardResult:
    """Float32 logits ``[num_sampling_chunks, vocab]`` in the order of ``sample_ids``."""

    sample_ids: list[str]
    logits: torch.Tensor
    forward_ms: float
    num_tokens: int
    prompt_logits: dict[str, tuple[int, torch.Tensor]] | None = None  # id -> (first position, rows)


def default_backend(device: torch.device) -> str | None:
    """On CPU ``"native"`` (the compiled kernels: fused decode over every KV format, the torch
    references elsewhere) when they build, else ``"torch"`` (both immune to TRITON_INTERPRET); auto on GPU."""
    if device.type != "cpu":
        return None
    from kernels import native
    return "native" if native.available() else "torch"


class ModelRunner:
    """Holds one device cache layer per owner layer (every layer without ``kv_share_with``;
    see :mod:`paged.engine.kv_sharing`) and (for swap) as many host layers. ``layers`` are the
    owners' caches (what cache ops move); ``layer_caches[i]`` is the cache model layer i reads.
    ``num_blocks`` x ``block_size`` is the pool's shape; ``ref_count(block_id)`` (read-only, the
    pool's) tells a window format which blocks are shared (it keeps their exact rows)."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, *,
                 ref_count: Callable[[int], int] = lambda block_id: 1, kv_cache_dtype: str = "auto",
                 num_cpu_blocks: int = 0, attention_backend: str | None = None, max_num_seqs: int = 256,
                 num_staging_blocks: int | None = None,
                 swap_mode: str = "sync", swap_compression: str | None = None,
                 kv_share_with: dict[int, int] | None = None) -> None:
        self.model = model
        self.block_size = block_size
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.backend = attention_backend if attention_backend is not None else default_backend(self.device)
        resolved = kernels.resolve_backend(self.backend, self.device)  # a bad backend fails here, not mid-step
        cfg = model.config
        share = check_share_map(kv_share_with, cfg.num_layers)
        # int4_kivi keeps unfilled blocks in a staging pool: about one per running (or swapped)
        # sequence once freed blocks are released. Start from max_num_seqs and let it grow
        # (forks for n > 1 and beams are not bounded by max_num_seqs; at most one slot per block).
        # ``num_staging_blocks`` (the engine's, when it sized the cache from a memory budget) is
        # a fixed device pool counted in that budget: it does not grow.
        fmt = kernels.get_format(kv_cache_dtype, self.dtype)
        tables = self._split_tables(fmt, block_size) if fmt.split else None
        owners = list(owner_layers(share, cfg.num_layers))
        staging = lambda n, dev: ({} if not fmt.staged else  # noqa: E731
                                  {"num_staging_blocks": num_staging_blocks, "grow_staging": False}
                                  if num_staging_blocks is not None and dev == self.device else
                                  {"num_staging_blocks": min(n, max_num_seqs + 16), "grow_staging": True})
        mk = lambda n, dev: [kernels.allocate_kv_cache(  # noqa: E731
            n, block_size, cfg.num_kv_heads, cfg.head_dim, kv_cache_dtype, dtype=self.dtype, device=dev,
            **staging(n, dev), **({"tables": tables[i]} if tables else {}))
            for i in owners]  # int4 group: kernels.int4_group's default, as the engine's byte budget assumes
        self._ref_count = ref_count  # read-only: a window's shared blocks keep their staging
        self.layers = mk(num_blocks, self.device)
        self.swap_layer_of = cache_index(share, cfg.num_layers)  # per model layer: the cache layer it reads
        self.layer_caches = [self.layers[k] for k in self.swap_layer_of]
        self.shared = frozenset(share or ())
        self.cpu_layers = mk(num_cpu_blocks, "cpu") if num_cpu_blocks and not swap_compression else []
        self.staged = self.layers[0].staging is not None
        self.planned = torch_attention.supports(self.layers, resolved)  # plan once per step, run per layer
        if self.cpu_layers and self.layers[0].kv_format.scale == "head":
            for g, c in zip(self.layers, self.cpu_layers):  # swaps need the same per-layer scales
                c.k_scale, c.v_scale = g.k_scale.cpu(), g.v_scale.cpu()
        # every device <-> host block move goes through one SwapExecutor (paged.engine.swap)
        self.swap = SwapExecutor.build(self.layers, num_cpu_blocks, mode=swap_mode, compression=swap_compression,
                                       host_layers=self.cpu_layers)
        self.cpu_layers = self.swap.host_layers

    def _split_tables(self, fmt, block_size: int) -> list:
        """Per model layer, a split format's constants: the model's RoPE rows (``+pre`` keys), and
        widths/codebooks from the calibration artefact fitted on this model
        (:func:`paged.quant.artefact.for_model`; a missing or mismatched one is a ConfigError)."""
        cfg = self.model.config
        rope = self.model.rope
        rope.ensure(torch.tensor([cfg.max_position_embeddings - 1]))
        rows = (rope.cos, rope.sin_signed)
        art = None
        if fmt.calibrated:
            from paged.quant.artefact import for_model
            art = for_model(self.model, fmt, block_size)
        return [art.tables(fmt, i, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, self.device, rows)
                if art is not None else kernels.default_tables(fmt, cfg.num_kv_heads, cfg.head_dim, self.device,
                                                               rope=rows)
                for i in range(cfg.num_layers)]

    def _retire_window(self, meta: BatchMetadata) -> None:
        """Window formats: free the staging of blocks no query reads exactly any more (not shared
        with another sequence: those wait until they are freed)."""
        fmt = self.layers[0].kv_format
        if not (fmt.split and fmt.window):
            return
        from kernels.split import window_out_blocks
        ids = [b for b in window_out_blocks(meta.block_tables, meta.seq_lens, fmt, self.block_size)
               if self._ref_count(b) == 1]
        if ids:
            for layer in self.layers:
                kernels.release_window(layer, ids)

    def cache_bytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def apply_cache_ops(self, plan: SchedulerOutput) -> float:
        """tier_out + swap_out, then block copies, then swap_in + tier_in (the scheduler's order:
        a demoted GPU block is read before anything overwrites it); returns ms."""
        t0 = time.perf_counter()
        self.swap.fence()  # nothing of an earlier step's swap-ins is left pending
        if plan.compaction_copies:  # block compaction first: every other id of the plan is post-compaction
            kernels.copy_blocks(self.layers, plan.compaction_copies, backend=self.backend)  # + int4_kivi staging
        if plan.tier_out or plan.swap_out:  # host tier first: its GPU blocks are reused in this plan
            self.swap.swap_out(plan.tier_out + plan.swap_out if plan.tier_out else plan.swap_out)
        if plan.block_copies:
            kernels.copy_blocks(self.layers, plan.block_copies, backend=self.backend)
        if plan.swap_in or plan.tier_in:
            # overlap mode: the forward waits per layer (wait_layer)
            self.swap.swap_in(plan.swap_in + plan.tier_in if plan.tier_in else plan.swap_in)
        if self.staged:
            self.release_blocks(plan.freed_blocks)
            self.swap.release_host([cpu for cpu, _ in plan.swap_in + plan.tier_in])
        if self.swap.mode == "sync":
            self._sync()
        return (time.perf_counter() - t0) * 1e3

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop per-block state kept outside the blocks (int4_kivi staging) for blocks the
        plan says were freed (``SchedulerOutput.freed_blocks``, ``finished_freed_blocks``)."""
        if self.staged and block_ids:
            for layer in self.layers:
                kernels.release_blocks(layer, block_ids)

    def forward(self, batch: Batch, prompt_limits: dict[str, int] | None = None) -> ForwardResult:
        """One forward pass over ``batch``; logits only for the entries that sample, and for
        request ids in ``prompt_limits`` also for their positions below the limit (prompt
        log-probs: position p predicts token p + 1)."""
        t1 = time.perf_counter()
        if not batch:
            return ForwardResult([], torch.zeros(0, self.model.config.vocab_size), 0.0, 0)
        host_meta = build_batch(batch, self.block_size)
        meta = host_meta.to(self.device)
        attn = (torch_attention.TorchAttentionPlan(self.layer_caches, meta, self.shared) if self.planned
                else PagedAttention(self.layer_caches, meta, self.backend, self.shared))
        hidden = self.model(meta.input_ids, meta.positions, self.swap.fenced(attn, self.swap_layer_of))
        rows = [i for i, s in enumerate(meta.samples) if s]
        logits = self.model.compute_logits(hidden[meta.sample_indices[rows]])
        prompt = {}
        if prompt_limits:
            off = 0
            for r, start, num in zip(batch.requests, batch.starts, batch.num_tokens):
                n = min(num, prompt_limits.get(r.request_id, 0) - start)
                if n > 0:
                    prompt[r.request_id] = (start, self.model.compute_logits(hidden[off:off + n]))
                off += num
        self._retire_window(host_meta)
        self._sync()
        return ForwardResult([meta.request_ids[i] for i in rows], logits,
                             (time.perf_counter() - t1) * 1e3, meta.num_tokens, prompt or None)
