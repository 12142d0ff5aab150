"""Block ids travel in the plan: every chunk the scheduler plans carries its request's block table
(``Batch.tables``, seen as ``ScheduledChunk.blocks``) exactly as the KV manager holds it when the plan
is handed over, through forks (copy-on-write), prefix hits, preemption by swap and recompute,
block compaction and the host tier; and the runner's batch built from the plan alone is the
batch built from the manager's tables."""
from __future__ import annotations

import random

import numpy as np
import pytest

from paged import KVCacheManager, Request, Scheduler, SchedulerConfig
from paged.core.plan import Batch, ScheduledChunk
from paged.engine.batch import build_batch, slot_mapping


def _run(seed: int, block_size: int, host_tier: bool, compaction: bool) -> int:
    """Drive a mixed workload; check each plan against the manager. Returns chunks checked."""
    rng = random.Random(seed)
    kv = KVCacheManager(-(-160 // block_size), block_size, num_cpu_blocks=12, host_tier=host_tier)
    s = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=10,
                                      preemption_mode=rng.choice(["recompute", "swap"]),
                                      enable_block_compaction=compaction, compaction_threshold=0.0,
                                      compaction_interval=3))
    system = [rng.randrange(30) for _ in range(2 * block_size + 3)]
    reqs = [Request(f"r{i}", (system if i % 2 else []) + [rng.randrange(30) for _ in range(rng.randint(1, 25))],
                    max_tokens=rng.randint(1, 30)) for i in range(20)]
    checked = forks = 0
    for step in range(3000):
        if reqs and step % 2 == 0:
            s.add_request(reqs.pop(0))
        if not s.has_unfinished_requests() and not reqs:
            break
        out = s.schedule()
        b = out.batch
        assert len(b.tables) == len(b.requests) == len(b.starts) == len(b.num_tokens) == len(b.samples)
        assert all(t is kv.blocks_of(r.request_id) for r, t in zip(b.requests, b.tables))  # a reference
        for c in out.scheduled:
            assert c.block_ids == kv.block_table(c.request_id), (step, c)
            checked += 1
        if out.scheduled:
            from_plan = build_batch(out.batch, block_size)
            tables = [kv.block_table(c.request_id) for c in out.scheduled]
            expect = np.concatenate([slot_mapping(t, c.start, c.num_tokens, block_size)
                                     for t, c in zip(tables, out.scheduled)])
            assert from_plan.slot_mapping.tolist() == expect.tolist()
        s.update(out, {c.request_id: rng.randrange(30) for c in out.scheduled if c.samples})
        running = [r for r in s.running if r.num_computed_tokens < r.num_tokens]
        if running and forks < 5 and step % 5 == 2:
            forks += 1
            s.fork(running[0].request_id, f"f{forks}")
        kv.check_invariants()
    assert not s.has_unfinished_requests()
    return checked


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunks_carry_the_managers_tables(seed, block_size):
    assert _run(seed, block_size, host_tier=False, compaction=False) > 100


def test_chunks_carry_the_tables_with_compaction_and_the_host_tier():
    assert _run(3, 4, host_tier=True, compaction=True) > 100


def test_a_hand_made_chunk_has_no_table():
    r = Request("a", [1, 2, 3])
    assert ScheduledChunk(r, 0, 3, True).block_ids == []
    b = Batch()
    b.starts.append(2)
    b.tables.append(())
    b.add_decodes([r], 1)
    assert b.chunks() == [ScheduledChunk(r, 2, 1, True)]
    assert not b.is_decode(0)  # position 2 is the prompt's last token: prefill, although one token long
    assert b.num_decode_tokens == 0 and b.num_batched_tokens == 1
