"""The study's cache for split KV formats: exactly what the engine stores, one sequence at a time.

:class:`SplitCache` is an attention backend (``__call__(layer, q, k, v)``) for one sequence that
stores K and V with the kernels' own split codecs (:mod:`kernels.split`: ``kivi_quantize`` per
block, ``cb_quantize`` per token, fp16 exact rows) and attends with the kernels' reference
:func:`kernels.split.attend_split` — the function the engine's torch path calls on the same
values gathered from its blocks. So ``LLM(kv_cache_dtype=fmt, block_size=B)`` and this cache
give the same prompt log-probabilities (bit for bit when the engine runs each prompt in one
prefill; ``tests/test_quant_split.py``).

Its per-layer tables come from a :class:`kernels.split_artefact.KVArtefact` fitted on the
calibration text (:func:`paged.quant.artefact.fit`), the same tables the engine loads.
"""
from __future__ import annotations

import math

import torch

from kernels import default_tables, get_format
from kernels.format_table import CODE_KIVI, FRONT  # FRONT: alias -> split format, the served front
from kernels.split import attend_split, cb_dequantize, cb_quantize, kivi_dequantize, kivi_quantize, rope, unrope
from kernels.split_codec import row_dequantize, row_quantize

__all__ = ["SplitCache", "Served", "tables_for", "served_bits", "FRONT"]


class Served:
    """A split format at a block size, as a row of an ablation (``Served("kivi3+pre/cb3+rot", 32)``)."""

    def __init__(self, fmt: str, block_size: int = 32, label: str = "") -> None:
        self.fmt = get_format(fmt)
        self.block_size = block_size
        self.name = label or f"{self.fmt.name}|bs{block_size}"

    def bits(self, num_layers: int, num_kv_heads: int, head_dim: int, context: int = 2048
             ) -> tuple[float, float, float]:
        return served_bits(self.fmt, self.block_size, num_kv_heads, head_dim, context)


def served_bits(fmt, block_size: int, num_kv_heads: int, head_dim: int, context: int = 2048
                ) -> tuple[float, float, float]:
    """``(K, V, mean)`` bits per value of a split format: codes, scales and zeros (per-block ones
    spread over the block) and the staging rows one sequence holds (fp16, or ``@krows``/``@vrows``
    codes with their fp16 scale; K only without a sink or window) amortised over ``context`` tokens."""
    from kernels.format_table import check_split, side_bytes, staging_tokens_per_seq
    f = get_format(fmt)
    check_split(f, head_dim, block_size)
    n = num_kv_heads * head_dim
    out = [(tok + blk / block_size) * 8 / n
           for tok, blk in (side_bytes(s, num_kv_heads, head_dim, block_size) for s in (f.k_side, f.v_side))]
    rows = staging_tokens_per_seq(f, block_size)
    row_bits = lambda b: 16.0 if b == 16 else b + 16.0 / head_dim  # noqa: E731  codes + an fp16 scale per row
    kb = out[0] + row_bits(f.k_rows) * rows / context
    vb = out[1] + (row_bits(f.v_rows) * rows / context if (f.sink or f.window) else 0.0)
    return kb, vb, (kb + vb) / 2


def tables_for(fmt, model, artefact, block_size: int) -> list:
    """Per-layer :class:`~kernels.split.SplitTables` of ``fmt`` for ``model`` from ``artefact``
    (RoPE rows: the model's own tables over its maximum positions)."""
    f = get_format(fmt)
    cfg = model.config
    model.rope.ensure(torch.tensor([cfg.max_position_embeddings - 1]))
    rope_rows = (model.rope.cos, model.rope.sin_signed)
    return [artefact.tables(f, i, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, "cpu", rope_rows)
            if f.calibrated else default_tables(f, cfg.num_kv_heads, cfg.head_dim, "cpu", rope=rope_rows)
            for i in range(cfg.num_layers)]


class SplitCache:
    """One sequence in split format ``fmt`` with block size ``block_size`` (see the module docstring)."""

    def __init__(self, fmt, model, tables: list, block_size: int) -> None:
        from kernels.format_table import check_split
        self.fmt = get_format(fmt)
        check_split(self.fmt, model.config.head_dim, block_size)
        self.model, self.tables, self.block_size = model, tables, block_size
        self.num_layers = model.config.num_layers
        self.name = self.fmt.name
        self.reset()

    def reset(self) -> None:
        n = self.num_layers
        self.kq: list[torch.Tensor | None] = [None] * n     # keys as read from codes (sealed groups)
        self.raw: list[torch.Tensor | None] = [None] * n    # fp16 keys as written (post-RoPE)
        self.ke: list[torch.Tensor | None] = [None] * n     # keys as staged: raw, or @krows codes read back
        self.vq: list[torch.Tensor | None] = [None] * n     # values from codes (rotated frame for +rot)
        self.ve: list[torch.Tensor | None] = [None] * n     # fp16 values as staged

    def _keys(self, layer: int, kd: torch.Tensor, start: int) -> torch.Tensor:
        """Append fp16-rounded keys ``kd``; return the keys read from codes for every position
        (the unsealed tail: the staged rows) ``[T, H, D]``. A group is sealed from this call's keys
        as written and from earlier calls' keys as staged (the engine's write)."""
        side, t, bs = self.fmt.k_side, self.tables[layer], self.block_size
        raw = kd if self.raw[layer] is None else torch.cat([self.raw[layer], kd])
        self.raw[layer] = raw
        staged = _rows(kd, self.fmt.k_rows)
        self.ke[layer] = staged if self.ke[layer] is None else torch.cat([self.ke[layer], staged])
        if side.exact:
            return raw  # an exact side stores its keys as given (already rounded to its storage dtype)
        return self._seal(layer, raw, start)

    def _seal(self, layer: int, raw: torch.Tensor, start: int) -> torch.Tensor:
        side, t, bs = self.fmt.k_side, self.tables[layer], self.block_size
        done = self.kq[layer]
        nd = 0 if done is None else done.shape[0]
        full = (raw.shape[0] // bs) * bs
        if full > nd:
            x = torch.where((torch.arange(nd, full) < start)[:, None, None], self.ke[layer][nd:full], raw[nd:full])
            x = x.reshape(-1, bs, *raw.shape[1:])
            rows = torch.arange(nd, full).reshape(-1, bs)
            if side.pre_rope:
                x = unrope(x, t.cos[rows], t.sin[rows])
            exclude = rows < self.fmt.sink if self.fmt.sink else None
            codes, step, zero, sup = kivi_quantize(x, t.k_width, side.compact, exclude)
            y = kivi_dequantize(codes, t.k_width, step, zero, sup)
            if side.pre_rope:
                y = rope(y, t.cos[rows], t.sin[rows])
            y = y.reshape(-1, *raw.shape[1:])
            done = y if done is None else torch.cat([done, y])
            self.kq[layer] = done
        return raw if done is None else torch.cat([done, raw[done.shape[0]:]])

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dtype = q.dtype
        q, k, v = q.float(), k.float(), v.float()
        fmt, t = self.fmt, self.tables[layer]
        start = 0 if self.raw[layer] is None else self.raw[layer].shape[0]
        ks, vs = fmt.k_side, fmt.v_side
        kd = k.to(torch.float16).float() if not ks.exact else k.to(ks.storage_dtype).float()
        kq = self._keys(layer, kd, start)
        ke, sealed = self.ke[layer], 0 if self.kq[layer] is None else self.kq[layer].shape[0]
        staged = (torch.arange(ke.shape[0]) >= sealed if ks.code == CODE_KIVI
                  else torch.zeros(ke.shape[0], dtype=torch.bool))
        if vs.exact:
            vnew = v.to(vs.storage_dtype).float()
        else:
            vr = v @ t.hadamard if vs.rotate else v
            codes, scale = cb_quantize(vr, t.v_levels, vs.group)
            vnew = cb_dequantize(codes, scale, t.v_levels)
        self.vq[layer] = vnew if self.vq[layer] is None else torch.cat([self.vq[layer], vnew])
        vh = _rows(v.to(torch.float16).float(), fmt.v_rows)
        self.ve[layer] = vh if self.ve[layer] is None else torch.cat([self.ve[layer], vh])
        qpos = torch.arange(start, start + q.shape[0])
        windowed = bool(fmt.window or fmt.sink)
        keep_k = ke if (windowed or ks.code == CODE_KIVI) else None
        out = attend_split(q, qpos, kq, keep_k, self.vq[layer], self.ve[layer] if windowed else None, staged, fmt,
                           t.hadamard.T if vs.rotate else None, 1.0 / math.sqrt(q.shape[-1]))
        return out.to(dtype)


def _rows(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Exact rows as the staging pool keeps them: ``x`` itself (fp16 rows), or its ``bits``-bit row
    codes read back (``@krows``/``@vrows``)."""
    if bits == 16:
        return x
    codes, scale = row_quantize(x, bits)
    return row_dequantize(codes, scale, bits, x.shape[-1])
