"""Batch metadata for the runner, built from one step's ``Batch`` (the plan only: each entry
carries its request's block table, ``Batch.tables``).

For chunk c of request r (tokens [start, start + n)):
- positions: start .. start+n-1;
- slot_mapping: slot of each new token, `table[p // bs] * bs + p % bs`;
- seq_lens: start + n (context length including the new tokens);
- query_start_loc: cumulative query lengths, `[0, n0, n0+n1, ...]` (int32);
- block_tables: int32 `[num_seqs, max_blocks]`, padded with 0 (kernels never read past seq_len).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from paged.core.plan import Batch


@dataclass
class BatchMetadata:
    request_ids: list[str]
    input_ids: torch.Tensor        # int64 [num_tokens]
    positions: torch.Tensor        # int64 [num_tokens]
    slot_mapping: torch.Tensor     # int64 [num_tokens]
    seq_lens: torch.Tensor         # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    block_tables: torch.Tensor     # int32 [num_seqs, max_blocks]
    sample_indices: torch.Tensor   # int64: index of each sequence's last token in the batch
    samples: list[bool]            # whether each sequence needs a sampled token
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> "BatchMetadata":
        fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return BatchMetadata(**fields)


def padded_block_tables(tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """int32 [len(tables), the longest table (at least 1)], rows padded with 0."""
    out = np.zeros((len(tables), max(1, max(map(len, tables), default=0))), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return torch.from_numpy(out)


def slot_mapping(table: Sequence[int], start: int, num_tokens: int, block_size: int) -> np.ndarray:
    """Slots of positions [start, start + num_tokens) for one block table (int64)."""
    pos = np.arange(start, start + num_tokens, dtype=np.int64)
    return np.asarray(table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


def build_batch(batch: Batch, block_size: int) -> BatchMetadata:
    """Metadata for one step on CPU tensors (`.to(device)` moves them)."""
    tables, ids, pos, slots, seq_lens = [], [], [], [], []
    for r, start, n, table in zip(batch.requests, batch.starts, batch.num_tokens, batch.tables):
        table = [b.block_id for b in table]
        tables.append(table)
        ids.append(np.asarray(r.token_ids[start:start + n], dtype=np.int64))
        pos.append(np.arange(start, start + n, dtype=np.int64))
        slots.append(slot_mapping(table, start, n, block_size))
        seq_lens.append(start + n)
    qlens = batch.num_tokens
    qsl = np.zeros(len(batch) + 1, dtype=np.int32)
    np.cumsum(qlens, out=qsl[1:])
    cat = (lambda xs: torch.from_numpy(np.concatenate(xs)) if xs else torch.zeros(0, dtype=torch.int64))
    return BatchMetadata(
        request_ids=batch.request_ids,
        input_ids=cat(ids), positions=cat(pos), slot_mapping=cat(slots),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.from_numpy(qsl),
        block_tables=padded_block_tables(tables),
        sample_indices=torch.from_numpy(qsl[1:].astype(np.int64) - 1),
        samples=list(batch.samples),
        max_query_len=max(qlens, default=0),
    )
