"""Benchmark of the paged-KV core: is it O(1) per block and O(batch) per step?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_manager.py [--csv PATH] [--rounds N] [--gc MODE] [--quick]

Prints one table (about 20-30 s on 2 shared cores, ~1.2 GB peak), measured side by side:

1. allocate+free cost per block for pools of 1k, 100k and 1M blocks, on the raw
   `BlockPool` and through `KVCacheManager.allocate_slots` / `free` with realistic
   requests (504-token prompts = 32 blocks of 16, the last one partial). Each pool is
   first filled to 80 % by resident requests (this fill times the fresh-block path at
   scale), then each path is timed on its own: the plain free list (never-hashed
   blocks), and eviction of cached-free blocks: with prefix caching the other 20 % of
   the pool is cached-free, so at 1M every allocation evicts a block from a ~200k-block
   LRU and a ~1M-entry hash index, and the new prompt's blocks are hashed and indexed.
   A reference row times a bare dict of the same size (random-key insert + delete).
2. prefix-hit cost per cached block: `find_cached_prefix` (hashes the prompt, looks
   up and verifies 32 blocks) + `allocate_slots` with those blocks (revives them from
   the LRU) + `free`, with sha256 and the builtin hash (xxh3-128, the default,
   is timed beside nano-vllm in benchmarks/vs_nanovllm.py); the hashing alone
   is timed on the same prompts ("of which hashing").
3. the scheduler's step cost, `schedule()` + `update()`, for 32, 256 and 1024 running
   decode requests (prefix caching on, default xxh3-128: each request fills and hashes a block
   every 16 steps), per step and per request; NullRecorder and a real `Recorder`.

Robustness on a noisy shared machine: times are this thread's CPU time (time the OS
gives to other processes does not count), read once per timed run of thousands of
blocks; every measurement is repeated in rounds (15 by default) in which the sizes run one
after the other in a rotating order; the table shows the best round and the ratio
largest/smallest size of the best and of the median rounds. Absolute times are noise;
the ratios are the result: ~1.0 is O(1) per block / per request (target < 1.5).

The cyclic GC: resident state (the filled pools) is built with the collector paused and
then frozen (`gc.freeze()`, as a server does after start-up), and the timed paths run
with the collector on. One row shows the fill with the collector running, and a note
gives the pause of one full collection with the 1M-block state alive (`--gc on` runs
everything with the collector on, `--gc off` with it off).
"""
from __future__ import annotations

import argparse
import csv
import gc
import random
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# Run as a script, sys.path[0] is benchmarks/; put the repository first so `paged` is this
# checkout's package even where the editable install is stale.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paged import KVCacheManager, NullRecorder, Recorder, Request, Scheduler, SchedulerConfig
from paged.core.block_pool import BlockPool

BS = 16                       # tokens per block
PROMPT_TOKENS = 31 * BS + 8   # 504 tokens: 31 full blocks + 1 partial = 32 blocks
PROMPT_BLOCKS = -(-PROMPT_TOKENS // BS)
HIT_TOKENS = 32 * BS + 1      # 32 full blocks that can all hit + 1 token to compute
USED_FRACTION = 0.8           # resident share of each pool while the paths are timed
SEGMENT = 4096                # the fill (fresh-block path) is timed in segments of this many blocks
_BASE = [(j * 7919 + 13) % 32000 for j in range(4096)]
# CPU time of this thread: time the OS gives to other processes on this shared machine does
# not count (a wall clock would). It costs ~0.7 µs a call, so it is read once per timed run
# of thousands of blocks, never per operation.
now = time.thread_time_ns


def prompt(i: int, n: int = PROMPT_TOKENS) -> list[int]:
    """A prompt unique to `i` from its first token on (so its whole hash chain is unique)."""
    return [i] + _BASE[:n - 1]


def _label(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 and n % 1_000_000 == 0 else (
        f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n))


@dataclass
class Row:
    section: str
    case: str
    unit: str
    samples: dict[int, list[float]] = field(default_factory=dict)  # size -> one value per round
    note: str = ""

    def add(self, size: int, value: float) -> None:
        self.samples.setdefault(size, []).append(value)

    def median(self, size: int) -> float:
        return statistics.median(self.samples[size])

    def min(self, size: int) -> float:
        return min(self.samples[size])


class Rows(dict):
    """Ordered (section, case) -> Row, plus notes printed under the table."""

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[str] = []

    def get_row(self, section: str, case: str, unit: str, note: str = "") -> Row:
        key = (section, case)
        if key not in self:
            self[key] = Row(section, case, unit, note=note)
        return self[key]


# GC handling. "freeze" (default): resident state is built with the collector paused (like
# a server's start-up) and then frozen (gc.freeze(), as a long-running server can), timed
# paths run with the collector on. "on": the collector runs everywhere. "off": nowhere.
_CFG = {"gc": "freeze", "segment": SEGMENT}


@contextmanager
def building():
    was = gc.isenabled()
    if _CFG["gc"] != "on":
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        if _CFG["gc"] == "freeze":
            gc.collect()
            gc.freeze()


def teardown(states: dict) -> None:
    states.clear()
    gc.unfreeze()
    gc.collect()


def segments(samples: list[tuple[int, int]]) -> list[float]:
    """(ns, blocks) per call -> ns per block for each run of >= SEGMENT blocks."""
    seg = _CFG["segment"]
    out, t, b = [], 0, 0
    for ns, nb in samples:
        t, b = t + ns, b + nb
        if b >= seg:
            out.append(t / b)
            t = b = 0
    if not out and b:
        out.append(t / b)
    return out


def fill_samples(make, n: int, first, min_segments: int) -> list[float]:
    """Segments of the fresh-block fill of `first` (a state of `n` blocks), topped up with
    fills of throwaway states made by `make(n)` until there are `min_segments` of them."""
    samples = list(first.fill_samples)
    while sum(b for _, b in samples) < min_segments * _CFG["segment"]:
        samples += make(n).fill_samples
    return segments(samples)


def _rotated(sizes: list[int], r: int) -> list[int]:
    k = r % len(sizes)
    return sizes[k:] + sizes[:k]


# ---------------------------------------------------------------------------------------
# 1a. raw BlockPool
# ---------------------------------------------------------------------------------------
class PoolState:
    """A BlockPool filled to USED_FRACTION with hashed blocks held in use; the rest free."""

    CHUNK = PROMPT_BLOCKS

    def __init__(self, num_blocks: int, eviction: str = "lru") -> None:
        self.pool = pool = BlockPool(num_blocks, eviction=eviction)
        self.tok = tuple(range(BS))
        self.next_hash = 0
        held = int(num_blocks * USED_FRACTION)
        n_fill = 0
        self.held = []
        self.fill_samples = []  # (ns, blocks) per segment of allocations of never-used blocks
        while n_fill < held:
            t0, got = now(), 0
            while got < _CFG["segment"] and n_fill < held:
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
        self.pool.register(b, self.next_hash, self.tok, None)

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
                pool.register(b, h, tok, None)
            for b in reversed(blocks):
                pool.free(b)
        dt = now() - t0
        self.next_hash = h
        return dt / (num_blocks // k * k)


def bench_pool(rows: Rows, sizes: list[int], rounds: int, work_blocks: int) -> None:
    sec = "1 alloc+free / block"
    states = {}
    if _CFG["gc"] != "on":  # the fresh path with the collector running, amortized over whole fills
        was = gc.isenabled()
        gc.enable()
        for n in sizes:
            samples: list[tuple[int, int]] = []
            while sum(b for _, b in samples) < rounds * _CFG["segment"]:
                samples += PoolState(n).fill_samples
            rows.get_row(sec, "pool: fresh blocks, collector ON (amortized)", "ns").add(
                n, sum(t for t, _ in samples) / sum(b for _, b in samples))
            gc.collect()
        if not was:
            gc.disable()
    with building():
        for n in sizes:
            states[n] = PoolState(n)
            for v in fill_samples(PoolState, n, states[n], rounds):
                rows.get_row(sec, "pool: fresh blocks (fill to 80%, allocate only)", "ns").add(n, v)
    for r in range(rounds):
        for n in _rotated(sizes, r):
            rows.get_row(sec, "pool: plain free list", "ns").add(n, states[n].cycle_plain(work_blocks))
    gc.unfreeze()
    with building():
        for n in sizes:
            states[n].make_cached_free()
    for r in range(rounds):
        for n in _rotated(sizes, r):
            rows.get_row(sec, "pool: evict cached-free (LRU) + register + free", "ns").add(
                n, states[n].cycle_evict(work_blocks))
    teardown(states)


def bench_dict_reference(rows: Rows, sizes: list[int], rounds: int, work_blocks: int) -> None:
    """What any hash index pays: insert a new random 64-bit key and delete the oldest one
    (FIFO, as LRU eviction does) in a dict of N entries; ns per insert+delete."""
    sec = "1 alloc+free / block"
    rng = random.Random(0)
    states = {}
    with building():
        for n in sizes:
            keys = [rng.getrandbits(64) for _ in range(n)]
            states[n] = (dict.fromkeys(keys, None), keys, 0)
    for r in range(rounds):
        for n in _rotated(sizes, r):
            d, keys, head = states[n]
            new = [rng.getrandbits(64) for _ in range(work_blocks)]
            order = keys + new  # insertion order: delete from the front
            t0 = now()
            for k in new:
                d[k] = None
                del d[order[head]]
                head += 1
            dt = now() - t0
            states[n] = (d, order[head:], 0)
            rows.get_row(sec, "reference: dict insert+delete oldest, random keys", "ns").add(n, dt / work_blocks)
    teardown(states)


# ---------------------------------------------------------------------------------------
# 1b/2. KVCacheManager
# ---------------------------------------------------------------------------------------
class KVState:
    """A KVCacheManager filled to USED_FRACTION by resident requests; with prefix caching
    the rest of the pool is cached-free (hashed blocks of finished requests)."""

    def __init__(self, num_blocks: int, prefix: bool, hash_fn: str = "sha256", recorder=None) -> None:
        self.kv = kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix, hash_fn=hash_fn,
                                      recorder=recorder)
        self.prefix = prefix
        self.uid = 0
        held = int(num_blocks * USED_FRACTION) // PROMPT_BLOCKS
        self.fill_samples = []  # (ns, blocks) per segment of allocate_slots on never-used blocks
        per, left = max(1, _CFG["segment"] // PROMPT_BLOCKS), held
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
        reqs = [Request(f"h{self.uid}-{c}", self.hit_prompts[c % len(self.hit_prompts)], max_tokens=1) for c in range(cycles)]
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


def bench_kv(rows: Rows, sizes: list[int], rounds: int, work_blocks: int) -> None:
    sec1, sec2 = "1 alloc+free / block", "2 prefix hit / block"
    pauses: dict[int, float] = {}
    for prefix, hash_fn in ((False, "sha256"), (True, "builtin"), (True, "sha256")):
        tag = f"prefix caching, {hash_fn}" if prefix else "no prefix caching"
        states = {}
        with building():
            for n in sizes:
                states[n] = KVState(n, prefix, hash_fn)
                for v in fill_samples(lambda m: KVState(m, prefix, hash_fn), n, states[n], rounds):
                    rows.get_row(sec1, f"kv: fresh blocks (fill to 80%, allocate_slots only), {tag}", "ns").add(n, v)
                if prefix and hash_fn == "builtin":  # what one full pass of the cyclic GC costs now
                    gc.collect()
                    t0 = time.perf_counter_ns()
                    gc.collect()
                    pauses[n] = (time.perf_counter_ns() - t0) / 1e6
        if prefix and hash_fn == "builtin":
            pool = states[sizes[-1]].kv.pool
            rows.notes.append(f"kv pool of {sizes[-1]:,} blocks while timed: {pool.num_used:,} in use, "
                              f"{len(pool.cached_free):,} cached-free in the LRU, {len(pool.index):,} index entries.")
            rows.notes.append("one full pass of CPython's cyclic GC (gc.collect(), wall) with that kv state (and this process) alive: "
                              + ", ".join(f"{_label(n)}: {pauses[n]:,.1f} ms" for n in sizes)
                              + " -- the collector makes such a pass whenever long-lived objects grew by 25%; "
                                "gc.freeze() after start-up (as here) takes the resident blocks out of it.")
        for r in range(rounds):
            for n in _rotated(sizes, r):
                st = states[n]
                if not prefix:
                    rows.get_row(sec1, "kv: allocate_slots+free, plain free list", "ns").add(
                        n, st.cycle_plain(work_blocks))
                    continue
                rows.get_row(sec1, f"kv: allocate_slots+free, evict cached-free, {hash_fn} (incl. hash+index)",
                             "ns").add(n, st.cycle_evict(work_blocks))
                hit, hashing = st.cycle_hit(work_blocks)
                rows.get_row(sec2, f"hit: find+allocate_slots+free, {hash_fn}", "ns").add(n, hit)
                rows.get_row(sec2, f"  of which hashing ({hash_fn})", "ns").add(n, hashing)
        if prefix:  # derived from the best runs (two runs' noise would not cancel)
            hit, hashing = rows[(sec2, f"hit: find+allocate_slots+free, {hash_fn}")], \
                rows[(sec2, f"  of which hashing ({hash_fn})")]
            for n in sizes:
                rows.get_row(sec2, f"  excluding hashing ({hash_fn}) = best - best", "ns").add(
                    n, hit.min(n) - hashing.min(n))
        teardown(states)


# ---------------------------------------------------------------------------------------
# 3. Scheduler
# ---------------------------------------------------------------------------------------
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


def bench_scheduler(rows: Rows, batches: list[int], rounds: int, req_steps: int) -> None:
    sec = "3 scheduler step"
    steps = {b: max(BS, req_steps // b // BS * BS) for b in batches}  # whole blocks of decode
    states = {}
    with building():
        for b in batches:
            total = steps[b] * rounds + 2 * BS
            states[b] = (SchedState(b, total, NullRecorder()), SchedState(b, total, Recorder()))
    for r in range(rounds):
        for b in _rotated(batches, r):
            null, rec = states[b]
            for st, tag in ((null, "NullRecorder"), (rec, "Recorder")):
                per_step = st.steps(steps[b])
                if tag == "NullRecorder":
                    rows.get_row(sec, "schedule+update, µs / step", "us").add(b, per_step / 1e3)
                rows.get_row(sec, f"schedule+update, µs / request ({tag})", "us").add(b, per_step / 1e3 / b)
    teardown(states)


# ---------------------------------------------------------------------------------------
def run(sizes=(1_000, 100_000, 1_000_000), batches=(32, 256, 1024), rounds=15, work_blocks=4096,
        req_steps=16_384, sections=("pool", "kv", "sched"), gc_mode="freeze", segment=SEGMENT) -> Rows:
    """Run the chosen sections; `work_blocks` blocks per timed path and round, `req_steps`
    request-steps per scheduler measurement and round."""
    if gc_mode not in ("freeze", "on", "off"):
        raise ValueError(f"gc_mode must be 'freeze', 'on' or 'off', got {gc_mode!r}")
    rows = Rows()
    sizes, batches = list(sizes), list(batches)
    _CFG["gc"], _CFG["segment"] = gc_mode, segment
    was = gc.isenabled()
    if gc_mode == "off":
        gc.disable()
    try:
        _run(rows, sizes, batches, rounds, work_blocks, req_steps, sections)
    finally:
        if was:
            gc.enable()
    return rows


def _run(rows, sizes, batches, rounds, work_blocks, req_steps, sections) -> None:
    if "pool" in sections:
        bench_pool(rows, sizes, rounds, work_blocks)
        bench_dict_reference(rows, sizes, rounds, work_blocks)
    if "kv" in sections:
        bench_kv(rows, sizes, rounds, work_blocks)
    if "sched" in sections:
        bench_scheduler(rows, batches, rounds, req_steps)


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.2f}" if v < 10 else f"{v:.1f}"


def format_table(rows: Rows, sizes, batches) -> str:
    """Best-of-rounds values per size; ratios largest/smallest of the best and of the medians."""
    lines = []
    sections = list(dict.fromkeys(r.section for r in rows.values()))
    w = max(len(r.case) for r in rows.values()) + 2
    for sec in sections:
        cols = list(batches) if sec.startswith("3") else list(sizes)
        unit = "µs" if sec.startswith("3") else "ns per block"
        what = "running requests" if sec.startswith("3") else "pool blocks"
        hdr = f"{sec} [{unit}, best of rounds; columns: {what}]"
        ratio = f"{_label(cols[-1])}/{_label(cols[0])}"
        lines.append("")
        lines.append(f"{hdr:<{w}}" + "".join(f"{_label(c):>9}" for c in cols) + f"{ratio:>9}{'(median)':>10}")
        lines.append("-" * (w + 9 * len(cols) + 19))
        for row in rows.values():
            if row.section != sec:
                continue
            best = [row.min(c) if c in row.samples else float("nan") for c in cols]
            med = [row.median(c) if c in row.samples else float("nan") for c in cols]
            r_best = best[-1] / best[0] if best[0] > 0 else float("nan")
            r_med = med[-1] / med[0] if med[0] > 0 else float("nan")
            lines.append(f"{row.case:<{w}}" + "".join(f"{_fmt(v):>9}" for v in best)
                         + f"{r_best:>9.2f}{r_med:>10.2f}")
    rec = [r for r in rows.values() if "(Recorder)" in r.case]
    null = [r for r in rows.values() if "(NullRecorder)" in r.case]
    if rec and null:
        over = [rec[0].min(b) / null[0].min(b) for b in batches]
        lines.append(f"{'  Recorder / NullRecorder':<{w}}" + "".join(f"{o:>9.2f}" for o in over))
    return "\n".join(lines)


def explain(rows: Rows, sizes) -> list[str]:
    """Put the eviction path's growth next to what a bare dict of the same size pays."""
    ref = rows.get(("1 alloc+free / block", "reference: dict insert+delete oldest, random keys"))
    if ref is None or len(sizes) < 2:
        return []
    lo, hi = sizes[0], sizes[-1]
    d_ref = ref.min(hi) - ref.min(lo)
    out = []
    for (sec, case), row in rows.items():
        if "evict cached-free, " in case and lo in row.samples and hi in row.samples:
            out.append(f"kv evict path, {case.split(', ')[2].split(' ')[0]}: {_label(hi)} - {_label(lo)} = "
                       f"{row.min(hi) - row.min(lo):+,.0f} ns/block; a bare dict's random insert+delete: "
                       f"{d_ref:+,.0f} ns (cache misses in a ~{_label(hi)}-entry hash index, not O(n) work)")
    return out


def write_csv(rows: Rows, path: str) -> None:
    with open(path, "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["section", "case", "unit", "size", "median", "min", "rounds"])
        for row in rows.values():
            for size in row.samples:
                wr.writerow([row.section, row.case, row.unit, size, f"{row.median(size):.4g}",
                             f"{row.min(size):.4g}", len(row.samples[size])])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", help="also write every measurement (median and min per size) to this CSV file")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds per measurement (default 15)")
    ap.add_argument("--gc", choices=("freeze", "on", "off"), default="freeze",
                    help="freeze (default): resident state built with the collector paused, then gc.freeze(); "
                         "on: collector always on; off: always off")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, well under a second (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        sizes, batches, kw = [512, 4096], [4, 16], dict(rounds=2, work_blocks=512, req_steps=256, segment=512)
    else:
        sizes, batches, kw = [1_000, 100_000, 1_000_000], [32, 256, 1024], dict(rounds=args.rounds)
    t0 = time.perf_counter()
    rows = run(sizes, batches, gc_mode=args.gc, **kw)
    print(f"paged-KV core benchmark: block_size={BS}, prompts of {PROMPT_TOKENS} tokens ({PROMPT_BLOCKS} blocks), "
          f"pools {USED_FRACTION:.0%} resident; thread CPU time, best and median of {kw['rounds']} interleaved "
          f"rounds; NullRecorder unless noted; gc={args.gc}")
    print(format_table(rows, sizes, batches))
    print()
    print(f"ratios: largest / smallest size, of the best and of the median rounds; target < 1.5 "
          f"(O(1) per block, flat per request). Absolute times on a shared machine are noise.")
    for note in rows.notes + explain(rows, sizes):
        print(note)
    if args.gc != "on":
        print("'collector ON': the same fill with the cyclic GC running: it re-walks the growing heap of Block "
              "objects in full collections; every other row runs with the resident state frozen (--gc on: not).")
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
