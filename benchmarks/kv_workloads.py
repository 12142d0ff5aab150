"""The resident states the paged-KV core benchmarks time against, shared by
benchmarks/kv_manager.py and benchmarks/vs_nanovllm.py: a filled ``BlockPool``, a filled
``KVCacheManager`` (its fresh, plain, eviction and prefix-hit paths) and a scheduler whose
batch is in steady decode. Every timed method returns nanoseconds of this thread's CPU time
per block (or per step), read once per timed run (``benchmarks.harness``).
"""
from __future__ import annotations

from typing import Callable

from benchmarks.harness import per_unit, thread_ns as now
from paged import KVCacheManager, Request, Scheduler, SchedulerConfig
from paged.core.block_pool import BlockPool

BS = 16                       # tokens per block
PROMPT_TOKENS = 31 * BS + 8   # 504 tokens: 31 full blocks + 1 partial = 32 blocks
PROMPT_BLOCKS = -(-PROMPT_TOKENS // BS)
HIT_TOKENS = 32 * BS + 1      # 32 full blocks that can all hit + 1 token to compute
USED_FRACTION = 0.8           # resident share of each pool while the paths are timed
SEGMENT = 4096                # the fill (fresh-block path) is timed in segments of this many blocks
_BASE = [(j * 7919 + 13) % 32000 for j in range(1 << 14)]


def prompt(i: int, n: int = PROMPT_TOKENS) -> list[int]:
    """A prompt unique to `i` from its first token on (so its whole hash chain is unique)."""
    return [i] + _BASE[:n - 1]


def fill_samples(make: Callable[[int], object], n: int, first, min_segments: int, segment: int = SEGMENT
                 ) -> list[float]:
    """ns per block of each fill segment of `first` (a state of `n` blocks), topped up with fills
    of throwaway states made by `make(n)` until there are `min_segments` segments."""
    samples = list(first.fill_samples)
    while sum(b for _, b in samples) < min_segments * segment:
        samples += make(n).fill_samples
    return per_unit(samples, segment)


class PoolState:
    """A BlockPool filled to USED_FRACTION with hashed blocks held in use; the rest free."""

    CHUNK = PROMPT_BLOCKS

    def __init__(self, num_blocks: int, eviction: str = "lru", segment: int = SEGMENT) -> None:
        self.pool = pool = BlockPool(num_blocks, eviction=eviction)
        self.tok = tuple(range(BS))
        self.next_hash = 0
        held = int(num_blocks * USED_FRACTION)
        n_fill = 0
        self.held = []
        self.fill_samples = []  # (ns, blocks) per segment of allocations of never-used blocks
        while n_fill < held:
            t0, got = now(), 0
            while got < segment and n_fill < held:
                k = min(self.CHUNK, held - n_fill)
                self.held.append(pool.allocate(k))
                n_fill += k
                got += k
            self.fill_samples.append((now() - t0, got))
        for blocks in self.held:  # resident blocks are hashed too: the index holds ~every block
            for b in blocks:
                self._register(b)

    def _register(self, b) -> None:
        self.next_hash += 1
        self.pool.register(b, self.next_hash, self.tok)

    def cycle_plain(self, num_blocks: int) -> float:
        """allocate CHUNK never-hashed blocks, free them (tail first); ns per block."""
        pool, k = self.pool, self.CHUNK
        t0 = now()
        for _ in range(num_blocks // k):
            blocks = pool.allocate(k)
            for b in reversed(blocks):
                pool.free(b)
        return (now() - t0) / (num_blocks // k * k)

    def make_cached_free(self) -> None:
        """Turn every free block into a cached-free (hashed) one, so allocation must evict."""
        pool = self.pool
        blocks = pool.allocate(pool.num_free)
        for b in blocks:
            self._register(b)
        for b in reversed(blocks):
            pool.free(b)

    def cycle_evict(self, num_blocks: int) -> float:
        """allocate CHUNK blocks evicting cached-free ones (each drops its hash), register a
        new hash on each, free them (tail first) back into the LRU; ns per block."""
        pool, k, tok = self.pool, self.CHUNK, self.tok
        h = self.next_hash
        t0 = now()
        for _ in range(num_blocks // k):
            blocks = pool.allocate(k)
            for b in blocks:
                h += 1
                pool.register(b, h, tok)
            for b in reversed(blocks):
                pool.free(b)
        dt = now() - t0
        self.next_hash = h
        return dt / (num_blocks // k * k)


class KVState:
    """A KVCacheManager filled to USED_FRACTION by resident requests; with prefix caching
    the rest of the pool is cached-free (hashed blocks of finished requests)."""

    def __init__(self, num_blocks: int, prefix: bool, hash_fn: str = "sha256", recorder=None,
                 segment: int = SEGMENT) -> None:
        self.kv = kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix, hash_fn=hash_fn,
                                      recorder=recorder)
        self.prefix = prefix
        self.uid = 0
        held = int(num_blocks * USED_FRACTION) // PROMPT_BLOCKS
        self.fill_samples = []  # (ns, blocks) per segment of allocate_slots on never-used blocks
        per, left = max(1, segment // PROMPT_BLOCKS), held
        while left:
            reqs = [self.new_request() for _ in range(min(per, left))]
            t0 = now()
            for req in reqs:
                kv.allocate_slots(req, PROMPT_TOKENS)
            self.fill_samples.append((now() - t0, len(reqs) * PROMPT_BLOCKS))
            left -= len(reqs)
        assert kv.num_used_blocks == held * PROMPT_BLOCKS
        if prefix:  # finished requests leave the rest of the pool cached-free
            rids = []
            while kv.num_free_blocks >= PROMPT_BLOCKS:
                req = self.new_request()
                kv.allocate_slots(req, req.num_tokens)
                rids.append(req.request_id)
            for rid in rids:
                kv.free(rid)
        # prompts for the prefix-hit path: up to four prompts of 32 full blocks (+1 token),
        # as many as the free part of the pool keeps cached twice over
        n_hit = max(1, min(4, (num_blocks - held * PROMPT_BLOCKS) // (2 * (HIT_TOKENS // BS + 1))))
        self.hit_prompts = [prompt(1_000_000_000 + h, HIT_TOKENS) for h in range(n_hit)]
        # a reusable request for the plain path (prefix caching off: no state kept by rid)
        self.plain_req = Request("plain", prompt(0), max_tokens=1)

    def new_request(self, n: int = PROMPT_TOKENS) -> Request:
        self.uid += 1
        return Request(f"r{self.uid}", prompt(self.uid, n), max_tokens=1)

    def cycle_plain(self, num_blocks: int) -> float:
        """allocate_slots(prompt) + free with prefix caching off; ns per block."""
        kv, req = self.kv, self.plain_req
        cycles = max(1, num_blocks // PROMPT_BLOCKS)
        t0 = now()
        for _ in range(cycles):
            kv.allocate_slots(req, PROMPT_TOKENS)
            kv.free("plain")
        return (now() - t0) / (cycles * PROMPT_BLOCKS)

    def cycle_evict(self, num_blocks: int) -> float:
        """allocate_slots + free of new unique prompts: every block evicts a cached-free one,
        the 31 full blocks are hashed and indexed, and become cached-free again; ns per block."""
        kv = self.kv
        cycles = max(1, num_blocks // PROMPT_BLOCKS)
        reqs = [self.new_request() for _ in range(cycles)]
        t0 = now()
        for req in reqs:
            kv.allocate_slots(req, PROMPT_TOKENS)
            kv.free(req.request_id)
        return (now() - t0) / (cycles * PROMPT_BLOCKS)

    def cycle_hit(self, num_blocks: int) -> tuple[float, float]:
        """find_cached_prefix + allocate_slots(cached) + free for prompts whose 32 full
        blocks are cached-free. Returns (ns per hit block, hashing ns per hit block)."""
        kv = self.kv
        for p in self.hit_prompts:  # warm-up (untimed): make sure the prompts are cached
            self.uid += 1
            req = Request(f"w{self.uid}", p, max_tokens=1)
            cached = kv.find_cached_prefix(req)
            kv.allocate_slots(req, req.num_tokens - len(cached) * BS, cached)
            kv.free(req.request_id)
        cycles = max(1, num_blocks // 32)
        reqs = [Request(f"h{self.uid}-{c}", self.hit_prompts[c % len(self.hit_prompts)], max_tokens=1)
                for c in range(cycles)]
        self.uid += 1
        hits = 0
        t0 = now()
        for req in reqs:
            cached = kv.find_cached_prefix(req)
            kv.allocate_slots(req, HIT_TOKENS - len(cached) * BS, cached)
            kv.free(req.request_id)
            hits += len(cached)
        t_hit = now() - t0
        assert hits == cycles * 32, f"expected every block to hit, got {hits} of {cycles * 32}"
        hasher = kv.hasher
        t0 = now()
        for req in reqs:
            hasher.extend([], req.token_ids, req.extra_keys, HIT_TOKENS)
        t_hash = now() - t0
        return t_hit / hits, t_hash / hits


class SchedState:
    """`batch` requests in steady decode (prefill done), with room for `max_steps` more tokens."""

    PROMPT = 100

    def __init__(self, batch: int, max_steps: int, recorder=None) -> None:
        total = self.PROMPT + max_steps + 4
        num_blocks = batch * -(-total // BS) + 64
        kv = KVCacheManager(num_blocks, BS, recorder=recorder)
        self.sched = s = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=batch))
        self.recorder = kv.recorder
        for i in range(batch):
            s.add_request(Request(f"d{i}", prompt(i, self.PROMPT), max_tokens=max_steps + 4))
        self.sampled = {f"d{i}": 7 for i in range(batch)}
        while True:  # prefill until everyone decodes
            out = s.schedule()
            s.update(out, self.sampled)
            if len(s.running) == batch and all(c.num_tokens == 1 for c in out.scheduled) and \
                    len(out.scheduled) == batch:
                break
        self.batch = batch

    def steps(self, n: int) -> float:
        """ns per step of schedule() + update()."""
        s, sampled = self.sched, self.sampled
        self.recorder.clear()  # a real Recorder would otherwise grow across rounds
        t0 = now()
        for _ in range(n):
            s.update(s.schedule(), sampled)
        dt = now() - t0
        assert len(s.running) == self.batch
        return dt / n
