"""Stateful property test of the KV-cache manager (hypothesis).

Random sequences of add / allocate / append / fork / copy-on-write write / swap out /
swap in / free / abort / prefix-hit over pools of several sizes, eviction policies and
hash functions (one of which collides on purpose). After every step:
- free + used = total, ref counts = number of tables holding each block, cached-free
  blocks = indexed blocks with ref count 0 (`check_invariants`);
- every block being written is held by one request only;
- a shadow store of token ids read back through each block table equals each
  request's computed tokens (so prefix hits, copies and swaps moved the right data);
- once every request is freed, no block is in use.

Setups where nothing fits (1 block of 1 slot) are not drawn: pools hold at least 16
token slots. Forks, copy-on-write and swaps are the rare paths, so extra rules drive them
(fork-then-write, swap round trip) and the run reports how often each happened
(`COUNTS`, shown as the test's `counts` property) and fails if one barely ran.

The machine runs in a fresh interpreter (``tests/fresh_interpreter.py``), so its derandomized
examples are the same whatever tests ran before it; ``run_machine()`` runs it in the caller's.
"""
from __future__ import annotations

import random
from collections import Counter

from hypothesis import assume, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from fresh_interpreter import run_fresh
from paged import KVCacheManager, Request
from shadow import ShadowKV


def colliding_hash(parent, token_ids, extra_keys):
    """Collides for every block with the same token sum: forces verification to work."""
    return sum(token_ids) % 3


COUNTS: Counter = Counter()  # summed over all examples of one run


class KVMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.sampled_from([3, 8, 24]), block_size=st.sampled_from([1, 2, 4, 8]),
                num_cpu_blocks=st.sampled_from([0, 8, 32]), eviction=st.sampled_from(["lru", "lfu", "weighted"]),
                hash_fn=st.sampled_from(["sha256", "builtin", colliding_hash]), seed=st.integers(0, 2**16))
    def setup(self, num_blocks, block_size, num_cpu_blocks, eviction, hash_fn, seed):
        assume(num_blocks * block_size >= 16)  # otherwise almost nothing is admitted
        self._start(KVCacheManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks, eviction=eviction,
                                   hash_fn=hash_fn, max_model_len=num_blocks * block_size), seed)

    def _start(self, kv: KVCacheManager, seed: int) -> None:
        """The machine's state around a fresh manager ``kv`` (subclasses build their own)."""
        self.kv = kv
        self.shadow = ShadowKV(self.kv)
        self.rng = random.Random(seed)
        self.on_gpu: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}
        self.history: list[list[int]] = [[1, 2, 3, 4, 5, 6, 7, 8] * 4]
        self.counter = 0

    # ---- helpers -------------------------------------------------------------------
    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def _snapshot(self):
        kv = self.kv
        return (kv.num_free_blocks, kv.num_used_blocks, kv.num_free_cpu_blocks,
                {r: kv.block_table(r) for r in self.on_gpu}, kv.pool.num_filled_slots)

    def _compute(self, req: Request, n: int, cached=()) -> bool:
        """Allocate and write n tokens; on failure the manager must be unchanged."""
        before = self._snapshot()
        copies = self.kv.allocate_slots(req, n, cached)
        COUNTS["allocate_slots"] += 1
        if copies is None:
            assert self._snapshot() == before
            COUNTS["allocate_refused"] += 1
            return False
        COUNTS["cow_copies"] += len(copies)
        if cached:
            req.num_computed_tokens = len(cached) * self.kv.block_size
        self.shadow.copy_blocks(copies)
        start = req.num_computed_tokens
        table = self.kv.block_table(req.request_id)
        bs = self.kv.block_size
        for i in range(start // bs, -(-(start + n) // bs)):  # blocks being written are exclusive
            assert self.kv.pool.blocks[table[i]].ref_cnt == 1
        assert self.shadow.holds(req.request_id, req.token_ids, start)
        self.shadow.write(req.request_id, req.token_ids, start, n)
        req.num_computed_tokens += n
        return True

    # ---- rules ---------------------------------------------------------------------
    @rule(length=st.integers(1, 40), reuse=st.booleans(), data=st.data())
    def add(self, length, reuse, data):
        """A new request; with `reuse`, its prompt starts with an earlier sequence (prefix hit)."""
        if reuse:
            base = self.rng.choice(self.history)
            cut = data.draw(st.integers(0, len(base)))
            tokens = base[:cut] + [self.rng.randrange(4) for _ in range(max(1, length - cut))]
        else:
            tokens = [self.rng.randrange(4) for _ in range(length)]
        self._add(tokens, data)

    def _add(self, tokens: list[int], data) -> None:
        req = Request(self._new_id(), tokens[:self.kv.max_model_len], max_tokens=1)
        if req.num_tokens + 1 > self.kv.max_model_len:
            return
        cached = self.kv.find_cached_prefix(req)
        assert len(cached) * self.kv.block_size < req.num_tokens  # never the whole prompt
        bs = self.kv.block_size
        for i, b in enumerate(cached):  # a hit holds K/V computed from exactly this prefix
            assert self.shadow.gpu[b.block_id] == [tuple(req.token_ids[:p + 1]) for p in range(i * bs, (i + 1) * bs)]
        n = data.draw(st.integers(1, req.num_tokens - len(cached) * self.kv.block_size))
        if self._compute(req, n, cached):
            self.on_gpu[req.request_id] = req
            self.history.append(req.token_ids)
            COUNTS["prefix_hit_blocks"] += len(cached)

    @precondition(lambda self: self.on_gpu)
    @rule(data=st.data())
    def allocate_more(self, data):
        req = self.on_gpu[data.draw(st.sampled_from(sorted(self.on_gpu)))]
        left = req.num_tokens - req.num_computed_tokens
        if left:
            self._compute(req, data.draw(st.integers(1, left)))

    @precondition(lambda self: self.on_gpu)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append_and_write(self, data, token):
        """Decode one token; if the last block is shared this is a copy-on-write."""
        req = self.on_gpu[data.draw(st.sampled_from(sorted(self.on_gpu)))]
        if req.num_computed_tokens < req.num_tokens or req.num_tokens + 1 > self.kv.max_model_len:
            return
        req.token_ids.append(token)
        if not self._compute(req, 1):
            req.token_ids.pop()

    def _fork(self, parent: Request) -> Request:
        child = Request(self._new_id(), parent.prompt_token_ids, 1)
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = 0
        self.kv.fork(parent.request_id, child.request_id)
        self.on_gpu[child.request_id] = child
        COUNTS["forks"] += 1
        return child

    @precondition(lambda self: self.on_gpu)
    @rule(data=st.data())
    def fork(self, data):
        self._fork(self.on_gpu[data.draw(st.sampled_from(sorted(self.on_gpu)))])

    @precondition(lambda self: self.on_gpu)
    @rule(data=st.data(), token=st.integers(0, 3))
    def fork_then_write(self, data, token):
        """Fork, then decode one token into the child: a copy-on-write when the last block is partial."""
        bs = self.kv.block_size
        partial = sorted(r for r, q in self.on_gpu.items() if q.num_tokens % bs)  # ends in a partial block
        parent = self.on_gpu[data.draw(st.sampled_from(partial or sorted(self.on_gpu)))]
        left = parent.num_tokens - parent.num_computed_tokens
        if parent.num_tokens + 1 > self.kv.max_model_len or (left and not self._compute(parent, left)):
            return
        child = self._fork(parent)
        child.token_ids.append(token)
        if not self._compute(child, 1):
            child.token_ids.pop()

    @precondition(lambda self: self.on_gpu and self.kv.num_cpu_blocks)
    @rule(data=st.data())
    def swap_round_trip(self, data):
        """Swap a request out and straight back in (it may land in other GPU blocks)."""
        rid = data.draw(st.sampled_from(sorted(self.on_gpu)))
        mapping = self.kv.swap_out(rid)
        if mapping is None:
            return
        self.shadow.swap_out(mapping)
        self.swapped[rid] = self.on_gpu.pop(rid)
        COUNTS["swap_outs"] += 1
        self.swap_in(data)

    @precondition(lambda self: self.on_gpu)
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(sorted(self.on_gpu)))
        before = self._snapshot()
        mapping = self.kv.swap_out(rid)
        if mapping is None:
            assert self._snapshot() == before
            return
        self.shadow.swap_out(mapping)
        self.swapped[rid] = self.on_gpu.pop(rid)
        COUNTS["swap_outs"] += 1

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        before = self._snapshot()
        mapping = self.kv.swap_in(rid)
        if mapping is None:
            assert self._snapshot() == before
            return
        self.shadow.swap_in(mapping)
        self.on_gpu[rid] = self.swapped.pop(rid)
        COUNTS["swap_ins"] += 1
        req = self.on_gpu[rid]
        assert self.shadow.holds(rid, req.token_ids, req.num_computed_tokens)

    @precondition(lambda self: self.on_gpu or self.swapped)
    @rule(data=st.data())
    def free_or_abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.on_gpu) + sorted(self.swapped)))
        self.kv.free(rid)
        self.on_gpu.pop(rid, None)
        self.swapped.pop(rid, None)

    # ---- invariants ----------------------------------------------------------------
    @invariant()
    def consistent(self):
        kv = self.kv
        kv.check_invariants()
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
        for rid, req in self.on_gpu.items():
            assert self.shadow.holds(rid, req.token_ids, req.num_computed_tokens)
        for b in kv.pool.index.values():  # hashed blocks hold what their hash claims
            assert [slot[-1] for slot in self.shadow.gpu[b.block_id]] == list(b.token_ids)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for rid in list(self.on_gpu) + list(self.swapped):
            self.kv.free(rid)
        assert self.kv.num_used_blocks == 0
        assert self.kv.num_free_cpu_blocks == self.kv.num_cpu_blocks
        self.kv.check_invariants()


def run_machine() -> dict[str, int]:
    """Run the machine (80 derandomized examples of up to 50 steps); returns the path counts."""
    COUNTS.clear()
    # derandomize (as the host-tier machine): the same examples every run, so the floors below are a fixed
    # check; randomized, about 1 run in 8 fell under a floor (e.g. 34 prefix-hit blocks)
    run_state_machine_as_test(KVMachine, settings=settings(max_examples=80, stateful_step_count=50, deadline=None,
                                                           derandomize=True, database=None))
    return dict(COUNTS)


def test_kv_manager_properties(record_property):
    # in a fresh interpreter: derandomized examples still depend on the modules loaded before
    # (tests/fresh_interpreter.py); in the suite's process this test once passed alone and failed after
    # other test files (a wrong prefix hit, tests/test_prefix_verification.py)
    counts = run_fresh("test_kv_properties", "run_machine")
    record_property("counts", counts)
    # the rare paths ran often enough to mean something; the run today: 1,321 allocate_slots, 163 CoW
    # copies, 506 forks, 172 swap-ins, 110 prefix-hit blocks (in other processes' example mixes:
    # 1,200-1,500, 85-155, 450-650, 90-340, 110-390)
    floors = {"allocate_slots": 800, "cow_copies": 40, "forks": 200, "swap_ins": 40, "prefix_hit_blocks": 40}
    assert all(counts.get(k, 0) >= v for k, v in floors.items()), counts
