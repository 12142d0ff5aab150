"""Snapshots: what a view may draw of a KV cache at one moment, as numpy arrays.

`KVCacheManager.snapshot()` returns a `KVSnapshot` with one entry per physical block and one
per request holding (or waiting for) blocks; `ContiguousKVCacheManager.snapshot()` returns a
`ContiguousSnapshot` (reserved vs filled slots per request) so paged and contiguous allocation
can be drawn side by side. Snapshots copy: later steps never change one already taken.

Invariants of a `KVSnapshot` (tested):
- `state[b]` is one of the `STATE_*` codes; FREE iff ref_count 0 and not hashed, CACHED iff
  ref_count 0 and hashed, SHARED iff ref_count > 1, WRITING iff block b is in `writing` and in use;
- `owner[b]` is the index (into `request_ids`) of the first request whose table holds b, or -1;
  `logical[b]` is b's position in that table (-1 when unowned);
- request r's table is `table_blocks[table_indptr[r]:table_indptr[r + 1]]` (CSR, int32).
Cost: one pass over created blocks per attribute plus one over table entries (no per-block
state is added to the pool's hot path).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Iterable, Mapping, Protocol

import numpy as np

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .events import Recorder


class PagedCache(Protocol):
    """What a snapshot reads of a paged KV manager (``KVCacheManager``): public queries only."""

    pool: "BlockPool"
    block_size: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    recorder: "Recorder"

    def request_ids(self) -> list[str]: ...
    def swapped_request_ids(self) -> list[str]: ...
    def block_table(self, request_id: str) -> list[int]: ...
    def num_swapped_blocks(self, request_id: str) -> int: ...
    def has(self, request_id: str) -> bool: ...

STATE_FREE, STATE_CACHED, STATE_USED, STATE_SHARED, STATE_WRITING, STATE_RESERVED = range(6)
STATE_NAMES = ("free", "cached-free", "in use", "shared (ref>1)", "written this step", "reserved, empty")
STATUS_RUNNING, STATUS_WAITING, STATUS_SWAPPED, STATUS_FINISHED = range(4)
STATUS_NAMES = ("running", "waiting", "swapped", "finished")
_STATUS = {"running": STATUS_RUNNING, "waiting": STATUS_WAITING, "swapped": STATUS_SWAPPED}


def hash_key(h) -> int:
    """A 32-bit display key of a block hash (bytes or int): what hover text shows in hex."""
    if h is None:
        return 0
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(bytes(h[:4]), "big")
    return hash(h) & 0xFFFFFFFF


@dataclass
class KVSnapshot:
    """One moment of a paged cache (see module docstring for the invariants)."""

    step: int
    block_size: int
    # per physical block
    state: np.ndarray          # int8, STATE_* codes
    ref_count: np.ndarray      # int32
    owner: np.ndarray          # int32 index into request_ids, -1 = none
    logical: np.ndarray        # int32 index in the owner's table, -1 = none
    filled: np.ndarray         # int16/int32 slots holding tokens (0 for free blocks)
    hashed: np.ndarray         # bool
    hash_key: np.ndarray       # uint32 display key of the hash (0 = none)
    last_use: np.ndarray       # int32 step of last allocation or use (-1 = never used)
    # per request
    request_ids: list[str]
    status: np.ndarray         # int8 STATUS_* codes
    num_computed: np.ndarray   # int32
    num_tokens: np.ndarray     # int32
    num_prompt: np.ndarray     # int32
    table_indptr: np.ndarray   # int32, len(request_ids) + 1
    table_blocks: np.ndarray   # int32 block ids
    # CPU pool (swap)
    num_cpu_blocks: int = 0
    num_cpu_used: int = 0
    cpu_blocks_of: dict[str, int] = field(default_factory=dict)
    # optional token ids (with_tokens=True): request tokens (CSR) and cached-free blocks' tokens
    token_indptr: np.ndarray | None = None
    token_ids: np.ndarray | None = None
    cached_tokens: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return len(self.state)

    def table(self, r: int | str) -> np.ndarray:
        """Block table of request index (or id) `r`."""
        i = self.request_ids.index(r) if isinstance(r, str) else r
        return self.table_blocks[self.table_indptr[i]:self.table_indptr[i + 1]]

    def counts(self) -> dict[str, int]:
        """Blocks per state name."""
        c = np.bincount(self.state, minlength=len(STATE_NAMES))
        return {n: int(c[i]) for i, n in enumerate(STATE_NAMES)}

    def block_tokens(self, block_id: int) -> tuple[int, ...] | None:
        """Token ids held by a block (None when tokens were not snapshotted or the block is free)."""
        if block_id in self.cached_tokens:
            return self.cached_tokens[block_id]
        r = int(self.owner[block_id])
        if r < 0 or self.token_ids is None:
            return None
        lo = self.token_indptr[r] + int(self.logical[block_id]) * self.block_size
        return tuple(int(t) for t in self.token_ids[lo:lo + int(self.filled[block_id])])

    def holders(self, block_id: int) -> list[str]:
        """Every request whose table holds `block_id` (O(table entries))."""
        rows = np.searchsorted(self.table_indptr, np.flatnonzero(self.table_blocks == block_id), side="right") - 1
        return [self.request_ids[int(i)] for i in rows]


def take_snapshot(kv: PagedCache, requests: Mapping | None = None, *, step: int | None = None,
                  writing: Iterable[int] = (), last_use: np.ndarray | None = None,
                  with_tokens: bool = False, block_range: tuple[int, int] | None = None) -> KVSnapshot:
    """Build a `KVSnapshot` of `kv`. `requests`: id -> Request (e.g. `scheduler.requests`) for
    status, progress and tokens; `writing`: blocks written by the step just planned;
    `last_use`: a per-block step array kept by the caller (else allocation steps);
    `block_range=(lo, hi)`: read per-block state only there (a view drawing one page of a
    large pool); blocks outside it read as free. Tables, owners and requests are always whole."""
    pool = kv.pool
    n = pool.num_blocks
    lo, hi = (0, n) if block_range is None else (max(0, block_range[0]), min(n, block_range[1]))
    live = pool.blocks[lo:max(lo, min(hi, pool.num_created))]  # created blocks; the rest were never used
    m = len(live)
    ref, filled = np.zeros(n, np.int32), np.zeros(n, np.int32)
    hashed, hkey = np.zeros(n, bool), np.zeros(n, np.uint32)
    used_at = np.full(n, -1, np.int32)
    ref[lo:lo + m] = np.fromiter(map(attrgetter("ref_cnt"), live), np.int32, m)
    filled[lo:lo + m] = np.fromiter(map(attrgetter("num_filled"), live), np.int32, m)
    hashes = list(map(attrgetter("block_hash"), live))
    hashed[lo:lo + m] = np.fromiter((h is not None for h in hashes), bool, m)
    for i in np.flatnonzero(hashed[lo:lo + m]):
        hkey[lo + i] = hash_key(hashes[i])
    used_at[lo:lo + m] = np.fromiter(map(attrgetter("alloc_step"), live), np.int32, m)
    filled[(ref == 0) & ~hashed] = 0
    state = np.full(n, STATE_FREE, np.int8)
    state[(ref == 0) & hashed] = STATE_CACHED
    state[ref == 1] = STATE_USED
    state[ref > 1] = STATE_SHARED
    w = np.fromiter(writing, np.int64)
    state[w[ref[w] > 0]] = STATE_WRITING
    # per request: tables (GPU), swapped, waiting
    reqs = requests or {}
    tables = {r: kv.block_table(r) for r in kv.request_ids()}
    swapped = {r: kv.num_swapped_blocks(r) for r in kv.swapped_request_ids()}
    ids = list(tables)
    ids += [r for r in swapped if r not in tables]
    ids += [r for r, q in reqs.items() if r not in tables and r not in swapped]
    lens = np.fromiter((len(tables.get(r, ())) for r in ids), np.int32, len(ids))
    indptr = np.zeros(len(ids) + 1, np.int32)
    np.cumsum(lens, out=indptr[1:])
    blocks = np.fromiter((b for r in ids for b in tables.get(r, ())), np.int32, int(indptr[-1]))
    owner, logical = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
    rows = np.repeat(np.arange(len(ids), dtype=np.int32), lens)
    pos = np.arange(len(blocks), dtype=np.int32) - indptr[rows]
    first = np.unique(blocks, return_index=True)[1]  # each block's first holder
    owner[blocks[first]] = rows[first]
    logical[blocks[first]] = pos[first]
    step = kv.recorder.step if step is None else step
    if last_use is not None:
        used_at = np.maximum(used_at, last_use[:n].astype(np.int32))
    status = np.empty(len(ids), np.int8)
    computed, ntok, nprompt = (np.zeros(len(ids), np.int32) for _ in range(3))
    for i, r in enumerate(ids):
        q = reqs.get(r)
        if q is None:
            status[i] = STATUS_SWAPPED if r in swapped else STATUS_RUNNING
            continue
        status[i] = _STATUS.get(q.status.value, STATUS_FINISHED)
        computed[i], ntok[i], nprompt[i] = q.num_computed_tokens, q.num_tokens, q.num_prompt_tokens
    used_at[blocks[np.repeat(status == STATUS_RUNNING, lens)]] = step
    snap = KVSnapshot(step, kv.block_size, state, ref, owner, logical, filled, hashed, hkey, used_at,
                      ids, status, computed, ntok, nprompt, indptr, blocks,
                      kv.num_cpu_blocks, kv.num_cpu_blocks - kv.num_free_cpu_blocks, swapped)
    if with_tokens:
        toks = [reqs[r].token_ids if r in reqs else () for r in ids]
        tl = np.fromiter((len(t) for t in toks), np.int64, len(toks))
        snap.token_indptr = np.concatenate([[0], np.cumsum(tl)]).astype(np.int64)
        snap.token_ids = np.fromiter((t for ts in toks for t in ts), np.int32, int(tl.sum()))
        for i in np.flatnonzero(state[lo:lo + m] == STATE_CACHED):
            snap.cached_tokens[lo + int(i)] = tuple(live[i].token_ids or ())
    return snap


@dataclass
class ContiguousSnapshot:
    """One moment of a contiguous cache: per request one reservation [start, start + reserved)
    of which the first `filled` slots hold tokens. Reservations and holes tile the capacity."""

    step: int
    capacity_tokens: int
    request_ids: list[str]
    start: np.ndarray      # int64
    reserved: np.ndarray   # int64
    filled: np.ndarray     # int64

    @property
    def num_reserved(self) -> int:
        return int(self.reserved.sum())

    @property
    def num_filled(self) -> int:
        return int(self.filled.sum())

    def cell_states(self, cell_tokens: int) -> np.ndarray:
        """State per cell of `cell_tokens` slots (like a block): FREE, RESERVED (reserved,
        no token yet), USED (holds a token). A cell takes the strongest state of its slots."""
        slots = np.zeros(-(-self.capacity_tokens // cell_tokens) * cell_tokens, np.int8)
        for s, r, f in zip(self.start.tolist(), self.reserved.tolist(), self.filled.tolist()):
            slots[s:s + r] = 1
            slots[s:s + f] = 2
        level = slots.reshape(-1, cell_tokens).max(axis=1)
        return np.array([STATE_FREE, STATE_RESERVED, STATE_USED], np.int8)[level]


def written_blocks(kv: PagedCache, chunks: Iterable) -> list[int]:
    """Blocks that the chunks of a plan (``ScheduledChunk``: request id, start, num_tokens and
    the request's ``blocks``) write, for requests that still hold their blocks in ``kv``."""
    bs, out = kv.block_size, []
    for c in chunks:
        if c.num_tokens and kv.has(c.request_id):
            out.extend(b.block_id for b in c.blocks[c.start // bs:(c.start + c.num_tokens - 1) // bs + 1])
    return out
