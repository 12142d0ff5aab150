"""Mooncake's global-vs-local KV cache (FAST'25 Fig. 10) as a cache-only replay with a cost model.

    global_vs_local("conversation", nodes=10, tokens_per_node=3_000_000)   # one row per mode
    capacity_sweep("conversation", tokens_per_node=(1e6, 3e6, 1e7))        # rows per capacity x mode
    pool_point(mode="pooled", ...)                                         # one row (paged.sweep: fleet_pool)

Paper (Qin et al., FAST'25, Fig. 10): 10 prefill nodes with 3M tokens of DRAM cache each; a global
cache over all of them against per-node caches raises the hit rate by up to 136% and cuts prefill
GPU time by up to 48%, both with KV-cache-aware scheduling.

What runs here (``replay``): requests in arrival order (the trace's timestamps), each routed at
its arrival and served by a ``paged.fleet.pool.PooledTier`` (per-node LRU caches; ``pooled``: any
node's blocks are reachable over the ``Network``). Prefill time of a request is the project's cost
model (``paged.sim.cost_model.CostModel.step_time``) for its computed tokens on top of its hit
tokens, as one step; GPU-seconds are that times the tensor-parallel degree. Routing:

- ``cache_aware`` (Mooncake's conductor, its Algorithm 1 reduced): per node, estimated TTFT =
  queue (the node's prefill work not yet done at the arrival) + transfer of the blocks it would
  fetch + prefill of the rest; the least wins, ties to the most local blocks, then the lowest index.
- ``max_local``: the most local prefix blocks (ties: the shortest queue) — cache affinity alone.
- ``round_robin``.

Not modelled: decode, the GPU's own HBM cache, SSD, chunking of a prefill, a prefill's transfer
overlapping its compute (it is added to the node's busy time and the TTFT).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd

from paged.errors import ConfigError
from paged.sim.arrivals import Arrivals, SyntheticPrompts
from paged.sim.cost_model import CostModel
from paged.sim.shapes import StepShape
from paged.sim.trace_files import mooncake_trace
from paged.sim.workload import normalize_trace

from .caches import chain_keys
from .pool import Network, PooledTier, chain_ids, max_hit_blocks

__all__ = ["PAPER_FIG10", "ROUTINGS", "MODES", "replay", "pool_point", "global_vs_local", "capacity_sweep", "fig10_table"]

PAPER_FIG10 = {"nodes": 10, "tokens_per_node": 3_000_000, "hit_rate_gain_up_to": 1.36, "prefill_cut_up_to": 0.48}
ROUTINGS = ("cache_aware", "max_local", "round_robin")
MODES = ("local", "pooled")
REQUEST_COLUMNS = ("request", "arrival_s", "node", "prompt_tokens", "local_hit_tokens", "remote_hit_tokens",
                   "computed_tokens", "replicated_blocks", "bytes_moved", "transfer_s", "queue_s", "prefill_s",
                   "ttft_s")


class _Prefill:
    """The cost model's prefill seconds for (computed, cached) tokens, memoised (they repeat)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost, self.memo = cost, {}

    def __call__(self, computed: int, cached: int) -> float:
        key = (computed, cached)
        t = self.memo.get(key)
        if t is None:
            t = self.memo[key] = self.cost.step_time(StepShape.make([computed], [cached], 1))
        return t


def trace_keys(tr: pd.DataFrame, block_size: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Per request, the chained keys of its full prompt blocks: the trace's own block ids when its
    content blocks are ``block_size`` tokens (Mooncake: 512), else the simulator's prompt tokens."""
    a = Arrivals(tr)
    if a.blocks is not None and a.block_size == block_size:
        return [chain_ids(a.blocks[i][: int(a.prompt[i]) // block_size]) for i in range(a.n)]
    toks = SyntheticPrompts(vocab_size, seed)
    return [chain_keys(a.prompt_ids(i, toks), block_size) for i in range(a.n)]


def replay(trace: pd.DataFrame, *, nodes: int = 10, tokens_per_node: float = 3_000_000, pooled: bool = True,
           routing: str = "cache_aware", replicate_after: int | None = None, block_size: int = 512,
           cost: CostModel | None = None, network: Network | None = None,
           seed: int = 0) -> tuple[dict[str, Any], pd.DataFrame, pd.DataFrame]:
    """Route and serve ``trace`` (see the module docstring): (summary, one row per request, one
    row per node). ``cost``: default Llama-3.1-70B on 8x A100-80GB (Mooncake's LLaMA2-70B-class
    model on 8-GPU nodes)."""
    if routing not in ROUTINGS:
        raise ConfigError(f"unknown routing {routing!r}; use one of {', '.join(ROUTINGS)}")
    if not (isinstance(block_size, int) and block_size >= 1):
        raise ConfigError(f"block_size must be an integer >= 1 tokens, got {block_size!r}")
    if not (isinstance(tokens_per_node, (int, float)) and tokens_per_node >= block_size):
        raise ConfigError(f"tokens_per_node={tokens_per_node!r} holds no block of {block_size} tokens; raise it")
    cost = cost if cost is not None else CostModel("llama-3.1-70b", "a100-80gb", tensor_parallel=8)
    block_bytes = cost.model.kv_bytes_per_token(cost.kv_format, 1) * block_size   # the whole model's KV
    tier = PooledTier(nodes, int(tokens_per_node // block_size), block_bytes, pooled=pooled, network=network,
                      replicate_after=replicate_after)
    tr = normalize_trace(trace)
    keys = trace_keys(tr, block_size, cost.model.vocab_size, seed)
    arrive, prompt = tr["arrival_time"].to_numpy(np.float64), tr["prompt_tokens"].to_numpy()
    prefill = _Prefill(cost)
    free_at = [0.0] * nodes          # when each node's prefill queue empties
    rows = []
    for i, (t, n, ks) in enumerate(zip(arrive, prompt, keys)):
        n, cap = int(n), max_hit_blocks(int(n), block_size)
        k = _route(tier, routing, i, float(t), n, ks, cap, free_at, prefill, block_size)
        s = tier.serve(k, ks, cap)
        hit = (s.local_blocks + s.remote_blocks) * block_size
        p = prefill(n - hit, hit)
        queue = max(0.0, free_at[k] - t)
        free_at[k] = max(free_at[k], t) + s.transfer_s + p
        rows.append((i, float(t), k, n, s.local_blocks * block_size, s.remote_blocks * block_size, n - hit,
                     s.replicated_blocks, s.bytes_moved, s.transfer_s, queue, p, queue + s.transfer_s + p))
    reqs = pd.DataFrame(rows, columns=list(REQUEST_COLUMNS))
    per = reqs.groupby("node").agg(requests=("request", "size"), prefill_s=("prefill_s", "sum")).reindex(
        range(nodes), fill_value=0).reset_index()
    per["blocks_held"] = [len(c) for c in tier.nodes]
    per["blocks_served_remote"] = tier.served_remote
    per["blocks_evicted"] = tier.evicted
    return _summary(reqs, tier, cost, routing, tokens_per_node, block_size), reqs, per


def _route(tier: PooledTier, routing: str, i: int, t: float, n: int, keys: Sequence[int], cap: int,
           free_at: list[float], prefill: _Prefill, block_size: int) -> int:
    nodes = len(tier.nodes)
    if routing == "round_robin":
        return i % nodes
    best, best_key = 0, None
    for k in range(nodes):
        local, remote = tier.match(k, keys, cap)
        queue = max(0.0, free_at[k] - t)
        if routing == "max_local":
            key = (-local, queue, k)
        else:
            hit = (local + remote) * block_size
            key = (queue + tier.transfer_s(remote) + prefill(n - hit, hit), -local, k)
        if best_key is None or key < best_key:
            best, best_key = k, key
    return best


def _summary(reqs: pd.DataFrame, tier: PooledTier, cost: CostModel, routing: str, tokens_per_node: float,
             block_size: int) -> dict[str, Any]:
    q = float(reqs["prompt_tokens"].sum()) or 1.0
    local, remote = float(reqs["local_hit_tokens"].sum()), float(reqs["remote_hit_tokens"].sum())
    tp, pre = cost.tensor_parallel, float(reqs["prefill_s"].sum())
    return {"mode": "pooled" if tier.pooled else "local", "routing": routing, "nodes": len(tier.nodes),
            "tokens_per_node": int(tokens_per_node), "block_size": block_size, "requests": len(reqs),
            "query_tokens": int(q), "hit_rate": (local + remote) / q, "local_hit_rate": local / q,
            "remote_hit_rate": remote / q, "prefill_s": pre, "prefill_gpu_s": pre * tp,
            "transfer_s": float(reqs["transfer_s"].sum()), "bytes_moved": float(reqs["bytes_moved"].sum()),
            "local_hit_blocks": int(local) // block_size, "remote_hit_blocks": int(remote) // block_size,
            "replicated_blocks": int(reqs["replicated_blocks"].sum()),
            "ttft_p50_s": float(reqs["ttft_s"].quantile(0.5)), "ttft_p99_s": float(reqs["ttft_s"].quantile(0.99)),
            "max_node_share": float(reqs["node"].value_counts().max() / len(reqs)),
            "model": cost.model.name, "gpu": cost.gpu.name, "tensor_parallel": tp,
            "link_gb_s": tier.network.bytes_per_s / 1e9}


def _trace(trace: str | pd.DataFrame, num_requests: int | None) -> tuple[str, pd.DataFrame]:
    """A trace frame, a Mooncake trace by name (``data/traces/mooncake``) or a trace file path."""
    if isinstance(trace, pd.DataFrame):
        return "custom", trace.iloc[:num_requests] if num_requests else trace
    return str(trace), mooncake_trace(str(trace), num_requests)


def pool_point(trace: str = "conversation", mode: str = "pooled", nodes: int = 10,
               tokens_per_node: float = 3_000_000, num_requests: int | None = None, routing: str = "cache_aware",
               replicate_after: int | None = None, model: str = "llama-3.1-70b", gpu: str = "a100-80gb",
               tensor_parallel: int = 8, nics: int = 4, nic_gbps: float = 200.0, latency_s: float = 5e-6,
               block_size: int = 512, seed: int = 0) -> dict[str, Any]:
    """One mode's summary row (``mode``: ``local`` per-node caches, ``pooled`` the global pool)."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    name, tr = _trace(trace, num_requests)
    net = Network(nics=nics, nic_gbps=nic_gbps, latency_s=latency_s)
    cost = CostModel(model, gpu, tensor_parallel=tensor_parallel)
    summary, _, _ = replay(tr, nodes=nodes, tokens_per_node=tokens_per_node, pooled=mode == "pooled",
                           routing=routing, replicate_after=replicate_after, block_size=block_size, cost=cost,
                           network=net, seed=seed)
    return {"trace": name, **summary}


def global_vs_local(trace: str | pd.DataFrame = "conversation", nodes: int = 10, tokens_per_node: float = 3_000_000,
                    **kw: Any) -> pd.DataFrame:
    """Fig. 10 at one setting: a ``local`` and a ``pooled`` row on the same requests and routing
    rule, with ``hit_rate_vs_local`` / ``prefill_gpu_s_vs_local`` (ratios to local) beside the
    paper's "up to" figures."""
    rows = [pool_point(trace, m, nodes, tokens_per_node, **kw) for m in MODES]
    return _beside_paper(pd.DataFrame(rows))


def capacity_sweep(trace: str | pd.DataFrame = "conversation", nodes: int = 10,
                   tokens_per_node: Sequence[float] = (1e6, 3e6, 1e7, 5e7), **kw: Any) -> pd.DataFrame:
    """``global_vs_local`` at each capacity per node: rows per (capacity, mode)."""
    return pd.concat([global_vs_local(trace, nodes, c, **kw) for c in tokens_per_node], ignore_index=True)


def _beside_paper(df: pd.DataFrame) -> pd.DataFrame:
    loc = df[df["mode"] == "local"].iloc[0]
    df["hit_rate_vs_local"] = df["hit_rate"] / loc["hit_rate"] if loc["hit_rate"] else float("nan")
    df["prefill_gpu_s_vs_local"] = df["prefill_gpu_s"] / loc["prefill_gpu_s"]
    df["paper_hit_rate_gain_up_to"] = PAPER_FIG10["hit_rate_gain_up_to"]
    df["paper_prefill_cut_up_to"] = PAPER_FIG10["prefill_cut_up_to"]
    return df


def fig10_table(traces: Sequence[str] = ("conversation", "synthetic"), nodes: int = 10,
                tokens_per_node: float = 3_000_000, **kw: Any) -> pd.DataFrame:
    """Fig. 10 beside the paper, per trace: per-node caches with cache-aware routing and with round
    robin (locality left to chance), and the pooled tier with cache-aware routing; ratios to the
    cache-aware local row (``hit_rate_vs_local``, ``prefill_gpu_s_vs_local``)."""
    out = []
    for name in traces:
        rows = [pool_point(name, "local", nodes, tokens_per_node, routing="cache_aware", **kw),
                pool_point(name, "local", nodes, tokens_per_node, routing="round_robin", **kw),
                pool_point(name, "pooled", nodes, tokens_per_node, routing="cache_aware", **kw)]
        out.append(_beside_paper(pd.DataFrame(rows)))
    return pd.concat(out, ignore_index=True)
