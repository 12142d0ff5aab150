"""Profile-backed linear part: a layer's measured operator times, read from vidur's profile format.

``VidurProfile.read(path, model, tensor_parallel)`` keeps the rows of a vidur ``mlp.csv``
(``paged.sim.cost_validation.read_mlp_profile``) whose shape is the model's (``n_head``,
``n_kv_head``, ``n_embd``, ``n_expanded_embd``) at that tensor-parallel degree, averages repeated
measurements of a token count and interpolates linearly in ``num_tokens`` between measured counts
(vidur measures every 8 tokens; its own predictor fits a random forest on the same column).
``CostModel(..., linear=profile)`` then prices a step's linear part as ``layers x profile(T)``
(+ the LM head, which vidur does not profile, on the closed-form roofline).

Invariants: a profile never extrapolates. A model shape or tensor-parallel degree the file does
not hold, or a step with more tokens than the largest measured count, raises ``ConfigError``
naming what the file holds and what to change.
"""
from __future__ import annotations

import os

import numpy as np

from paged.errors import ConfigError
from paged.sim.specs import ModelSpec, get_model

__all__ = ["VidurProfile"]

_SHAPE = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd")


class VidurProfile:
    """Measured seconds of one layer's linear and element-wise operators against ``num_tokens``."""

    __slots__ = ("path", "model", "tensor_parallel", "num_tokens", "seconds_per_layer")

    def __init__(self, path: str, model: ModelSpec, tensor_parallel: int, num_tokens: np.ndarray,
                 seconds_per_layer: np.ndarray) -> None:
        self.path, self.model, self.tensor_parallel = path, model, tensor_parallel
        self.num_tokens, self.seconds_per_layer = num_tokens, seconds_per_layer

    @classmethod
    def read(cls, path: str | os.PathLike, model: ModelSpec | str, tensor_parallel: int = 1) -> "VidurProfile":
        from paged.sim.cost_validation import read_mlp_profile

        path, model = os.fspath(path), get_model(model)
        df = read_mlp_profile(path)
        want = (model.num_heads, model.num_kv_heads, model.hidden_size, model.intermediate_size)
        same = df[np.logical_and.reduce([df[c] == v for c, v in zip(_SHAPE, want)])]
        if same.empty:
            have = sorted({tuple(int(v) for v in r) for r in df[list(_SHAPE)].to_numpy()})
            raise ConfigError(f"profile {path!r} holds no layer of {model.name}'s shape "
                              f"{dict(zip(_SHAPE, want))}; it holds {[dict(zip(_SHAPE, h)) for h in have]}: "
                              "profile this model or pass the matching file")
        rows = same[same["num_tensor_parallel_workers"] == tensor_parallel]
        if rows.empty:
            tps = sorted(int(t) for t in same["num_tensor_parallel_workers"].unique())
            raise ConfigError(f"profile {path!r} has {model.name} at tensor parallel {tps}, not {tensor_parallel}; "
                              "choose one of those or profile this degree")
        g = rows.groupby("num_tokens", sort=True)["measured_s"].mean()
        return cls(path, model, tensor_parallel, g.index.to_numpy(dtype=np.float64), g.to_numpy())

    def layer_seconds(self, num_tokens: np.ndarray | float) -> np.ndarray:
        """Interpolated seconds of one layer at each ``num_tokens`` (0 tokens cost 0)."""
        n = np.asarray(num_tokens, dtype=np.float64)
        lo, hi = self.num_tokens[0], self.num_tokens[-1]
        live = n > 0
        if np.any(live & ((n < lo) | (n > hi))):
            bad = float(n[live & ((n < lo) | (n > hi))].max())
            raise ConfigError(f"profile {self.path!r} measured {self.model.name} at tp={self.tensor_parallel} "
                              f"for {lo:.0f}..{hi:.0f} tokens per step, not {bad:.0f}; lower "
                              f"max_num_batched_tokens to {hi:.0f} or profile larger steps")
        return np.where(live, np.interp(n, self.num_tokens, self.seconds_per_layer), 0.0)
