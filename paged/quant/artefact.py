"""Fitting, finding and checking the calibration artefacts of split KV formats.

:func:`fit` turns a :class:`~paged.quant.calibration.Calibration` (statistics of the calibration
text, never of an evaluation text) into a :class:`kernels.split_artefact.KVArtefact`:

* ``kivi<b>+alloc`` keys: bits per (layer, head, channel), mean ``b`` per head, by greedy
  allocation (:func:`allocate_bits`) of the error each channel would add to the attention
  scores at 0 bits: the query's second moment on that channel (RoPE pairs tied) times the mean
  squared range of the channel over groups of ``block_size`` consecutive tokens / 12;
* ``cb<b>`` values: per layer the Lloyd-Max levels of ``x / absmax`` over the groups of
  (rotated, for ``+rot``) calibration values, scaled so the largest magnitude is 1.

:func:`for_model` finds the artefact a model is served with: the file named by the environment
variable ``PAGED_KV_CALIBRATION``, else the shipped one in ``data/kv_calibration/`` whose
fingerprint matches the model. A model's fingerprint (:func:`fingerprint`) is its cache
geometry and the signs of some of its weights, so the same model loaded in another dtype keeps
it, and another model (a fine-tune of the same shape included) does not.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

import torch

from paged.errors import ConfigError
from .calibration import Calibration, model_tag

__all__ = ["fit", "fingerprint", "for_model", "allocate_bits", "shipped_dir", "ENV"]

ENV = "PAGED_KV_CALIBRATION"

# Lloyd-Max distortion of a unit Gaussian at 0..8 bits (0 bits: the mean, distortion 1)
_GAUSS_D = (1.0, 0.3634, 0.1175, 0.03454, 0.009497, 0.002499, 0.000642, 0.000163, 0.0000411)


def allocate_bits(importance: torch.Tensor, mean_bits: float, max_bits: int = 8) -> torch.Tensor:
    """Integer bits per entry of ``importance`` ``[H, D]`` (each entry's error at 0 bits), exactly
    ``round(mean_bits * D)`` per row, by greedy marginal return on the Gaussian Lloyd-Max
    distortion curve (each row on its own; ties: the lower channel index)."""
    h, d = importance.shape
    bits = torch.zeros(h, d, dtype=torch.long)
    dist = torch.tensor(_GAUSS_D, dtype=torch.float64)
    imp = importance.double()
    rows = torch.arange(h)
    for _ in range(int(round(mean_bits * d))):
        gain = imp * (dist[bits] - dist[(bits + 1).clamp(max=max_bits)])
        gain[bits >= max_bits] = -1
        bits[rows, gain.argmax(-1)] += 1
    return bits


def _key_importance(calib: Calibration, layer: int, pre_rope: bool, block_size: int) -> torch.Tensor:
    x = (calib.k_pre if pre_rope else calib.k_post)[layer]
    n = (x.shape[0] // block_size) * block_size
    g = x[:n].reshape(n // block_size, block_size, *x.shape[1:])
    rng2 = (g.amax(1) - g.amin(1)).pow(2).mean(0) / 12
    w = calib.q2[layer]
    half = w.shape[-1] // 2
    w = ((w[..., :half] + w[..., half:]) / 2).repeat(1, 2)  # one weight per RoPE pair
    return w * rng2


def _value_levels(calib: Calibration, layer: int, bits: int, group: int, rotate: bool) -> torch.Tensor:
    from kernels.split import hadamard, lloyd_levels
    x = calib.v[layer]
    if rotate:
        x = x @ hadamard(x.shape[-1])
    xg = x.reshape(-1, group)
    a = xg.abs().amax(-1, keepdim=True)
    u = xg / torch.where(a == 0, torch.ones_like(a), a)
    lv = lloyd_levels(u.flatten()[:: max(1, u.numel() // 200000)], 1 << bits)
    return lv / lv.abs().max()


def fit(calib: Calibration, formats: Iterable[str], block_sizes: Iterable[int], model) -> "KVArtefact":
    """An artefact with every table the split ``formats`` need at each of ``block_sizes``."""
    from kernels import get_format
    from kernels.split_artefact import KVArtefact, k_key, v_key
    art = KVArtefact(calib.model_tag, fingerprint(model), calib.source, calib.num_tokens)
    for name in formats:
        fmt = get_format(name)
        if not fmt.split:
            raise ConfigError(f"{name!r} is not a split format (K/V...); nothing to calibrate")
        ks, vs = fmt.k_side, fmt.v_side
        for bs in block_sizes:
            if ks.alloc and k_key(ks, bs) not in art.entries:
                art.entries[k_key(ks, bs)] = torch.stack([
                    allocate_bits(_key_importance(calib, i, ks.pre_rope, bs), ks.bits)
                    for i in range(calib.num_layers)]).to(torch.int8)
        if vs.calibrated and v_key(vs) not in art.entries:
            art.entries[v_key(vs)] = torch.stack([_value_levels(calib, i, vs.bits, vs.group, vs.rotate)
                                                  for i in range(calib.num_layers)])
    return art


def fingerprint(model) -> str:
    """Cache geometry + a hash of the signs of the first weights of the embedding and of the first
    and last layers' attention projections (the same in any dtype the model is loaded in)."""
    cfg = model.config
    h = hashlib.sha256(model_tag(cfg).encode())
    tensors = [model.embed_tokens.weight, model.layers[0].self_attn.qkv_proj.weight,
               model.layers[-1].self_attn.qkv_proj.weight]
    for t in tensors:
        x = t.detach().reshape(-1)[:4096].float().cpu()
        sig = torch.where(x.abs() > 1e-3, torch.sign(x), torch.zeros_like(x)).to(torch.int8)
        h.update(sig.numpy().tobytes())
    return h.hexdigest()


def shipped_dir() -> Path:
    """``data/kv_calibration`` of this checkout."""
    return Path(__file__).resolve().parents[2] / "data" / "kv_calibration"


def for_model(model, fmt, block_size: int):
    """The artefact to serve ``model`` in split format ``fmt`` with (see the module docstring),
    checked against the model and the format; a ConfigError says what to change."""
    from kernels import KVFormatError
    from kernels.split_artefact import KVArtefact
    tag, fp = model_tag(model.config), fingerprint(model)
    path = os.environ.get(ENV)
    try:
        if path:
            art = KVArtefact.load(path)
        else:
            found = [KVArtefact.load(p) for p in sorted(shipped_dir().glob("*.safetensors"))]
            match = [a for a in found if a.model_tag == tag and a.model_fingerprint == fp]
            if not match:
                raise ConfigError(
                    f"kv format {fmt.name!r} needs per-layer tables fitted on this model ({tag}, weights {fp[:12]}), "
                    f"and none of the shipped artefacts ({[p.name for p in shipped_dir().glob('*.safetensors')]}) "
                    f"is for it: run `python -m paged quant-calibrate --model <model> --formats '{fmt.name}' "
                    f"--block-size {block_size} --out FILE` and set {ENV}=FILE")
            art = match[0]
        art.check_model(tag, fp)
        art.check_format(fmt, block_size)
    except KVFormatError as e:
        raise ConfigError(str(e)) from None
    return art
