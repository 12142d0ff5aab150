"""The quantization lab's codecs and cache: each side of a :class:`~paged.quant.lab_spec.LabSpec`
(what every switch means is in :mod:`paged.quant.lab_spec`) quantized and read back the way it
says, layer by layer, for teacher-forced ablations (:mod:`paged.quant.ablation`).
"""
from __future__ import annotations

import functools
import math

import torch

from paged.errors import ConfigError
from kernels.quant import safe_divisor
from kernels.split import hadamard, lloyd_levels as lloyd_max, rope, unrope

from .artefact import allocate_bits
from .calibration import Calibration
from .lab_heads import pooled_bits
from .lab_spec import EXACT, LabSpec, SideSpec
from .lab_qjl import qjl_matrix, qjl_roundtrip
from .lab_sparse import sparse_roundtrip

__all__ = ["SideSpec", "LabSpec", "LabCache", "lloyd_max", "normal_codebook", "EXACT"]


def normal_codebook(bits: int, group: int, scale: str = "absmax", samples: int = 1 << 18) -> torch.Tensor:
    """The Lloyd-Max levels of ``x / s`` for Gaussian vectors of ``group`` values (``s`` their absmax
    or rms): the codebook of a rotated vector without calibration (seeded, deterministic)."""
    g = torch.Generator().manual_seed(1234 + bits * 1000 + group)
    z = torch.randn(samples // group, group, generator=g, dtype=torch.float64)
    s = z.abs().amax(-1, keepdim=True) if scale == "absmax" else z.pow(2).mean(-1, keepdim=True).sqrt()
    return lloyd_max((z / s).flatten(), 1 << bits)


def _group_scale(zg: torch.Tensor, keep: torch.Tensor | None, how: str) -> torch.Tensor:
    a = zg.abs() if keep is None else zg.abs().masked_fill(~keep, 0.0)
    if how == "absmax":
        return a.amax(-1)
    n = zg.shape[-1] if keep is None else keep.sum(-1).clamp_min(1)
    return (a.pow(2).sum(-1) / n).sqrt()


def quantize_tokens(z: torch.Tensor, spec: SideSpec, levels: torch.Tensor | None) -> torch.Tensor:
    """Round trip of ``z`` ``[T, H, D]`` through a per-token side (groups along D); float32 out."""
    t, h, d = z.shape
    g = spec.group
    zg = z.reshape(t, h, d // g, g)
    keep = None
    if spec.outliers:
        top = z.abs().topk(spec.outliers, dim=-1).indices
        out_mask = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, top, True)
        keep = ~out_mask.reshape(t, h, d // g, g)
    n = 1 << spec.bits
    if spec.levels == "int":
        hi = zg if keep is None else zg.masked_fill(~keep, -math.inf)
        lo = zg if keep is None else zg.masked_fill(~keep, math.inf)
        mx, mn = hi.amax(-1), lo.amin(-1)
        mx, mn = torch.where(torch.isfinite(mx), mx, 0.0), torch.where(torch.isfinite(mn), mn, 0.0)
        s = ((mx - mn) / (n - 1)).half().float()
        zero = mn.half().float()
        q = torch.round((zg - zero[..., None]) / safe_divisor(s)[..., None]).clamp(0, n - 1)
        out = q * s[..., None] + zero[..., None]
    else:
        lv = torch.linspace(-1.0, 1.0, n) if spec.levels == "sym" else levels
        s = _group_scale(zg, keep, spec.scale)
        if spec.scale == "absmax":
            s = s / lv.abs().max()
        s = _round_scale(s, spec.scale_bits)
        u = zg / safe_divisor(s)[..., None]
        code = torch.bucketize(u.contiguous(), ((lv[1:] + lv[:-1]) / 2).contiguous())
        out = lv[code] * s[..., None]
    out = out.reshape(t, h, d)
    if spec.outliers:
        out = torch.where(out_mask, z, out)
    return out


def _round_scale(s: torch.Tensor, bits: int) -> torch.Tensor:
    """fp16 scales (16 bits), or 8-bit log-scale codes (e4m3-like: 2^(e/8) steps) for ``bits == 8``."""
    if bits == 16:
        return s.half().float()
    if bits != 8:
        raise ConfigError(f"scale_bits must be 16 or 8, got {bits}")
    e = torch.ceil(torch.log2(s.clamp_min(1e-30)) * 8).clamp(-128, 127)
    return torch.where(s > 0, torch.exp2(e / 8), torch.zeros_like(s))


def quantize_channels(z: torch.Tensor, bits: "int | torch.Tensor", levels=None, compact: bool = False,
                      exclude: torch.Tensor | None = None) -> torch.Tensor:
    """KIVI round trip of one full group ``[N, H, D]``: asymmetric per channel over the tokens.

    ``levels``: a codebook on [0, 1] (None: uniform); ``compact``: the step and zero as an 8-bit
    and a 7-bit code under fp16 per-head super-scales (kiviq's rule at any bit width);
    ``exclude`` ``[N]`` bool: tokens left out of the range (exact sink tokens). ``bits`` may be a
    per-channel ``[H, D]`` tensor (then ``levels`` is ``{bits: codebook}``, 0 bits = the midpoint)."""
    if isinstance(bits, torch.Tensor):
        out = torch.empty_like(z)
        for b in bits.unique().tolist():
            m = bits == b
            if b == 0:
                keep = z if exclude is None or not bool(exclude.any()) or bool(exclude.all()) else z[~exclude]
                mid = ((keep.amin(0) + keep.amax(0)) / 2).half().float()
                out[:, m] = mid[m]
            else:
                out[:, m] = quantize_channels(z[:, m].unsqueeze(1), int(b), levels[int(b)] if levels else None,
                                              compact, exclude).squeeze(1)
        return out
    n = 1 << bits
    if exclude is not None and bool(exclude.any()) and not bool(exclude.all()):
        keep = ~exclude[:, None, None]
        mn = z.masked_fill(~keep, math.inf).amin(0)
        mx = z.masked_fill(~keep, -math.inf).amax(0)
    else:
        mn, mx = z.amin(0), z.amax(0)
    if compact:
        big = (mn.abs().amax(-1, keepdim=True) / 63.0).half().float()
        zero = torch.floor(mn / safe_divisor(big)).clamp(-64, 63) * big
        step = (mx - zero) / (n - 1)
        sup = (step.amax(-1, keepdim=True) / 255.0).half().float()
        s = torch.ceil(step / safe_divisor(sup)).clamp(1, 255) * sup
    else:
        s = ((mx - mn) / (n - 1)).half().float()
        zero = mn.half().float()
    safe = safe_divisor(s)
    if levels is None:
        return torch.round((z - zero) / safe).clamp(0, n - 1) * s + zero
    rng = s * (n - 1)
    u = (z - zero) / (safe * (n - 1))
    code = torch.bucketize(u.contiguous(), ((levels[1:] + levels[:-1]) / 2).contiguous())
    return levels[code] * rng + zero


def channel_codebook(z: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Lloyd-Max levels on [0, 1] of ``(x - min) / (max - min)`` over per-channel groups of
    ``group`` consecutive tokens of calibration keys ``z`` ``[N, H, D]`` (stored frame)."""
    n = (z.shape[0] // group) * group
    x = z[:n].reshape(n // group, group, *z.shape[1:])
    mn, mx = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    u = (x - mn) / (mx - mn).clamp_min(1e-12)
    lv = lloyd_max(u.flatten()[:: max(1, u.numel() // 400000)], 1 << bits)
    return (lv - lv.min()) / (lv.max() - lv.min())


@functools.lru_cache(maxsize=None)
def gaussian_levels(bits: int) -> torch.Tensor:
    """Lloyd-Max levels of a unit Gaussian (seeded sample), ``2**bits`` of them."""
    g = torch.Generator().manual_seed(99 + bits)
    return lloyd_max(torch.randn(1 << 18, generator=g, dtype=torch.float64), 1 << bits)


class SideCodec:
    """One layer's transform + quantizer for one side (parameters fitted from a Calibration)."""

    def __init__(self, spec: SideSpec, side: str, layer: int, calib: Calibration | None, head_dim: int) -> None:
        spec.check(head_dim, side)
        self.spec, self.side = spec, side
        needs = spec.center or spec.weight != "none" or spec.levels == "lloyd"
        if needs and calib is None:
            raise ConfigError(f"{spec.name} needs a Calibration (paged.quant.calibration.collect)")
        frame = ("k_pre" if spec.pre_rope else "k_post") if side == "k" else "v"
        self.mu = calib.mean(frame, layer) if spec.center else None
        self.a = None
        if spec.weight == "fisher":
            self.a = calib.channel_weights(frame, layer, spec.center)
        elif spec.weight == "q":  # error in the stored frame costs what it costs the output
            w = calib.q2[layer] if side == "k" else calib.wo2[layer]
            if side == "k":
                half = w.shape[-1] // 2
                w = ((w[..., :half] + w[..., half:]) / 2).repeat(1, 2)
            self.a = w.clamp_min(1e-12).sqrt()
            self.a = self.a / self.a.log().mean(-1, keepdim=True).exp()
        elif spec.weight == "std":
            x = getattr(calib, frame)[layer]
            sd = (x - x.mean(0)).pow(2).mean(0).sqrt() if spec.center else x.pow(2).mean(0).sqrt()
            if side == "k":  # one weight per RoPE pair
                half = sd.shape[-1] // 2
                sd = ((sd[..., :half] ** 2 + sd[..., half:] ** 2) / 2).sqrt().repeat(1, 2)
            self.a = 1.0 / sd.clamp_min(1e-6)
            self.a = self.a / self.a.log().mean(-1, keepdim=True).exp()
        self.h = hadamard(head_dim) if spec.rot else None
        self.u = None
        if spec.pca:
            x = self.transform(getattr(calib, frame)[layer])          # [N, H, D] centred/weighted
            cov = torch.einsum("nhd,nhe->hde", x.double(), x.double()) / x.shape[0]
            _, vec = torch.linalg.eigh(cov)                            # ascending
            self.u = vec.flip(-1).float()                              # [H, D, D], largest first
        self.levels = self.bits = None
        if not spec.exact and spec.alloc:
            z = self.transform(getattr(calib, frame)[layer])
            if spec.axis == "channel":
                n = (z.shape[0] // spec.group) * spec.group
                zg = z[:n].reshape(n // spec.group, spec.group, *z.shape[1:])
                imp = (zg.amax(1) - zg.amin(1)).pow(2).mean(0) / 12
                self.bits = pooled_bits(imp, calib.q2[layer], self.a, spec.bits) if spec.alloc_heads \
                    else allocate_bits(imp, spec.bits)
                self.levels = {b: channel_codebook(z, b, spec.group) for b in self.bits.unique().tolist() if b} \
                    if spec.levels == "lloyd" else None
            else:
                self.sd = z.pow(2).mean(0).sqrt().clamp_min(1e-8)     # [H, D] static per-channel step base
                self.bits = allocate_bits(self.sd.pow(2), spec.bits)
                self.levels = {b: gaussian_levels(b) for b in self.bits.unique().tolist() if b}
        elif not spec.exact and spec.axis == "channel" and spec.levels == "lloyd":
            self.levels = channel_codebook(self.transform(getattr(calib, frame)[layer]), spec.bits, spec.group)
        if not spec.exact and spec.axis == "token" and not spec.alloc:
            if spec.levels == "normal":
                self.levels = normal_codebook(spec.bits, spec.group, spec.scale)
            elif spec.levels == "lloyd":
                z = self.transform(getattr(calib, frame)[layer])  # calibration keys come in both frames
                zg = z.reshape(-1, spec.group)
                s = _group_scale(zg, None, spec.scale)
                u = zg / safe_divisor(s)[..., None]
                self.levels = lloyd_max(u.flatten()[:: max(1, u.numel() // 400000)], 1 << spec.bits)
                if spec.scale == "absmax":
                    self.levels = self.levels / self.levels.abs().max()

    def forward(self, x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Stored-frame values ``z`` of ``x`` ``[T, H, D]`` (post-RoPE keys / values); ``cs`` RoPE rows."""
        return self.transform(unrope(x, *cs) if self.spec.pre_rope else x)

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """Center, weight and rotate ``x`` in its frame (pre-RoPE keys when ``pre_rope``)."""
        if self.mu is not None:
            x = x - self.mu
        if self.a is not None:
            x = x * self.a
        if self.h is not None:
            x = x @ self.h
        if self.u is not None:
            x = torch.einsum("thd,hde->the", x, self.u)
        return x

    def inverse(self, z: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if self.u is not None:
            z = torch.einsum("the,hde->thd", z, self.u)
        if self.h is not None:
            z = z @ self.h.T
        if self.a is not None:
            z = z / self.a
        if self.mu is not None:
            z = z + self.mu
        if self.spec.pre_rope:
            z = rope(z, *cs)
        return z

    def roundtrip(self, x: torch.Tensor, cs) -> torch.Tensor:
        """Per-token round trip (token axis)."""
        if self.spec.exact:
            return x if self.spec.bits == 32 else x.half().float()
        if self.spec.alloc:
            return self.inverse(self._alloc_tokens(self.forward(x, cs)), cs)
        return self.inverse(quantize_tokens(self.forward(x, cs), self.spec, self.levels), cs)

    def _alloc_tokens(self, z: torch.Tensor) -> torch.Tensor:
        """Per-token rms scale over the channels normalised by their static sd, then each channel
        on the Gaussian Lloyd-Max levels of its allocated bits (0 bits: 0)."""
        u = z / self.sd
        s = _round_scale(u.pow(2).mean(-1, keepdim=True).sqrt(), self.spec.scale_bits)
        u = u / safe_divisor(s)
        out = torch.zeros_like(u)
        for b in filter(None, self.bits.unique().tolist()):  # 0-bit channels stay 0
            m = self.bits == b
            lv = self.levels[b]
            out[:, m] = lv[torch.bucketize(u[:, m].contiguous(), ((lv[1:] + lv[:-1]) / 2).contiguous())]
        return out * s * self.sd


class LabCache:
    """One-sequence cache storing K/V per a :class:`LabSpec` and attending from what it stored.

    Prefill and decode append (positions continue from the stored length); ``reset()`` empties it.
    """

    def __init__(self, spec: LabSpec, model, calib: Calibration | None = None) -> None:
        cfg = model.config
        spec.check(cfg.head_dim)
        self.spec, self.model = spec, model
        self.num_layers, self.head_dim = cfg.num_layers, cfg.head_dim
        self.codecs = [tuple(SideCodec(sd, side, i, calib, cfg.head_dim)
                             for sd, side in zip(spec.sides(i), "kv")) for i in range(cfg.num_layers)]
        self.stage_codecs = [tuple(None if st is None else SideCodec(st, side, i, calib, cfg.head_dim)
                                   for st, side in ((spec.k_stage, "k"), (spec.v_stage, "v")))
                             for i in range(cfg.num_layers)]
        self.reset()

    def reset(self) -> None:
        n = self.num_layers
        self.k_exact: list[torch.Tensor | None] = [None] * n
        self.v_exact: list[torch.Tensor | None] = [None] * n
        self.k_store: list[torch.Tensor | None] = [None] * n
        self.v_store: list[torch.Tensor | None] = [None] * n
        self.kz_raw: list[torch.Tensor | None] = [None] * n   # KIVI: stored-frame keys as written
        self.kz_done: list[torch.Tensor | None] = [None] * n  # KIVI: quantized full groups (stored frame)

    def _cs(self, start: int, t: int):
        self.model.rope.ensure(torch.tensor([start + t - 1]))
        return self.model.rope.cos[start:start + t], self.model.rope.sin_signed[start:start + t]

    def _keys(self, layer: int, k: torch.Tensor, start: int) -> torch.Tensor:
        kc = self.codecs[layer][0]
        cs = self._cs(start, k.shape[0])
        if kc.spec.exact or kc.spec.axis == "token":
            new = kc.roundtrip(k, cs)
            old = self.k_store[layer]
            return new if old is None else torch.cat([old, new])
        z = kc.forward(k, cs)
        raw = z if self.kz_raw[layer] is None else torch.cat([self.kz_raw[layer], z])
        self.kz_raw[layer] = raw
        done = self.kz_done[layer]
        nd = 0 if done is None else done.shape[0]
        g = kc.spec.group
        full = (raw.shape[0] // g) * g
        if full > nd:
            sink = torch.arange(full) < self.spec.sink
            bits = kc.spec.bits if kc.bits is None else kc.bits

            def quantize(x, ex):
                return quantize_channels(x, bits, kc.levels, kc.spec.scale_bits == 8, ex)
            new = torch.cat([sparse_roundtrip(x, kc.spec.sparse, bits, quantize, ex)
                             for x, ex in zip(raw[nd:full].split(g), sink[nd:full].split(g))])
            if kc.spec.qjl:
                new = qjl_roundtrip(raw[nd:full], new, qjl_matrix(kc.spec.qjl, self.head_dim, layer),
                                    kc.spec.scale_bits)
            done = new if done is None else torch.cat([done, new])
            self.kz_done[layer] = done
        zq = raw if done is None else torch.cat([done, raw[done.shape[0]:]])
        return kc.inverse(zq, self._cs(0, zq.shape[0]))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from .attention import attend
        dtype = q.dtype
        q, k, v = q.float(), k.float(), v.float()
        start = 0 if self.v_exact[layer] is None else self.v_exact[layer].shape[0]
        self.k_store[layer] = self._keys(layer, k, start)
        vq = self.codecs[layer][1].roundtrip(v, self._cs(start, v.shape[0]))
        self.v_store[layer] = vq if self.v_store[layer] is None else torch.cat([self.v_store[layer], vq])
        if not (self.spec.sink or self.spec.window or self.spec.values_window):
            return attend(q, self.k_store[layer], self.v_store[layer]).to(dtype)
        kh, vh = k.half().float(), v.half().float()  # staged copies are fp16 ...
        sink = (start + torch.arange(v.shape[0]) < self.spec.sink)[:, None, None]
        ks, vs = self.stage_codecs[layer]            # ... or codes of a finer side, the sink in fp16
        if ks is not None:
            kh = torch.where(sink, kh, ks.roundtrip(k, self._cs(start, k.shape[0])))
        if vs is not None:
            vh = torch.where(sink, vh, vs.roundtrip(v, self._cs(start, v.shape[0])))
        self.k_exact[layer] = kh if self.k_exact[layer] is None else torch.cat([self.k_exact[layer], kh])
        self.v_exact[layer] = vh if self.v_exact[layer] is None else torch.cat([self.v_exact[layer], vh])
        return self._mixed(q, layer, start).to(dtype)

    def _mixed(self, q: torch.Tensor, layer: int, start: int) -> torch.Tensor:
        """Attention where key j is read exactly by query i iff ``j < sink`` or ``i - j < window``
        (value j: ``i - j < values_window``)."""
        kq, vq, ke, ve = self.k_store[layer], self.v_store[layer], self.k_exact[layer], self.v_exact[layer]
        n, t = kq.shape[0], q.shape[0]
        hq, h, d = q.shape[1], kq.shape[1], q.shape[2]
        rep = hq // h
        qh = q.transpose(0, 1)                                   # [Hq, t, D]
        out = torch.empty_like(q)
        for s0 in range(0, t, 256):
            qi = torch.arange(start + s0, start + min(t, s0 + 256))  # query positions
            j = torch.arange(n)
            sink, back = j[None, :] < self.spec.sink, qi[:, None] - j[None, :]
            exact = sink | (back < self.spec.window)
            exact_v = sink | (back < self.spec.values_window)
            causal = j[None, :] <= qi[:, None]
            qq = qh[:, s0:s0 + len(qi)]
            sq = torch.einsum("gtd,gsd->gts", qq, kq.repeat_interleave(rep, 1).transpose(0, 1))
            se = torch.einsum("gtd,gsd->gts", qq, ke.repeat_interleave(rep, 1).transpose(0, 1))
            sc = torch.where(exact, se, sq) / math.sqrt(d)
            p = torch.softmax(sc.masked_fill(~causal, -math.inf), -1)
            vqh, veh = vq.repeat_interleave(rep, 1).transpose(0, 1), ve.repeat_interleave(rep, 1).transpose(0, 1)
            o = torch.einsum("gts,gsd->gtd", p * (~exact_v), vqh) + torch.einsum("gts,gsd->gtd", p * exact_v, veh)
            out[s0:s0 + len(qi)] = o.transpose(0, 1)
        return out
