"""What the engine studies share: the model they run and a greedy generate that keeps every step.

- ``study_model``: None -> a tiny random Llama checkpoint written to a fresh temporary folder
  (``make_tiny_checkpoint``, which needs ``transformers``), a name or path -> ``load_model``, a
  loaded model as it is;
- ``generate_greedy``: greedy, EOS ignored (each request produces exactly ``max_tokens``), the
  step rows as a ``paged.telemetry`` steps frame and the wall seconds of the call.
"""
from __future__ import annotations

import tempfile
import time
from typing import Any, Sequence

import pandas as pd

__all__ = ["generate_greedy", "study_model"]


def study_model(model: Any = None, *, device: str = "cpu", prefix: str = "paged-study-", **tiny: Any):
    """A ``LoadedModel`` for a study; ``tiny``: ``make_tiny_checkpoint`` shape keywords (model None only)."""
    from paged.models import load_model

    if model is None:
        from paged.models.testing import make_tiny_checkpoint
        model = make_tiny_checkpoint(tempfile.mkdtemp(prefix=prefix), "llama", **tiny)
    return load_model(model, device=device) if isinstance(model, str) else model


def generate_greedy(llm, prompts: Sequence[Sequence[int]], max_tokens: int
                    ) -> tuple[list[list[int]], pd.DataFrame, float]:
    """``llm.generate`` greedily: (token ids per prompt, steps frame, wall seconds)."""
    from paged import telemetry
    from paged.engine import SamplingParams

    rows: list[dict] = []
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        on_step=lambda s: rows.append(s.to_row()))
    wall = time.perf_counter() - t0
    return [list(o.outputs[0].token_ids) for o in outs], telemetry.steps_frame(rows), wall
