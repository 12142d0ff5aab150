"""Why a request missed the prefix cache: one row per prompt block, hit or the reason it was not.

Our engine (``MissLedger``, attached before the workload) follows the cache's events as they
happen (``paged.connect.tap``) and classifies each looked-up block at admission: ``hit`` / ``hit
(host tier)``; ``partial block`` (only full blocks are cached); ``last block recomputed`` (one
prompt token is always computed for logits); ``never seen``; ``evicted`` (when, which policy, for
whom); ``evicted from host tier``; ``cleared`` (``reset_prefix_cache``); ``different salt/adapter``
(same tokens cached under other extra keys, which change every hash); ``refused by verification``
(a block with the hash held other tokens or followed another parent); ``after the miss at block
k`` (the lookup stops at the first miss); ``caching disabled``.

A vLLM server (``explain_server_prompt``): only what its KV-event stream says. Prompt blocks are
matched to the prefix forest by tokens (no hash function needed): "cached" at the send time,
"evicted at t", "cleared at t", "never stored", "partial block", "after the break at block k",
or "stored later". Both give a DataFrame (``MISS_COLUMNS``) that ``paged.viz.forest.miss_table`` draws.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Hashable, Sequence

from paged.core import events as ev

from . import tap as _tap

if TYPE_CHECKING:
    import pandas as pd

    from .forest import PrefixForest

HIT, HIT_HOST = "hit", "hit (host tier)"
PARTIAL, LAST_BLOCK = "partial block", "last block recomputed"
NEVER_SEEN, EVICTED, EVICTED_HOST, CLEARED = "never seen", "evicted", "evicted from host tier", "cleared"
SALTED, REFUSED, AFTER_MISS, CACHING_OFF = ("different salt/adapter", "refused by verification",
                                            "after an earlier miss", "caching disabled")
CACHED, STORED_LATER = "cached", "stored later"
MISS_COLUMNS = ["request_id", "admission", "step", "block", "num_tokens", "status", "detail", "event_step",
                "by_request"]

_STORE, _EVICT, _TIER_OUT, _HOST_EVICT, _CLEAR = "stored", "evicted", "tier_out", "host_evicted", "cleared"


class MissLedger:
    """Per-request prefix-cache explanations for an engine (see the module docstring). Attach before the
    requests run (``MissLedger(llm)``: an ``LLM``, ``LLMEngine`` or ``Simulator``); ``frame()`` then has one row
    per looked-up block of every admission. Invariant: rows with status ``hit``/``hit (host tier)`` per
    admission add up to the tokens the engine counted as cached for it (``num_cached_tokens`` of its first
    admission)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine = getattr(engine, "engine", engine)
        kv = engine.kv
        self.block_size = kv.block_size
        self.policy = getattr(getattr(engine, "config", None), "eviction", None) or type(kv.pool.cached_free).__name__
        from paged.core.prefix_cache import BlockHasher
        self._plain = BlockHasher(kv.block_size)  # content keys: the tokens' chain without extra keys
        self._seq = 0
        self._history: dict[Hashable, list[tuple[int, int, str, Any]]] = {}  # hash -> (seq, step, what, by)
        self._content: dict[Hashable, set] = {}  # content key -> hashes stored for it
        self._host: dict[int, Hashable] = {}     # CPU block -> hash (host tier)
        self._alloc_start: dict[str, int] = {}   # request -> seq of its first event since the last plan
        self._tier_in: dict[str, set[int]] = {}  # request -> GPU blocks brought back from the host tier
        self._admissions: dict[str, int] = {}
        self.rows: list[dict] = []
        _tap.install(engine, self._on_event)

    def close(self) -> None:
        """Stop following the engine (the rows stay)."""
        _tap.remove(self.engine, self._on_event)

    # ---- following the engine -------------------------------------------------------------------------
    def _on_event(self, step: int, kind: str, rid: Any, bid: Any, value: Any) -> None:
        self._seq += 1
        seq, pool = self._seq, self.engine.kv.pool
        if rid is not None and kind in (ev.ALLOCATE, ev.PREFIX_HIT, ev.EVICT, ev.CACHE_BLOCK, ev.COW, ev.TIER_IN):
            self._alloc_start.setdefault(rid, seq)
        if kind == ev.CACHE_BLOCK:
            block = pool.blocks[bid]
            h = block.block_hash
            self._history.setdefault(h, []).append((seq, step, _STORE, rid))
            key = self._content_key(rid, block)
            if key is not None:
                self._content.setdefault(key, set()).add(h)
        elif kind == ev.EVICT:
            h = pool.blocks[bid].block_hash
            if h is not None:
                self._history.setdefault(h, []).append((seq, step, _EVICT, rid))
        elif kind == ev.TIER_OUT:
            h = pool.blocks[bid].block_hash
            if h is not None:
                self._host[value] = h
                self._history.setdefault(h, []).append((seq, step, _TIER_OUT, rid))
        elif kind == ev.HOST_EVICT:
            h = self._host.pop(value, None)
            if h is not None:
                self._history.setdefault(h, []).append((seq, step, _HOST_EVICT, rid))
        elif kind == ev.TIER_IN:
            self._host.pop(value, None)
            if rid is not None:
                self._tier_in.setdefault(rid, set()).add(bid)
        elif kind == ev.RESET:
            for h, hist in self._history.items():
                if hist and hist[-1][2] in (_STORE, _TIER_OUT):
                    hist.append((seq, step, _CLEAR, None))
            self._host.clear()
        elif kind == ev.ADMIT:
            self._explain(rid, step, value, self._alloc_start.pop(rid, seq))
        elif kind == ev.STEP:
            self._alloc_start.clear()
            self._tier_in.clear()

    def _content_key(self, rid: Any, block: Any) -> Hashable | None:
        """The hash of the block's tokens and all tokens before it, without extra keys."""
        req = self.engine.scheduler.requests.get(rid) if rid is not None else None
        if req is None:
            return None
        i = block.depth
        keys: list = []
        self._plain.extend(keys, req.token_ids, (), (i + 1) * self.block_size)
        return keys[i] if len(keys) > i else None

    # ---- explaining one admission ------------------------------------------------------------------------
    def _explain(self, rid: str, step: int, start: int, lookup_seq: int) -> None:
        kv = self.engine.kv
        req = self.engine.scheduler.requests.get(rid)
        if req is None:
            return
        n = self._admissions[rid] = self._admissions.get(rid, 0) + 1
        bs = self.block_size
        tokens = req.token_ids[:req.num_tokens]
        num_full, hits = len(tokens) // bs, start // bs
        base = {"request_id": rid, "admission": n, "step": step}
        table = kv.block_table(rid)
        host_ids = self._tier_in.pop(rid, set())

        def add(i: int, status: str, detail: str = "", event_step: Any = None, by: Any = None) -> None:
            self.rows.append({**base, "block": i, "num_tokens": min(bs, len(tokens) - i * bs),
                              "status": status, "detail": detail, "event_step": event_step, "by_request": by})
        if not kv.enable_prefix_caching:
            for i in range(-(-len(tokens) // bs)):
                add(i, PARTIAL if i >= num_full else CACHING_OFF)
            return
        hashes: list = []
        kv.hasher.extend(hashes, tokens, req.extra_keys, len(tokens))
        plain: list = []
        self._plain.extend(plain, tokens, (), len(tokens))
        max_blocks = (len(tokens) - 1) // bs
        first_miss = None
        for i in range(num_full):
            if i < hits:
                add(i, HIT_HOST if i < len(table) and table[i] in host_ids else HIT)
                continue
            status, detail, est, by = self._why(hashes[i], plain[i], tokens, i, lookup_seq)
            if first_miss is None:
                if i >= max_blocks and status == REFUSED:
                    status, detail = LAST_BLOCK, "cached, but at least one prompt token is computed to get logits"
                first_miss = i
                add(i, status, detail, est, by)
            else:
                what = "cached (unreachable)" if status == REFUSED else f"not cached ({status})"
                add(i, AFTER_MISS, f"the lookup stopped at block {first_miss}; this block is {what}", est, by)
        if len(tokens) % bs:
            add(num_full, PARTIAL, f"{len(tokens) % bs} of {bs} tokens")

    def _why(self, h: Hashable, key: Hashable, tokens: Sequence[int], i: int,
             lookup_seq: int) -> tuple[str, str, Any, Any]:
        """(status, detail, step of the deciding event, request it was for) of a block not hit."""
        hist = [x for x in self._history.get(h, ()) if x[0] < lookup_seq]
        if not hist:
            if self._content.get(key, set()) - {h}:  # other hashes for the same tokens
                return SALTED, "the same tokens are cached under other extra keys (cache_salt or adapter)", None, None
            return NEVER_SEEN, "", None, None
        seq, step, what, by = hist[-1]
        if what == _EVICT:
            who = f" to make room for {by}" if by is not None else ""
            return EVICTED, f"evicted at step {step} by the {self.policy} policy{who}", step, by
        if what == _HOST_EVICT:
            return EVICTED_HOST, f"demoted to the host tier, dropped there at step {step}", step, by
        if what == _CLEAR:
            return CLEARED, f"reset_prefix_cache at step {step}", step, None
        # stored (or in the host tier) at lookup time, yet not taken: verification refused it
        block = self.engine.kv.pool.index.get(h)
        bs = self.block_size
        if block is not None and block.token_ids is not None and \
                tuple(block.token_ids) != tuple(tokens[i * bs:(i + 1) * bs]):
            return REFUSED, "a block with this hash holds other tokens (hash collision)", step, by
        return REFUSED, "a block with this hash is cached, but after a different parent (recomputed prefix)", step, by

    # ---- results ---------------------------------------------------------------------------------------
    def frame(self) -> "pd.DataFrame":
        """``MISS_COLUMNS``: one row per looked-up block of every admission."""
        import pandas as pd
        return pd.DataFrame(self.rows, columns=MISS_COLUMNS)

    def summary(self) -> "pd.DataFrame":
        """Blocks and tokens per status (first admissions only: what the hit rate counts)."""
        df = self.frame()
        df = df[df["admission"] == 1]
        return (df.groupby("status").agg(blocks=("block", "size"), tokens=("num_tokens", "sum"))
                .sort_values("tokens", ascending=False))


def explain_server_prompt(forest: "PrefixForest", token_ids: Sequence[int], sent_s: float | None = None,
                          request_id: str = "request", cached_tokens: int | None = None) -> "pd.DataFrame":
    """What a server's KV-event stream says about a prompt's blocks at ``sent_s`` (the source's
    clock; None: now); see the module docstring. ``cached_tokens`` (the server's own count, e.g.
    ``usage.prompt_tokens_details.cached_tokens``) goes into every row's detail for comparison."""
    import pandas as pd
    bs = forest.block_size
    rows: list[tuple] = []  # MISS_COLUMNS in order
    if not bs:
        raise ValueError("the forest has seen no BlockStored yet, so its block size is unknown")
    nodes = forest.match(token_ids, sent_s)
    broken = None
    for i, node in enumerate(nodes):
        status, detail, est = NEVER_SEEN, "never stored in the stream", None
        if node is not None:
            live = node.live if sent_s is None else node.live_at(sent_s)
            if live:
                status, detail = CACHED, f"node {node.node_id}, stored {node.times_stored}x"
            else:
                last = ((node.removed_s, node.how_removed) if sent_s is None  # not live now: removed_s is set
                        else node.last_change_before(sent_s))
                if last is None:
                    est = node.first_stored_s
                    status, detail = STORED_LATER, f"first stored at {est:.3f} s"
                elif last[1] == "cleared":
                    status, detail, est = CLEARED, f"cleared at {last[0]:.3f} s", last[0]
                else:
                    status, detail, est = EVICTED, f"evicted at {last[0]:.3f} s (node {node.node_id})", last[0]
        if broken is not None:
            detail = f"the chain broke at block {broken}; this block: {status}" + (f" ({detail})" if detail else "")
            status = AFTER_MISS
        elif status != CACHED:
            broken = i
        rows.append((request_id, 1, None, i, bs, status, detail, est, None))
    if len(token_ids) % bs:
        rows.append((request_id, 1, None, len(nodes), len(token_ids) % bs, PARTIAL,
                     f"{len(token_ids) % bs} of {bs} tokens", None, None))
    df = pd.DataFrame(rows, columns=MISS_COLUMNS)
    if cached_tokens is not None:
        df["server_cached_tokens"] = cached_tokens
    return df
