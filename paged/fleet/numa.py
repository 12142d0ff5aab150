"""NUMA inside a node: a host KV tier split per CPU socket, GPUs attached to one socket each.

    node = NumaNode(layout=(4, 4), block_bytes=..., local_bandwidth=32e9, remote_bandwidth=16e9)
    stats = replay(node, "local_first", trace)      # counts of local / remote host accesses, their seconds

Model (stated, not measured): every prompt block lives in the host tier (an offloading store such as
LMCache's CPU tier). A request runs on one GPU; it reads from the host the blocks of its prompt that an
earlier request wrote, and writes its own new blocks there. An access is *remote* when the block's socket
is not the GPU's socket (the DMA then crosses the inter-socket link, UPI/xGMI). Seconds per access:
``block_bytes / local_bandwidth`` or ``block_bytes / remote_bandwidth``. Placement policies:

- ``interleave``: block k of the run goes to socket k mod S (``numactl --interleave``); GPUs round robin.
- ``local_first``: a block goes to its writer's socket (first touch); GPUs round robin.
- ``affinity``: local_first, and a request runs on a GPU of the socket that holds most of its cached
  prefix (round robin among that socket's GPUs; round robin over all GPUs when nothing is cached).
- ``migrate``: local_first; a remote read also moves the block to the reader's socket asynchronously
  (off the request's path; its bytes are counted on the inter-socket link).

Invariant: every block has exactly one socket; accesses = reads + writes; remote <= accesses.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from paged.errors import ConfigError

POLICIES = ("interleave", "local_first", "affinity", "migrate")


@dataclass(frozen=True)
class NumaNode:
    """``layout``: GPUs per socket (``(4, 4)``: GPUs 0-3 on socket 0, 4-7 on socket 1); bandwidths in
    bytes/s from a GPU to host memory on its own socket and on another socket."""

    layout: tuple[int, ...] = (4, 4)
    block_bytes: float = 16 * 2 * 80 * 8 * 128 * 2   # 16 tokens of Llama-2-70B fp16 KV (all layers)
    local_bandwidth: float = 32e9
    remote_bandwidth: float = 16e9

    def __post_init__(self) -> None:
        lay = tuple(self.layout)
        if not lay or any(not isinstance(n, int) or n < 0 for n in lay) or sum(lay) < 1:
            raise ConfigError(f"layout is GPUs per socket, e.g. (4, 4); got {self.layout!r}")
        if not (self.block_bytes > 0 and self.local_bandwidth > 0 and self.remote_bandwidth > 0):
            raise ConfigError("block_bytes, local_bandwidth and remote_bandwidth must be > 0")
        object.__setattr__(self, "layout", lay)

    @property
    def num_sockets(self) -> int:
        return len(self.layout)

    @property
    def gpu_socket(self) -> tuple[int, ...]:
        return tuple(s for s, n in enumerate(self.layout) for _ in range(n))


@dataclass
class NumaStats:
    """Counts and seconds of one replay."""

    policy: str
    reads: int = 0
    writes: int = 0
    remote_reads: int = 0
    remote_writes: int = 0
    migrated: int = 0
    transfer_s: float = 0.0
    remote_transfer_s: float = 0.0
    gpu_requests: list[int] = field(default_factory=list)

    @property
    def accesses(self) -> int:
        return self.reads + self.writes

    @property
    def remote(self) -> int:
        return self.remote_reads + self.remote_writes


def replay(node: NumaNode, policy: str, requests: Iterable[Sequence[int]]) -> NumaStats:
    """Replay ``requests`` (each a sequence of block keys: a prompt's chained block hashes, so equal
    leading keys = a shared prefix) on ``node`` under ``policy``; see the module docstring."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown NUMA policy {policy!r}; choose one of {', '.join(POLICIES)}")
    gs, S = node.gpu_socket, node.num_sockets
    by_socket = [[g for g, s in enumerate(gs) if s == k] for k in range(S)]
    rr_socket = [0] * S
    home: dict[int, int] = {}
    st = NumaStats(policy, gpu_requests=[0] * len(gs))
    t_loc, t_rem = node.block_bytes / node.local_bandwidth, node.block_bytes / node.remote_bandwidth
    n_req = placed = 0
    for blocks in requests:
        if policy == "affinity":
            votes = [0] * S
            for b in blocks:
                if b in home:
                    votes[home[b]] += 1
            best = max(range(S), key=lambda k: (votes[k], -k)) if any(votes) else None
            if best is None or not by_socket[best]:
                g = n_req % len(gs)
            else:
                g = by_socket[best][rr_socket[best] % len(by_socket[best])]
                rr_socket[best] += 1
        else:
            g = n_req % len(gs)
        n_req += 1
        st.gpu_requests[g] += 1
        s = gs[g]
        for b in blocks:
            if b in home:
                st.reads += 1
                remote = home[b] != s
                if remote and policy == "migrate":
                    home[b] = s
                    st.migrated += 1
            else:
                st.writes += 1
                home[b] = placed % S if policy == "interleave" else s
                placed += 1
                remote = home[b] != s
                if remote:
                    st.remote_writes += 1
                st.transfer_s += t_rem if remote else t_loc
                st.remote_transfer_s += t_rem if remote else 0.0
                continue
            if remote:
                st.remote_reads += 1
            st.transfer_s += t_rem if remote else t_loc
            st.remote_transfer_s += t_rem if remote else 0.0
    return st


def prefix_requests(num_requests: int = 1000, num_prefixes: int = 16, prefix_blocks: int = 64,
                    own_blocks: int = 16, seed: int = 0) -> list[list[int]]:
    """Block keys of ``num_requests`` prompts: a shared prefix (uniform over ``num_prefixes``) of
    ``prefix_blocks`` blocks, then ``own_blocks`` blocks of the request's own."""
    import numpy as np
    if not (isinstance(num_requests, int) and num_requests >= 1 and num_prefixes >= 1 and prefix_blocks >= 0
            and own_blocks >= 0):
        raise ConfigError("num_requests and num_prefixes must be >= 1, prefix_blocks and own_blocks >= 0")
    pid = np.random.default_rng(seed).integers(0, num_prefixes, num_requests)
    base = num_prefixes * prefix_blocks
    return [[int(p) * prefix_blocks + i for i in range(prefix_blocks)] +
            [base + r * own_blocks + j for j in range(own_blocks)] for r, p in enumerate(pid)]


def numa_study(policies: Sequence[str] = POLICIES, layout: Sequence[int] = (4, 4), num_requests: int = 1000,
               num_prefixes: int = 16, prefix_blocks: int = 64, own_blocks: int = 16,
               local_bandwidth: float = 32e9, remote_bandwidth: float = 16e9, seed: int = 0):
    """One row per policy on the same requests; ``remote_vs_interleave``: remote accesses / interleave's,
    ``reduction_vs_interleave`` = 1 - that (the seeds' "reduced by 75%" is 0.75 here)."""
    import pandas as pd
    node = NumaNode(tuple(layout), local_bandwidth=local_bandwidth, remote_bandwidth=remote_bandwidth)
    reqs = prefix_requests(num_requests, num_prefixes, prefix_blocks, own_blocks, seed)
    rows = []
    for p in policies:
        s = replay(node, p, reqs)
        rows.append({"policy": p, "layout": "x".join(map(str, node.layout)), "accesses": s.accesses,
                     "host_reads": s.reads, "host_writes": s.writes, "remote_accesses": s.remote,
                     "remote_share": s.remote / s.accesses if s.accesses else 0.0, "migrated_blocks": s.migrated,
                     "inter_socket_bytes": (s.remote + s.migrated) * node.block_bytes,
                     "transfer_s": s.transfer_s, "remote_transfer_s": s.remote_transfer_s,
                     "max_gpu_share": max(s.gpu_requests) / max(sum(s.gpu_requests), 1)})
    df = pd.DataFrame(rows)
    if "interleave" in set(df["policy"]):
        base = df[df["policy"] == "interleave"].iloc[0]
        df["remote_vs_interleave"] = df["remote_accesses"] / base["remote_accesses"] if base["remote_accesses"] else float("nan")
        df["reduction_vs_interleave"] = 1.0 - df["remote_vs_interleave"]
        df["transfer_vs_interleave"] = df["transfer_s"] / base["transfer_s"]
    return df


def numa_point(policy: str = "local_first", **kw) -> dict:
    """``numa_study`` of one policy plus interleave, as one row (for ``paged.sweep``)."""
    df = numa_study(policies=("interleave", policy) if policy != "interleave" else ("interleave",), **kw)
    return df[df["policy"] == policy].iloc[0].to_dict()
