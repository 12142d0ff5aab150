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

Robustness on a noisy shared machine (the timing harness: benchmarks/harness.py; the timed
states: benchmarks/kv_workloads.py): times are this thread's CPU time (time the OS
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
import gc
import random
import sys
import time
from pathlib import Path

# Run as a script, sys.path[0] is benchmarks/; put the repository first so `paged` is this
# checkout's package even where the editable install is stale.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (ResidentGC, Rows, format_sweep, label, rotated, thread_ns as now,  # noqa: E402
                                write_csv)
from benchmarks.kv_workloads import (BS, PROMPT_BLOCKS, PROMPT_TOKENS, SEGMENT, USED_FRACTION,  # noqa: E402
                                     KVState, PoolState, SchedState, fill_samples)
from paged import NullRecorder, Recorder  # noqa: E402

def bench_pool(rows: Rows, sizes: list[int], rounds: int, work_blocks: int, gcm: ResidentGC,
               segment: int = SEGMENT) -> None:
    sec = "1 alloc+free / block"
    states = {}
    if gcm.mode != "on":  # the fresh path with the collector running, amortized over whole fills
        was = gc.isenabled()
        gc.enable()
        for n in sizes:
            samples: list[tuple[int, int]] = []
            while sum(b for _, b in samples) < rounds * segment:
                samples += PoolState(n, segment=segment).fill_samples
            rows.get_row(sec, "pool: fresh blocks, collector ON (amortized)", "ns").add(
                n, sum(t for t, _ in samples) / sum(b for _, b in samples))
            gc.collect()
        if not was:
            gc.disable()
    with gcm.building():
        for n in sizes:
            states[n] = PoolState(n, segment=segment)
            for v in fill_samples(lambda m: PoolState(m, segment=segment), n, states[n], rounds, segment):
                rows.get_row(sec, "pool: fresh blocks (fill to 80%, allocate only)", "ns").add(n, v)
    for r in range(rounds):
        for n in rotated(sizes, r):
            rows.get_row(sec, "pool: plain free list", "ns").add(n, states[n].cycle_plain(work_blocks))
    gc.unfreeze()
    with gcm.building():
        for n in sizes:
            states[n].make_cached_free()
    for r in range(rounds):
        for n in rotated(sizes, r):
            rows.get_row(sec, "pool: evict cached-free (LRU) + register + free", "ns").add(
                n, states[n].cycle_evict(work_blocks))
    gcm.teardown(states)


def bench_dict_reference(rows: Rows, sizes: list[int], rounds: int, work_blocks: int, gcm: ResidentGC) -> None:
    """What any hash index pays: insert a new random 64-bit key and delete the oldest one
    (FIFO, as LRU eviction does) in a dict of N entries; ns per insert+delete."""
    sec = "1 alloc+free / block"
    rng = random.Random(0)
    states = {}
    with gcm.building():
        for n in sizes:
            keys = [rng.getrandbits(64) for _ in range(n)]
            states[n] = (dict.fromkeys(keys, None), keys, 0)
    for r in range(rounds):
        for n in rotated(sizes, r):
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
    gcm.teardown(states)


def bench_kv(rows: Rows, sizes: list[int], rounds: int, work_blocks: int, gcm: ResidentGC,
             segment: int = SEGMENT) -> None:
    sec1, sec2 = "1 alloc+free / block", "2 prefix hit / block"
    pauses: dict[int, float] = {}
    for prefix, hash_fn in ((False, "sha256"), (True, "builtin"), (True, "sha256")):
        tag = f"prefix caching, {hash_fn}" if prefix else "no prefix caching"
        states = {}
        with gcm.building():
            for n in sizes:
                states[n] = KVState(n, prefix, hash_fn, segment=segment)
                for v in fill_samples(lambda m: KVState(m, prefix, hash_fn, segment=segment), n, states[n],
                                      rounds, segment):
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
            rows.notes.append("one full pass of CPython's cyclic GC (gc.collect(), wall) with that kv state "
                              "(and this process) alive: "
                              + ", ".join(f"{label(n)}: {pauses[n]:,.1f} ms" for n in sizes)
                              + " -- the collector makes such a pass whenever long-lived objects grew by 25%; "
                                "gc.freeze() after start-up (as here) takes the resident blocks out of it.")
        for r in range(rounds):
            for n in rotated(sizes, r):
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
        gcm.teardown(states)


def bench_scheduler(rows: Rows, batches: list[int], rounds: int, req_steps: int, gcm: ResidentGC) -> None:
    sec = "3 scheduler step"
    steps = {b: max(BS, req_steps // b // BS * BS) for b in batches}  # whole blocks of decode
    states = {}
    with gcm.building():
        for b in batches:
            total = steps[b] * rounds + 2 * BS
            states[b] = (SchedState(b, total, NullRecorder()), SchedState(b, total, Recorder()))
    for r in range(rounds):
        for b in rotated(batches, r):
            null, rec = states[b]
            for st, tag in ((null, "NullRecorder"), (rec, "Recorder")):
                per_step = st.steps(steps[b])
                if tag == "NullRecorder":
                    rows.get_row(sec, "schedule+update, µs / step", "us").add(b, per_step / 1e3)
                rows.get_row(sec, f"schedule+update, µs / request ({tag})", "us").add(b, per_step / 1e3 / b)
    gcm.teardown(states)


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
            out.append(f"kv evict path, {case.split(', ')[2].split(' ')[0]}: {label(hi)} - {label(lo)} = "
                       f"{row.min(hi) - row.min(lo):+,.0f} ns/block; a bare dict's random insert+delete: "
                       f"{d_ref:+,.0f} ns (cache misses in a ~{label(hi)}-entry hash index, not O(n) work)")
    return out


def run(sizes=(1_000, 100_000, 1_000_000), batches=(32, 256, 1024), rounds=15, work_blocks=4096,
        req_steps=16_384, sections=("pool", "kv", "sched"), gc_mode="freeze", segment=SEGMENT) -> Rows:
    """Run the chosen sections; `work_blocks` blocks per timed path and round, `req_steps`
    request-steps per scheduler measurement and round."""
    gcm = ResidentGC(gc_mode)
    rows = Rows()
    sizes, batches = list(sizes), list(batches)
    with gcm.session():
        if "pool" in sections:
            bench_pool(rows, sizes, rounds, work_blocks, gcm, segment)
            bench_dict_reference(rows, sizes, rounds, work_blocks, gcm)
        if "kv" in sections:
            bench_kv(rows, sizes, rounds, work_blocks, gcm, segment)
        if "sched" in sections:
            bench_scheduler(rows, batches, rounds, req_steps, gcm)
    return rows


def format_table(rows: Rows, sizes, batches) -> str:
    """Best-of-rounds values per size; ratios largest/smallest of the best and of the medians."""
    sched = lambda sec: sec.startswith("3")  # noqa: E731
    lines = format_sweep(rows, lambda sec: batches if sched(sec) else sizes,
                         lambda sec: (f"{sec} [{'µs' if sched(sec) else 'ns per block'}, best of rounds; columns: "
                                      f"{'running requests' if sched(sec) else 'pool blocks'}]"))
    rec = [r for r in rows.values() if "(Recorder)" in r.case]
    null = [r for r in rows.values() if "(NullRecorder)" in r.case]
    if rec and null:
        w = max(len(r.case) for r in rows.values()) + 2
        lines.append(f"{'  Recorder / NullRecorder':<{w}}" + "".join(f"{rec[0].min(b) / null[0].min(b):>9.2f}"
                                                                  for b in batches))
    return "\n".join(lines)


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
