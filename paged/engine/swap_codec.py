"""Block codecs for compressed swap: how a block's K (or V) is stored on the host.

Each codec reuses the torch reference quantizers of :mod:`kernels.quant` (the formats the
kernels define), applied to whole blocks ``[n, block_size, num_kv_heads, head_dim]``:

- ``fp8``: float8_e4m3fn codes with one float32 scale per (block, KV head) = absmax / 448 over
  the block's tokens and channels (``kernels.quantize_kv(..., "fp8_e4m3")`` with each
  (block, head) as its own "head"). Error per value: at most 2^-4 of |x| (3 mantissa bits,
  round to nearest even) for normal codes, and at most scale * 2^-10 in the subnormal range.
- ``int4``: ``kernels.quantize_kv(..., "int4")``: packed codes, fp16 scale and zero per
  token-head group of ``int4_group(head_dim)`` values. Error per value: at most half a step
  (scale / 2) plus the fp16 rounding of scale and zero.

A :class:`CompressedHostLayer` holds one model layer's host blocks: K's parts, then V's parts,
each ``[num_host_blocks, ...]`` so that a block's parts move together.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from paged._kernels import kernels
from kernels.format_table import int4_group


class Codec:
    """Encode ``x`` ``[n, bs, H, D]`` into ``num_parts`` tensors with leading dim ``n``, and back."""

    num_parts = 0

    def part_shapes(self, bs: int, h: int, d: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class Fp8BlockCodec(Codec):
    num_parts = 2

    def part_shapes(self, bs, h, d):
        return [((bs, h, d), torch.float8_e4m3fn), ((h,), torch.float32)]

    def encode(self, x):
        n, bs, h, d = x.shape
        xt = x.transpose(0, 1).reshape(bs, n * h, d)  # each (block, head) is one fp8 "head"
        q = kernels.quantize_kv(xt, "fp8_e4m3")
        return [q.data.reshape(bs, n, h, d).transpose(0, 1).contiguous(), q.scale.reshape(n, h).contiguous()]

    def decode(self, parts, dtype):
        data, scale = parts
        n, bs, h, d = data.shape
        xt = kernels.dequantize_kv(data.transpose(0, 1).reshape(bs, n * h, d), "fp8_e4m3",
                                   scale.reshape(n * h), dtype=torch.float32)
        return xt.reshape(bs, n, h, d).transpose(0, 1).to(dtype).contiguous()


class Int4BlockCodec(Codec):
    num_parts = 3

    def part_shapes(self, bs, h, d):
        g = d // int4_group(d)
        return [((bs, h, d // 2), torch.uint8), ((bs, h, g), torch.float16), ((bs, h, g), torch.float16)]

    def encode(self, x):
        q = kernels.quantize_kv(x, "int4", group_size=int4_group(x.shape[-1]))
        return [q.data.contiguous(), q.scale.contiguous(), q.zero.contiguous()]

    def decode(self, parts, dtype):
        data, scale, zero = parts
        return kernels.dequantize_kv(data, "int4", scale, zero, dtype=torch.float32).to(dtype)


CODECS: dict[str, Codec] = {"fp8": Fp8BlockCodec(), "int4": Int4BlockCodec()}


@dataclass(slots=True)
class CompressedHostLayer:
    """One layer's compressed host blocks: ``parts`` = K's codec parts then V's."""

    codec: Codec
    parts: list[torch.Tensor]

    @classmethod
    def allocate(cls, codec: Codec, num_blocks: int, like: kernels.KVCacheLayer, *,
                 pin: bool = False) -> "CompressedHostLayer":
        bs, h, d = like.block_size, like.num_kv_heads, like.head_dim
        parts = [torch.zeros((num_blocks,) + shape, dtype=dt, pin_memory=pin)
                 for _ in range(2) for shape, dt in codec.part_shapes(bs, h, d)]
        return cls(codec, parts)

    def block_tensors(self) -> list[torch.Tensor]:
        return self.parts
