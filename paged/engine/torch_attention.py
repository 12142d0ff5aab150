"""Plan once, run per layer: the torch attention path for unquantized caches.

FlashInfer splits attention into ``plan`` (per step: page-table metadata, work split) and
``run`` (per layer). Here :class:`TorchAttentionPlan` does the same for the torch backend:
everything that depends on the batch and not on the layer is built and checked once per step:

- ``slots`` (int64 ``[num_tokens]``): where each new token's K/V goes; checked once to lie
  inside the cache;
- decode rows (one query token each): ``gather`` (int64 ``[S, T]``, ``T`` = the longest
  context) = the slot of each position ``p < seq_len`` of each row; positions past a row's
  ``seq_len`` repeat that row's first slot (a slot it wrote, so never stale or NaN) and are
  masked out (``mask`` bool ``[S, 1, 1, T]``, None when every row is ``T`` long);
- prefill rows: a fresh prompt (nothing cached before the chunk) attends over its own new K/V
  with ``is_causal`` (no gather at all); a chunk after cached tokens gathers its context's
  slots once per layer with a causal mask built once per step.

Per layer, :meth:`TorchAttentionPlan.__call__` writes K and V with one ``index_copy_`` each,
gathers only real positions (no whole-block over-read, no masked fill) and calls SDPA. On a
float32 CPU cache the decode rows skip the gather and SDPA when the compiled kernel is there
(:mod:`kernels.native`: reads the blocks in place; ``PAGED_NATIVE=0`` or
``kernels.native.ENABLED = False`` keeps torch). The
math is that of :mod:`kernels.reference` (float32 attention, output in the query's dtype);
only the order of float additions over padding differs, so greedy outputs stay the same.
Quantized formats keep the general kernels path (:class:`paged.engine.runner.PagedAttention`).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from paged._kernels import kernels
from kernels import native as native_kernel
from kernels.reference import causal_attention
from .batch import BatchMetadata


def supports(layers: Sequence[kernels.KVCacheLayer], backend: str) -> bool:
    """Whether the planned path applies: the torch or native backend on a plain (unquantized) cache."""
    return backend in ("torch", "native") and bool(layers) and not layers[0].kv_format.quantized \
        and not layers[0].kv_format.k_per_channel


def native_uses(layer: kernels.KVCacheLayer) -> bool:
    """Whether decode rows over ``layer`` go through the compiled CPU kernel (float32 on CPU, built)."""
    return layer.device.type == "cpu" and layer.k.dtype == torch.float32 and native_kernel.available()


class TorchAttentionPlan:
    """One step's attention metadata (built once); call it per layer as the model's backend.

    Invariants: every index in ``slots`` and ``gather`` addresses a slot of a block the step's
    sequences own (checked here, once); rows of the packed batch are either decode rows (one
    query) or prefill rows (``query_start_loc`` ranges of more than one token).
    """

    accepts_strided = True  # q/k/v may be views of the model's fused projection (no copies)

    def __init__(self, layers: Sequence[kernels.KVCacheLayer], meta: BatchMetadata,
                 shared: frozenset[int] = frozenset()) -> None:
        self.layers = layers  # per model layer; a shared layer's entry is its owner's cache
        self.shared = shared  # cross-layer KV sharing: these layers write nothing, read the owner's K/V
        first = layers[0]
        self.h, self.d, bs = first.num_kv_heads, first.head_dim, first.block_size
        self.scale = 1.0 / math.sqrt(self.d)
        dev = first.device
        num_slots = first.num_blocks * bs
        self.slots = meta.slot_mapping.to(device=dev, dtype=torch.long)
        if meta.block_tables.numel():  # every sequence's blocks (rows padded with block 0), once per step
            lo, hi = int(meta.block_tables.min()), int(meta.block_tables.max())
            if lo < 0 or hi >= first.num_blocks:
                raise kernels.ShapeError(f"block id {lo if lo < 0 else hi} is not a block of this cache "
                                         f"(ids 0..{first.num_blocks - 1}); every used block-table entry must be "
                                         "an allocated block id")
        if self.slots.numel() and (int(self.slots.min()) < 0 or int(self.slots.max()) >= num_slots):
            raise kernels.ShapeError(f"slot_mapping must lie in [0, {num_slots}) for {first.num_blocks} blocks "
                                     f"x {bs}; got {int(self.slots.min())}..{int(self.slots.max())}")
        qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        qlens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
        dec = [i for i, n in enumerate(qlens) if n == 1]
        self.all_decode = len(dec) == len(lens)
        tables = meta.block_tables.to(device=dev, dtype=torch.long)
        self.dec_rows = None if self.all_decode else torch.tensor([qsl[i] for i in dec], dtype=torch.long,
                                                                 device=dev)
        self.gather = self.mask = self.native = None
        if dec:  # the decode rows' block tables and context lengths
            rows = tables if self.all_decode else tables[torch.tensor(dec, device=dev)]
            dl = [lens[i] for i in dec]
        if dec and native_uses(first):
            self.native = native_kernel.DecodePlan(rows, torch.tensor(dl), first.num_blocks, bs, self.scale)
        elif dec:
            t = max(dl)
            pos = torch.arange(t, device=dev)
            dl_t = torch.tensor(dl, device=dev)
            p = torch.where(pos[None, :] < dl_t[:, None], pos[None, :], 0)  # pad with position 0
            self.gather = (rows.gather(1, p // bs) * bs + p % bs).reshape(-1)
            self.num_dec, self.t = len(dec), t
            if min(dl) != t:
                self.mask = (pos[None, :] < dl_t[:, None])[:, None, None, :]
        # prefill rows: (q_lo, q_hi, context slots or None for a fresh prompt, causal mask or None)
        self.prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []
        for i, n in enumerate(qlens):
            if n <= 1:
                continue
            ctx = lens[i]
            if ctx == n:
                self.prefills.append((qsl[i], qsl[i + 1], None, None))
                continue
            pos = torch.arange(ctx, device=dev)
            ctx_slots = tables[i, pos // bs] * bs + pos % bs
            mask = pos[None, :] <= torch.arange(ctx - n, ctx, device=dev)[:, None]
            self.prefills.append((qsl[i], qsl[i + 1], ctx_slots, mask))

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layer = self.layers[layer_idx]
        kc, vc = layer.k.view(-1, self.h, self.d), layer.v.view(-1, self.h, self.d)
        if layer_idx in self.shared:  # the owner (an earlier layer) wrote this step's K/V
            k, v = kc.index_select(0, self.slots), vc.index_select(0, self.slots)
        else:
            kc.index_copy_(0, self.slots, k.to(kc.dtype))
            vc.index_copy_(0, self.slots, v.to(vc.dtype))
        if self.all_decode:
            return self._decode(q, kc, vc)
        out = torch.empty_like(q)
        if self.native is not None or self.gather is not None:
            out[self.dec_rows] = self._decode(q[self.dec_rows], kc, vc)
        for lo, hi, ctx_slots, mask in self.prefills:
            if ctx_slots is None:  # fresh prompt: its context is exactly the new K/V, as stored
                kk, vv = k[lo:hi].to(kc.dtype).float(), v[lo:hi].to(vc.dtype).float()
            else:
                kk, vv = kc.index_select(0, ctx_slots).float(), vc.index_select(0, ctx_slots).float()
            out[lo:hi] = causal_attention(q[lo:hi].float(), kk, vv, self.scale, mask).to(q.dtype)
        return out

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            bs = self.layers[0].block_size
            o = self.native(q.float(), kc.view(-1, bs, self.h, self.d), vc.view(-1, bs, self.h, self.d))
            return o.to(q.dtype)
        s, t = self.num_dec, self.t
        kk = kc.index_select(0, self.gather).view(s, t, self.h, self.d).float()
        vv = vc.index_select(0, self.gather).view(s, t, self.h, self.d).float()
        # a KV head's query heads as query rows ([S, H, G, D]; q head j reads KV head j // G):
        # one SDPA without GQA expansion, ~15% faster on CPU than enable_gqa with one query row
        o = F.scaled_dot_product_attention(q.float().reshape(s, self.h, -1, self.d), kk.transpose(1, 2),
                                           vv.transpose(1, 2), attn_mask=self.mask, scale=self.scale)
        return o.reshape(q.shape).to(q.dtype)
