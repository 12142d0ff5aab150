"""SwapExecutor: the one place that moves KV blocks between device cache layers and host layers.

The runner (and the host tier) call it with ``(src, dst)`` block-id pairs:

- :meth:`SwapExecutor.swap_out` ``[(device_block, host_block), ...]``  device -> host
- :meth:`SwapExecutor.swap_in`  ``[(host_block, device_block), ...]``  host -> device
- :meth:`SwapExecutor.wait_layer` (per layer, before the forward touches that layer's cache) and
  :meth:`SwapExecutor.fence` (all layers): the forward's stream waits for the swap-ins issued.
- :meth:`SwapExecutor.synchronize`: the host waits for every transfer (before reading host
  blocks on the CPU, e.g. a test or a host-tier copy done outside this class).

Modes:

``mode="sync"`` with no compression is exactly ``kernels.swap_blocks`` (what the runner did
before this module existed). ``mode="overlap"`` runs the schedule below; ``compression="fp8"|
"int4"`` stores blocks quantized on the host (see :mod:`paged.engine.swap_codec`) and is only
offered for full-precision device caches.

Overlap schedule (CUDA). Two side streams, one per direction (PCIe is full duplex):

1. swap-out: the out-stream waits for the main stream (the blocks' K/V are final), gathers (and
   encodes) the blocks into a device scratch buffer, records ``read`` per layer and starts the
   device->host copies into pinned host memory. The main stream waits on ``read``: a device
   block freed by the swap-out can be reused by this step's copies and forward, since its
   content is already in the scratch buffer (an on-device gather at HBM speed); the slow link
   transfer runs beside the forward.
2. swap-in: the in-stream waits for the main stream and for the out-stream's copies into the host
   blocks it reads; per layer it copies host->device scratch, decodes and scatters into the
   device blocks, then records ``ready[layer]``. The forward waits on ``ready[layer]`` just
   before that layer's attention (:meth:`wait_layer`), so layer ``l + 1``'s transfer overlaps
   layer ``l``'s compute (the seed's "prefetch the next layer's blocks").
3. A host block is not overwritten while a swap-in still reads it: the out-stream waits on the
   in-stream's event for such blocks.

On CPU the same schedule runs through the same code (streams and events are no-ops): every copy
is synchronous when it is issued, so every event has already "fired" when it is recorded; the
overlap is then only in the cost model (``paged.sim.cost_model``). Extra device memory of the
overlap mode: the scratch of one step's swapped blocks (not counted in the KV budget).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from paged._kernels import kernels
from kernels.blocks import normalize_block_mapping
from paged.core.config import CacheConfig
from paged.errors import ConfigError
from .swap_codec import CODECS, Codec, CompressedHostLayer
from .swap_streams import CudaStreams, NullStreams


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def runs(dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(i0, d0, n)`` with ``dst[i0 + j] == d0 + j`` for ``j < n`` (coalesced copies)."""
    out: list[tuple[int, int, int]] = []
    for i, d in enumerate(dst):
        if out and out[-1][1] + out[-1][2] == d and out[-1][0] + out[-1][2] == i:
            i0, d0, n = out[-1]
            out[-1] = (i0, d0, n + 1)
        else:
            out.append((i, d, 1))
    return out


def _block_bytes(layers: Sequence[Any]) -> int:
    """Bytes of one block summed over ``layers`` (every tensor of each layer's block)."""
    return sum(sum(t[0].numel() * t.element_size() for t in layer.block_tensors()) for layer in layers)


class SwapExecutor:
    """Moves blocks between ``device_layers`` and ``host_layers`` (one per model layer).

    Invariants: a device block handed out by a swap-out may be rewritten by the main stream
    after :meth:`swap_out` returns (its content was read first); a swap-in's device blocks hold
    their K/V for the main stream once :meth:`wait_layer` (or :meth:`fence`) was called for that
    layer; host blocks are read and written only through this class (or after
    :meth:`synchronize`). ``host_layers`` are ``KVCacheLayer`` (no compression: same format as
    the device) or :class:`~paged.engine.swap_codec.CompressedHostLayer`.
    """

    def __init__(self, device_layers: Sequence[kernels.KVCacheLayer], host_layers: Sequence[Any], *,
                 mode: str = "sync", compression: str | None = None, streams: Any = None,
                 prefetch_blocks: int = 64) -> None:
        CacheConfig(swap_mode=mode, swap_compression=compression)  # ConfigError for a bad mode or compression
        self.device_layers, self.host_layers = list(device_layers), list(host_layers)
        self.mode, self.compression = mode, compression
        self.codec: Codec | None = CODECS[compression] if compression else None
        first = self.device_layers[0] if self.device_layers else None
        self.staged = first is not None and first.staging is not None
        if compression and first is not None and first.kv_format.quantized:
            raise ConfigError(f"swap_compression={compression!r} needs a full-precision device cache; "
                              f"kv_cache_dtype {first.kv_format.name!r} is already quantized (use "
                              "swap_compression=None)")
        self.device = first.device if first is not None else torch.device("cpu")
        self.streams = streams if streams is not None else (
            CudaStreams(self.device) if self.device.type == "cuda" and self._scheduled else NullStreams())
        self._ready: dict[int, Any] = {}           # layer -> event of its pending swap-in
        self._host_written: dict[int, Any] = {}    # host block -> event of the copy writing it
        self._host_read: dict[int, Any] = {}       # host block -> event of the copy reading it
        self.prefetch_blocks = prefetch_blocks     # most host blocks held prefetched on the device
        self._prefetched: dict[int, tuple[list[list[torch.Tensor]], int]] = {}  # host block -> (bufs, row)
        self.num_prefetch_hits = 0
        self.bytes_out = self.bytes_in = 0         # host-side bytes moved (what crosses the link)
        self._host_bytes = _block_bytes(self.host_layers)  # layers' shapes are fixed: once, not per swap

    @classmethod
    def build(cls, device_layers: Sequence[kernels.KVCacheLayer], num_host_blocks: int, *,
              mode: str = "sync", compression: str | None = None,
              host_layers: Sequence[kernels.KVCacheLayer] | None = None) -> "SwapExecutor":
        """Allocate the host layers (pinned on CUDA in overlap mode) and the executor.
        ``host_layers``: already allocated uncompressed host layers to use (no compression)."""
        CacheConfig(swap_mode=mode, swap_compression=compression)  # checked before anything is allocated
        pin = mode == "overlap" and bool(device_layers) and device_layers[0].device.type == "cuda"
        if compression:
            hosts = [CompressedHostLayer.allocate(CODECS[compression], num_host_blocks, layer, pin=pin)
                     for layer in device_layers] if num_host_blocks else []
        else:
            hosts = list(host_layers or [])
            if pin:
                for h in hosts:
                    for name in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero"):
                        t = getattr(h, name)
                        if t is not None and t.device.type == "cpu" and not t.is_pinned():
                            setattr(h, name, t.pin_memory())
        return cls(device_layers, hosts, mode=mode, compression=compression)

    # ---- facts -------------------------------------------------------------------------
    @property
    def _scheduled(self) -> bool:
        """Whether the own schedule runs (else ``kernels.swap_blocks``, the sync reference)."""
        return (self.mode == "overlap" or self.compression is not None) and not self.staged

    def device_block_bytes(self) -> int:
        """Bytes of one block over all device layers (what an uncompressed swap moves)."""
        return _block_bytes(self.device_layers)

    def host_block_bytes(self) -> int:
        """Bytes of one block over all host layers (what a swap moves over the link)."""
        return self._host_bytes

    # ---- moves -------------------------------------------------------------------------
    def swap_out(self, pairs) -> None:
        """Copy device blocks to host blocks: ``[(device_block, host_block), ...]``."""
        m = self._mapping(pairs, self.device_layers, self.host_layers, "swap_out")
        if m is None:
            return
        self.bytes_out += m.shape[0] * self._host_bytes
        if not self._scheduled:
            kernels.swap_blocks(self.device_layers, self.host_layers, m)
            return
        m = m[torch.argsort(m[:, 1])]  # by host block
        dev_idx, host_ids = m[:, 0].to(self.device), m[:, 1].tolist()
        s = self.streams
        s.side_waits_main("out")
        s.keep(dev_idx, "out")
        for h in host_ids:  # do not overwrite a host block a pending swap-in still reads
            s.side_waits("out", self._host_read.pop(h, None))
            self._prefetched.pop(h, None)  # a prefetched copy of the old content is stale
        with s.side("out"):
            parts = [self._encode(layer, dev_idx) for layer in self.device_layers]
            read = s.record("out")
            for host, ps in zip(self.host_layers, parts):
                for ht, p in zip(host.block_tensors(), ps):
                    for i0, h0, n in runs(host_ids):
                        _bytes(ht)[h0:h0 + n].copy_(_bytes(p)[i0:i0 + n], non_blocking=True)
            done = s.record("out")
        s.main_waits(read)  # device blocks may be reused from here on (their content is in scratch)
        self._host_written.update(dict.fromkeys(host_ids, done))

    def swap_in(self, pairs) -> None:
        """Copy host blocks to device blocks: ``[(host_block, device_block), ...]``; the forward
        must call :meth:`wait_layer` (or :meth:`fence`) before reading them."""
        m = self._mapping(pairs, self.host_layers, self.device_layers, "swap_in")
        if m is None:
            return
        self.bytes_in += m.shape[0] * self._host_bytes
        if not self._scheduled:
            kernels.swap_blocks(self.host_layers, self.device_layers, m)
            return
        pre = {h: self._prefetched.pop(h) for h in m[:, 0].tolist() if h in self._prefetched}
        m = m[sorted(range(m.shape[0]), key=lambda j: (int(m[j, 0]) not in pre, int(m[j, 0])))]
        host_ids, dev_idx = m[:, 0].tolist(), m[:, 1].to(self.device)
        k = len(pre)  # rows [0, k) come from the device copies a prefetch made, the rest from the host
        self.num_prefetch_hits += k
        groups: dict[int, tuple[list[list[torch.Tensor]], list[int], list[int]]] = {}
        for j, h in enumerate(host_ids[:k]):
            bufs, row = pre[h]
            g = groups.setdefault(id(bufs), (bufs, [], []))
            g[1].append(j)
            g[2].append(row)
        s = self.streams
        s.side_waits_main("in")
        s.keep(dev_idx, "in")
        for h in host_ids[k:]:  # read a host block only after the copy that wrote it
            s.side_waits("in", self._host_written.pop(h, None))
        with s.side("in"):
            for li, (layer, host) in enumerate(zip(self.device_layers, self.host_layers)):
                parts = []
                for ti, ht in enumerate(host.block_tensors()):
                    buf = self._from_host(ht, host_ids[k:], len(host_ids), k)
                    for bufs, js, rows in groups.values():
                        _bytes(buf)[js] = _bytes(bufs[li][ti])[rows]
                    parts.append(buf)
                self._decode_into(layer, parts, dev_idx)
                self._ready[li] = s.record("in")
            done = s.record("in")
        self._host_read.update(dict.fromkeys(host_ids[k:], done))

    def prefetch(self, host_blocks: Sequence[int]) -> None:
        """Overlap mode: start copying ``host_blocks`` (a swapped request's, likely swapped in next
        step) to device scratch on the in-stream, beside this step's forward; a later
        :meth:`swap_in` of them copies on the device instead of over the link. At most
        ``prefetch_blocks`` are held; :meth:`swap_out` into a prefetched host block drops its copy.
        No-op in sync mode (on CPU it runs, as synchronous copies, so tests cover the path)."""
        if not self._scheduled or self.mode != "overlap" or not self.host_layers:
            return
        nb = self.host_layers[0].block_tensors()[0].shape[0]
        room = self.prefetch_blocks - len(self._prefetched)
        ids = sorted({int(h) for h in host_blocks if 0 <= int(h) < nb and int(h) not in self._prefetched})[:max(0, room)]
        if not ids:
            return
        s = self.streams
        for h in ids:
            s.side_waits("in", self._host_written.pop(h, None))
        with s.side("in"):
            bufs = [[self._from_host(ht, ids, len(ids)) for ht in host.block_tensors()]
                    for host in self.host_layers]
            done = s.record("in")
        for row, h in enumerate(ids):
            self._prefetched[h] = (bufs, row)
            self._host_read[h] = done

    def wait_layer(self, layer_idx: int) -> None:
        """The main stream waits for the pending swap-in of ``layer_idx`` (no-op if none)."""
        ev = self._ready.pop(layer_idx, None)
        if ev is not None:
            self.streams.main_waits(ev)

    def fence(self) -> None:
        """The main stream waits for every pending swap-in (all layers)."""
        for li in list(self._ready):
            self.wait_layer(li)

    def fenced(self, attn: Any, layer_of: Sequence[int]) -> Any:
        """The forward's attention backend with :meth:`wait_layer` before each layer
        (``layer_of[model_layer]`` = index into the device layers); ``attn`` itself when no
        swap-in can be pending (sync reference path)."""
        return attn if not self._scheduled else _Fenced(attn, self, list(layer_of))

    def synchronize(self) -> None:
        """The host waits for every transfer; host blocks may then be read on the CPU."""
        self.streams.synchronize()
        self._host_written.clear()
        self._host_read.clear()

    def release_host(self, host_blocks: Sequence[int]) -> None:
        """int4_kivi: drop the staging slots of host blocks a swap-in has consumed."""
        if self.staged and host_blocks:
            for layer in self.host_layers:
                kernels.release_blocks(layer, list(host_blocks))

    # ---- helpers -----------------------------------------------------------------------
    def _from_host(self, ht: torch.Tensor, host_ids: Sequence[int], rows: int, at: int = 0) -> torch.Tensor:
        """A device scratch of ``rows`` blocks shaped like host tensor ``ht``, whose rows from ``at`` on get
        host blocks ``host_ids`` (coalesced copies, issued on the current stream)."""
        buf = torch.empty((rows,) + tuple(ht.shape[1:]), dtype=ht.dtype, device=self.device)
        for i0, h0, n in runs(host_ids):
            _bytes(buf)[at + i0:at + i0 + n].copy_(_bytes(ht)[h0:h0 + n], non_blocking=True)
        return buf

    def _encode(self, layer: kernels.KVCacheLayer, dev_idx: torch.Tensor) -> list[torch.Tensor]:
        """The host tensors' content for the blocks ``dev_idx`` of ``layer`` (device scratch)."""
        if self.codec is None:
            return [t.index_select(0, dev_idx) for t in layer.block_tensors()]
        return self.codec.encode(layer.k.index_select(0, dev_idx)) + \
            self.codec.encode(layer.v.index_select(0, dev_idx))

    def _decode_into(self, layer: kernels.KVCacheLayer, parts: list[torch.Tensor], dev_idx: torch.Tensor) -> None:
        if self.codec is None:
            for t, p in zip(layer.block_tensors(), parts):
                _bytes(t).index_copy_(0, dev_idx, _bytes(p))
            return
        n = self.codec.num_parts
        layer.k.index_copy_(0, dev_idx, self.codec.decode(parts[:n], layer.k.dtype))
        layer.v.index_copy_(0, dev_idx, self.codec.decode(parts[n:], layer.v.dtype))

    def _mapping(self, pairs, src: Sequence[Any], dst: Sequence[Any], what: str) -> torch.Tensor | None:
        """``pairs`` as an (n, 2) CPU tensor checked against both sides' block counts; None if empty."""
        m = normalize_block_mapping(pairs).cpu()
        if m.shape[0] == 0:
            return None
        src_name, dst_name = ("device", "host") if src is self.device_layers else ("host", "device")
        self._check(m[:, 0], src, f"{what} {src_name}")
        self._check(m[:, 1], dst, f"{what} {dst_name}")
        return m

    @staticmethod
    def _check(ids: torch.Tensor, layers: Sequence[Any], what: str) -> None:
        if not layers:
            raise kernels.ShapeError(f"{what}: there are no host layers (num_cpu_blocks=0); give "
                                     "num_cpu_blocks > 0 or preemption_mode='swap'")
        nb = layers[0].block_tensors()[0].shape[0]
        if int(ids.min()) < 0 or int(ids.max()) >= nb:
            raise kernels.ShapeError(f"{what} block ids must lie in [0, {nb}), got [{int(ids.min())}, "
                                     f"{int(ids.max())}]")


class _Fenced:
    """Calls ``swap.wait_layer`` for a layer's cache just before that layer's attention."""

    __slots__ = ("attn", "swap", "layer_of")

    def __init__(self, attn: Any, swap: SwapExecutor, layer_of: list[int]) -> None:
        self.attn, self.swap, self.layer_of = attn, swap, layer_of

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.swap.wait_layer(self.layer_of[layer_idx])  # a no-op unless a swap-in of that layer is pending
        return self.attn(layer_idx, q, k, v)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.attn, name)
