"""A shadow executor for tests: it stores, per slot, the whole prefix that produced it.

Real K/V at position p depends on tokens 0..p, so each shadow slot holds that tuple.

Applying a plan exactly as a runner must (compaction_copies, tier_out, swap_out, block_copies,
swap_in, tier_in, then writing the scheduled tokens through the slot mapping) and then reading
back a request's whole
context through its block table checks that the manager and scheduler never hand out
a block whose contents are wrong: a bad copy-on-write, prefix hit, swap mapping or
write order shows up as a wrong token.
"""
from __future__ import annotations

from paged import KVCacheManager
from paged.core.scheduler import SchedulerOutput


class ShadowKV:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        bs = kv.block_size
        self.gpu: list[list[int | None]] = [[None] * bs for _ in range(kv.num_blocks)]
        self.cpu: list[list[int | None]] = [[None] * bs for _ in range(kv.num_cpu_blocks)]

    def copy_blocks(self, pairs) -> None:
        for src, dst in pairs:
            self.gpu[dst] = list(self.gpu[src])

    def swap_out(self, pairs) -> None:
        for g, c in pairs:
            self.cpu[c] = list(self.gpu[g])

    def swap_in(self, pairs) -> None:
        for c, g in pairs:
            self.gpu[g] = list(self.cpu[c])

    def write(self, request_id: str, token_ids, start: int, n: int) -> None:
        """Compute positions [start, start + n) of a request whose tokens are `token_ids`."""
        bs = self.kv.block_size
        table = self.kv.block_table(request_id)
        for p in range(start, start + n):
            self.gpu[table[p // bs]][p % bs] = tuple(token_ids[:p + 1])

    def read(self, request_id: str, n: int) -> list:
        bs = self.kv.block_size
        table = self.kv.block_table(request_id)
        return [self.gpu[table[p // bs]][p % bs] for p in range(n)]

    def holds(self, request_id: str, token_ids, n: int) -> bool:
        """Whether the first n positions hold K/V computed from exactly `token_ids`."""
        return self.read(request_id, n) == [tuple(token_ids[:p + 1]) for p in range(n)]

    def apply(self, out: SchedulerOutput) -> None:
        """Apply a plan in the documented order and check what attention would read.

        As in each layer of a forward pass, every chunk's K/V is written before any
        chunk attends, so a prefix hit may use a block filled in this same step."""
        self.copy_blocks(getattr(out, "compaction_copies", ()))  # block compaction comes first
        self.swap_out(getattr(out, "tier_out", ()))  # host tier: demoted blocks are read first
        self.swap_out(out.swap_out)
        self.copy_blocks(out.block_copies)
        self.swap_in(out.swap_in)
        self.swap_in(getattr(out, "tier_in", ()))
        for c in out.scheduled:
            self.write(c.request_id, c.request.token_ids, c.start, c.num_tokens)
        for c in out.scheduled:
            assert self.holds(c.request_id, c.request.token_ids, c.start + c.num_tokens), c.request_id
