"""Load llama-architecture GGUF files (the embedded SmolLM2-135M and local files).

Quantized tensors (Q4_0/Q4_1/Q8_0/K-quants ...) are dequantized with
``gguf.quants.dequantize`` to float32 and then cast to the compute dtype. The
activations therefore come from the *dequantized* weights: for the embedded
SmolLM2 file most matrices are 4-bit (Q4_1) in the file, the embedding is Q8_0.

GGUF (llama.cpp's converter) stores the Q and K projections with the rows of each
head permuted for *interleaved* RoPE (pairs ``(2i, 2i+1)``); our model uses the
rotate-half convention (pairs ``(i, i + head_dim/2)``), so ``unpermute_qk`` undoes it.

Load time: ``open_gguf`` reads the header with ``FastGGUFReader`` (struct over an mmap, ~0.2 s for
SmolLM2's 49k-token vocabulary instead of gguf.GGUFReader's 3-6 s of per-part numpy views; it
falls back to gguf.GGUFReader for files it does not handle; ``benchmarks/gguf_load.py`` times
both: 0.10 vs 3.0 s CPU on the embedded SmolLM2), and Q4_0/Q4_1/Q8_0 are dequantized
one whole tensor at a time in torch (the same float32 operations as gguf.quants, bit-identical).
"""
from __future__ import annotations

import contextlib
import mmap
import os
import struct
from typing import Any, NamedTuple

import numpy as np
import torch

from paged.errors import ModelLoadError
from .config import ModelConfig

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_MAP = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``reshape(n_head, 2, hd/2, in).swapaxes(1, 2)``:
    rows ``[h, i, pair]`` (interleaved) -> ``[h, pair, i]`` (rotate-half)."""
    out, *rest = w.shape
    hd = out // n_head
    return w.reshape(n_head, hd // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """The value of metadata ``key`` of a GGUF reader (``default`` when the file lacks it)."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader: Any) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {SUPPORTED_GGUF_ARCHITECTURES}")

    def req(key: str) -> Any:
        v = gguf_field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"GGUF file lacks metadata {arch}.{key}")
        return v

    hidden = int(req("embedding_length"))
    n_head = int(req("attention.head_count"))
    n_kv = int(gguf_field(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", hidden // n_head))
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise ModelLoadError("GGUF file lacks tensor token_embd.weight")
    vocab = int(gguf_field(reader, f"{arch}.vocab_size", int(emb.shape[1])))
    scaling = None
    st = gguf_field(reader, f"{arch}.rope.scaling.type")
    if st == "linear":
        scaling = {"rope_type": "linear", "factor": float(req("rope.scaling.factor"))}
    elif st not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {st!r} is not supported (linear, llama3 via rope_freqs)")
    names = {t.name for t in reader.tensors}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    freq_factors = None if freqs is None else tuple(
        float(x) for x in np.asarray(freqs.data, dtype=np.float32).reshape(-1))
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")), num_heads=n_head, num_kv_heads=n_kv, head_dim=head_dim,
        rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling, rope_freq_factors=freq_factors, qkv_bias="blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(gguf_field(reader, f"{arch}.context_length", 2048)),
        bos_token_id=None if bos is None else int(bos), eos_token_ids=() if eos is None else (int(eos),),
        architecture=str(arch), name=str(gguf_field(reader, "general.name", "")),
    )


# bytes per block of 32 values; the value formulas are gguf.quants' (float32 d * q (+ m)), op for op
_TORCH_QUANTS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _dequantize_torch(data: np.ndarray, name: str) -> torch.Tensor:
    """Q4_0 / Q4_1 / Q8_0 blocks (uint8 rows) -> float32 values, flat, in file order."""
    b = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1, _TORCH_QUANTS[name]))  # a writable copy
    d = b[:, :2].contiguous().view(torch.float16).float()
    if name == "Q8_0":
        return b[:, 2:].contiguous().view(torch.int8).float() * d
    qs = b[:, 4:] if name == "Q4_1" else b[:, 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # low nibbles are values 0-15 of a block, high 16-31
    if name == "Q4_0":
        return (q.to(torch.int8) - 8).float() * d
    return d * q.float() + b[:, 2:4].contiguous().view(torch.float16).float()


def _dequantize(t: Any) -> torch.Tensor:
    shape = tuple(int(x) for x in reversed(list(t.shape)))  # GGUF ne0 is the fastest axis
    name = getattr(t.tensor_type, "name", "")
    if name in _TORCH_QUANTS:
        return _dequantize_torch(t.data, name).reshape(shape)
    from gguf.quants import dequantize
    arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


def gguf_weights(reader: Any, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors with Q/K rows un-permuted."""
    out: dict[str, torch.Tensor] = {}
    permuted = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}  # tensor -> the heads of its rows
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        n_head = None
        _, idx, rest = t.name.split(".", 2) if t.name.startswith("blk.") else (None, None, None)
        if t.name in _GLOBAL_MAP:
            hf = _GLOBAL_MAP[t.name]
        elif rest in _LAYER_MAP:
            hf, n_head = f"layers.{idx}.{_LAYER_MAP[rest]}", permuted.get(rest.split(".")[0])
        else:
            raise ModelLoadError(f"GGUF tensor {t.name!r} has no counterpart in the llama model")
        w = _dequantize(t)
        out[hf] = w if n_head is None else unpermute_qk(w, n_head)
    return out


def open_gguf(path: str | os.PathLike[str], fast: bool = True) -> Any:
    """A reader of ``path``: FastGGUFReader, or gguf.GGUFReader when ``fast`` is False or the
    fast reader does not handle the file (big-endian, an unknown value type)."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {os.fspath(path)!r} does not exist")
    if fast:
        with contextlib.suppress(ValueError):  # gguf's reader handles (or explains) the rest
            return FastGGUFReader(os.fspath(path))
    from gguf import GGUFReader
    return GGUFReader(os.fspath(path))


# ---- a fast GGUF reader ---------------------------------------------------------------------
# gguf.GGUFReader builds numpy views for every part of every field: for SmolLM2's 49k tokens and
# 48k merges that is ~250k memmap slices, 3-6 s per load. FastGGUFReader walks the same layout with
# struct over an mmap of the file and maps the tensor data with one np.memmap. It offers what the
# loaders use: ``fields[key].contents()`` and ``tensors[i].name / tensor_type / shape / data``.

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_GGUF_MAGIC = 0x46554747  # b"GGUF" read little-endian
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class GGUFField:
    """One metadata value, decoded once; ``contents()`` as gguf.ReaderField's (lists for arrays)."""

    __slots__ = ("name", "value", "type")

    def __init__(self, name: str, value: Any, type_: int) -> None:
        self.name, self.value, self.type = name, value, type_

    def contents(self) -> Any:
        return self.value


class GGUFTensor(NamedTuple):
    """A tensor's header entry and its data (a read-only view of the file), as gguf.ReaderTensor."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # ne0 first (GGUF order)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class FastGGUFReader:
    """Little-endian GGUF v2/v3 (what llama.cpp writes). Raises ValueError on anything else, so
    ``open_gguf`` falls back to gguf.GGUFReader for a file this reader does not handle."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse(mm, path)
        except (struct.error, UnicodeDecodeError, IndexError, KeyError) as e:
            raise ValueError(f"malformed GGUF header: {type(e).__name__}: {e}") from e
        finally:
            mm.close()

    def _parse(self, buf: mmap.mmap, path: str) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        u32, u64 = _U32.unpack_from, _U64.unpack_from
        pos = 0

        def string() -> str:
            nonlocal pos
            n = u64(buf, pos)[0]
            s = buf[pos + 8:pos + 8 + n]
            if len(s) != n:
                raise ValueError("GGUF string runs past the end of the file")
            pos += 8 + n
            return s.decode("utf-8")

        def scalars(t: int, count: int) -> tuple:
            nonlocal pos
            fmt = _SCALARS.get(t)
            if fmt is None:
                raise ValueError(f"GGUF value type {t} is not handled here")
            s = struct.Struct(f"<{count}{fmt}")
            out = s.unpack_from(buf, pos)
            pos += s.size
            return out

        if u32(buf, 0)[0] != _GGUF_MAGIC:
            raise ValueError("not a GGUF file (magic)")
        version = u32(buf, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (byte-swapped?) is not handled here")
        n_tensors, n_kv = u64(buf, 8)[0], u64(buf, 16)[0]
        pos = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_kv):
            key = string()
            t = u32(buf, pos)[0]
            pos += 4
            if t == _STRING:
                v: Any = string()
            elif t == _ARRAY:
                et, count = u32(buf, pos)[0], u64(buf, pos + 4)[0]
                pos += 12
                v = [string() for _ in range(count)] if et == _STRING else list(scalars(et, count))
            else:
                v = scalars(t, 1)[0]
            self.fields[key] = GGUFField(key, v, t)
        infos = []
        for _ in range(n_tensors):
            name = string()
            nd = u32(buf, pos)[0]
            dims = list(struct.unpack_from(f"<{nd}Q", buf, pos + 4))
            pos += 4 + 8 * nd
            qt, off = u32(buf, pos)[0], u64(buf, pos + 4)[0]
            pos += 12
            infos.append((name, dims, qt, off))
        f = self.fields.get("general.alignment")
        align = int(f.value) if f is not None else 32
        if align <= 0 or align & (align - 1):
            raise ValueError(f"GGUF alignment {align} is not a power of two")
        self.data_offset = start = pos + (-pos % align)
        data = np.memmap(path, mode="r")
        self.tensors: list[GGUFTensor] = []
        for name, dims, qt, off in infos:
            qtype = GGMLQuantizationType(qt)
            n_el = int(np.prod(dims)) if dims else 1
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = n_el * type_size // block
            a = start + off
            if a + n_bytes > len(buf):
                raise ValueError(f"GGUF tensor {name!r} runs past the end of the file")
            shape = tuple(reversed(dims))
            # a plain ndarray view of the map (a np.memmap subclass pays bookkeeping on every slice)
            raw = np.asarray(data[a:a + n_bytes])
            if qtype.name in _PLAIN:
                arr = raw.view(_PLAIN[qtype.name]).reshape(shape)
            else:
                arr = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
            self.tensors.append(GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), n_el, n_bytes, a, arr))
