"""The prefix forest: a server's cached blocks as a tree of hashes, built from its KV events.

``BlockStored`` blocks become nodes under their parent hash (roots: a prompt's first block);
``BlockRemoved`` marks nodes evicted, ``AllBlocksCleared`` every live node cleared. Nodes are never
deleted, so the forest also answers "what was cached at time t" and "when did this block go".

Invariants: ``live`` is exactly the hashes stored and not removed since (the server's prefix cache
for ``medium``); ``times_stored`` counts every ``BlockStored`` naming a node (re-stores, vLLM's
re-reports); ``node_id``s are small integers in order of first appearance. Events of other media
and removals of hashes never stored are counted, not applied.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from .wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent, MEDIUM_GPU, hash_text

if TYPE_CHECKING:
    import pandas as pd

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


@dataclass(slots=True)
class Node:
    """One cached block as the event stream describes it."""

    node_id: int
    block_hash: BlockHash
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    depth: int
    first_stored_s: float
    stored_s: float                  # last (re)store
    times_stored: int = 1
    removed_s: float | None = None   # set while evicted or cleared; None while live
    times_removed: int = 0
    how_removed: str | None = None   # REMOVED or CLEARED
    lora_name: str | None = None
    history: list[tuple[float, str]] = field(default_factory=list)

    @property
    def live(self) -> bool:
        return self.removed_s is None

    def live_at(self, t: float) -> bool:
        """Whether the node was cached at time ``t`` (its last transition at or before t was a store)."""
        last = self.last_change_before(t)
        return last is not None and last[1] == STORED

    def last_change_before(self, t: float) -> tuple[float, str] | None:
        last = None
        for when, what in self.history:
            if when > t:
                break
            last = (when, what)
        return last


class PrefixForest:
    """Cached blocks by hash with parent links (see the module docstring)."""

    def __init__(self, medium: str = MEDIUM_GPU) -> None:
        self.medium = medium
        self.nodes: dict[BlockHash, Node] = {}
        self.live: set[BlockHash] = set()
        self.children: dict[BlockHash | None, dict[tuple[int, ...], list[BlockHash]]] = {}
        self.num_stored = 0          # BlockStored blocks applied
        self.num_removed = 0         # BlockRemoved hashes applied to live nodes
        self.num_cleared = 0         # AllBlocksCleared applied
        self.unknown_removed = 0     # removals of hashes never seen stored (joined late, or lost batches)
        self.other_media = 0         # events for another medium, not applied
        self.block_size: int | None = None

    # ---- applying events -------------------------------------------------------------------------
    def apply(self, event: KVEvent, t: float) -> list[Node]:
        """Apply one event at time ``t``; returns the nodes it changed."""
        if isinstance(event, AllBlocksCleared):
            return self.clear(t)
        if (event.medium or MEDIUM_GPU) != self.medium:
            self.other_media += 1
            return []
        if isinstance(event, BlockStored):
            return self.store(event, t)
        if isinstance(event, BlockRemoved):
            return self.remove(event.block_hashes, t)
        return []

    def store(self, event: BlockStored, t: float) -> list[Node]:
        self.block_size = event.block_size
        out = []
        for h, parent, tokens in event.blocks():
            node = self.nodes.get(h)
            if node is None:
                pnode = self.nodes.get(parent)
                # a parent never seen (joined late) still means at least one block above
                depth = pnode.depth + 1 if pnode is not None else int(parent is not None)
                node = Node(len(self.nodes), h, parent, tokens, depth, t, t, lora_name=event.lora_name)
                self.nodes[h] = node
                self.children.setdefault(parent, {}).setdefault(tokens, []).append(h)
            else:  # a re-store after an eviction, or a re-report of a live block (removed_s is None already)
                node.times_stored += 1
                node.stored_s = t
                node.removed_s = node.how_removed = None
            node.history.append((t, STORED))
            self.live.add(h)
            self.num_stored += 1
            out.append(node)
        return out

    def remove(self, hashes: Iterable[BlockHash], t: float, how: str = REMOVED) -> list[Node]:
        out = []
        for h in hashes:
            node = self.nodes.get(h)
            if node is None or h not in self.live:
                self.unknown_removed += 1
                continue
            self.live.discard(h)
            node.removed_s, node.how_removed = t, how
            node.times_removed += 1
            node.history.append((t, how))
            if how == REMOVED:
                self.num_removed += 1
            out.append(node)
        return out

    def clear(self, t: float) -> list[Node]:
        self.num_cleared += 1
        return self.remove(list(self.live), t, CLEARED)

    # ---- queries -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def match(self, token_ids: Sequence[int], t: float | None = None) -> list[Node | None]:
        """For each full block of ``token_ids``: the node ever stored for exactly that prefix (its tokens
        under the previous block's node), preferring one live at ``t`` (None: now); None from the first block
        never stored on. The caller checks liveness. Matching by tokens needs no server hash function."""
        bs = self.block_size
        out: list[Node | None] = []
        if not bs:
            return out
        parent: BlockHash | None = None
        for i in range(len(token_ids) // bs):
            cands = self.children.get(parent, {}).get(tuple(token_ids[i * bs:(i + 1) * bs]), [])
            if not cands:
                out.extend([None] * (len(token_ids) // bs - i))
                break
            nodes = [self.nodes[h] for h in cands]
            node = next((n for n in nodes if (n.live if t is None else n.live_at(t))), nodes[-1])
            out.append(node)
            parent = node.block_hash
        return out

    def frame(self, now: float, tokenizer: Any = None) -> "pd.DataFrame":
        """One row per node: ids, parent id, depth, state ('live', 'evicted', 'cleared'), age_s
        (since first stored), times stored/removed, stored/removed times, a short hash and the
        decoded tokens (with ``tokenizer``)."""
        import pandas as pd
        rows = []
        for h, n in self.nodes.items():
            p = self.nodes.get(n.parent)
            state = "live" if n.live else ("cleared" if n.how_removed == CLEARED else "evicted")
            text = None
            if tokenizer is not None:
                with contextlib.suppress(Exception):  # a token the tokenizer cannot show stays undecoded
                    text = tokenizer.decode(list(n.token_ids), skip_special_tokens=False)
            rows.append((n.node_id, None if p is None else p.node_id, hash_text(h), n.depth, state,
                         now - n.first_stored_s, n.times_stored, n.times_removed, n.first_stored_s, n.stored_s,
                         n.removed_s, len(n.token_ids), text))
        cols = ["node_id", "parent_id", "hash", "depth", "state", "age_s", "times_stored", "times_removed",
                "first_stored_s", "stored_s", "removed_s", "num_tokens", "text"]
        df = pd.DataFrame(rows, columns=cols)
        df["parent_id"] = df["parent_id"].astype("Int64")
        return df

    def counts(self) -> dict[str, int]:
        return {"nodes": len(self.nodes), "live": len(self.live), "stored": self.num_stored,
                "removed": self.num_removed, "cleared": self.num_cleared, "unknown_removed": self.unknown_removed,
                "other_media": self.other_media}
