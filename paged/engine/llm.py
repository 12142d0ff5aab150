"""Offline API mirroring vLLM: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

``LLM()`` / ``LLM(model="smollm2")`` loads the embedded SmolLM2-135M-Instruct (its GGUF
weights are 4-bit Q4_1, dequantized to ``dtype``: outputs come from a 4-bit-weight model).
``model`` may also be a local ``.gguf`` file or a Hugging Face directory (llama, mistral,
qwen2). Nothing is downloaded.
"""
from __future__ import annotations

import contextlib
import itertools
import numbers
from typing import Any, Sequence

import torch

from .config import EngineConfig
from .llm_engine import LLMEngine, RequestOutput, StepOutput
from paged.errors import ConfigError, InvalidRequestError, PagedError, StepFailedError, UnknownRequestError
from paged.models.loader import LoadedModel, load_model
from .sampling import SamplingParams

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.float16
    if dtype not in _DTYPES and dtype not in _DTYPES.values():
        raise ConfigError(f"dtype {dtype!r} is not supported; use 'auto', {', '.join(_DTYPES)}")
    return _DTYPES.get(dtype, dtype)  # type: ignore[arg-type]


def _device(device: str | torch.device | None) -> torch.device:
    """The requested device (default: cuda when available, else cpu); ConfigError if unusable."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r} is not a torch device ({e}); use 'cpu' or 'cuda'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available here; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")
    return dev


class LLM:
    """A model plus an ``LLMEngine`` (``self.engine``: step API, ``kv_manager``, events).

    ``device`` defaults to cuda when available, ``dtype="auto"`` to float32 on CPU and float16
    on GPU. For an already loaded ``LoadedModel`` they only check: one that disagrees with
    where the model lives is a ConfigError (load it with ``load_model(..., dtype, device)``).
    """

    def __init__(self, model: str | LoadedModel | None = "smollm2", *, device: str | torch.device | None = None,
                 dtype: str | torch.dtype = "auto", **config: Any) -> None:
        """``config``: any ``EngineConfig`` field (``block_size``, ``num_blocks``, ``kv_cache_dtype``,
        ``max_num_batched_tokens``, ...) with its default there; an unknown name is a ConfigError."""
        EngineConfig.check_names(config, ("model", "device", "dtype"))  # unknown names: one ConfigError
        engine_config = EngineConfig(**config)
        if isinstance(model, LoadedModel):
            p = next(model.model.parameters())
            want = None if device is None else _device(device)
            if want is not None and (want.type != p.device.type or want.index not in (None, p.device.index)):
                raise ConfigError(f"the model is already loaded on {p.device}, not {device!r}; pass "
                                  "device= to load_model (or give LLM a model name or path)")
            if dtype != "auto" and _dtype(dtype, p.device) != p.dtype:
                raise ConfigError(f"the model is already loaded in {p.dtype}, not {dtype!r}; pass "
                                  "dtype= to load_model (or give LLM a model name or path)")
            self.loaded = model
        else:
            dev = _device(device)
            self.loaded = load_model(model, dtype=_dtype(dtype, dev), device=dev)
        self.engine = LLMEngine(self.loaded, engine_config)
        self._ids = itertools.count(1)  # generate's request ids: gen-1, gen-2, ...

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def kv_manager(self):
        return self.engine.kv

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, on_step=None) -> list[RequestOutput]:
        """Run ``prompts`` (strings or token-id lists) to completion; outputs in input order.

        Every prompt is validated before any is queued, so a bad prompt raises and leaves the
        engine as it was; an error or interrupt while stepping aborts this call's unfinished
        requests (their blocks are freed). ``on_step(StepOutput)`` is called after every step
        (for recording).
        """
        if prompts is None or isinstance(prompts, (bytes, bytearray, dict, numbers.Number)) \
                or not hasattr(prompts, "__len__"):
            raise InvalidRequestError(f"prompts must be a string, a list of token ids or a list of those, got "
                                      f"{type(prompts).__name__} {str(prompts)[:60]}")
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(plist)
        else:
            if isinstance(sampling_params, (str, bytes, dict)) or not hasattr(sampling_params, "__iter__"):
                sampling_params = [sampling_params]  # type: ignore[list-item]
            params = list(sampling_params)
            bad = next((sp for sp in params if not isinstance(sp, SamplingParams)), None)
            if bad is not None:
                raise InvalidRequestError(f"sampling_params must be a SamplingParams or a list of them (one per "
                                          f"prompt), got {type(bad).__name__} {str(bad)[:60]}")
            if len(params) != len(plist):
                raise ConfigError(f"{len(params)} sampling params for {len(plist)} prompts")
        ids = []
        try:
            for p, sp in zip(plist, params):
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(rid, p, sp)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        failed: list[StepFailedError] = []  # outputs that could not be built; the others go on
        idle = 0
        try:
            while any(r not in results and not any(r in e.request_ids for e in failed) for r in ids):
                try:
                    out: StepOutput = self.engine.step()
                except StepFailedError as e:
                    if e.step_output is None:
                        raise
                    failed.append(e)
                    out = e.step_output
                results.update((ro.request_id, ro) for ro in out.finished)
                idle = 0 if (out.scheduled or out.finished) else idle + 1
                if idle > 100:
                    raise PagedError("the scheduler made no progress in 100 steps; the cache is too small "
                                     "for the waiting requests (raise num_blocks)")
                if on_step is not None:
                    on_step(out)
                    gone = [r for r in ids if r not in results and not self.engine.has_request(r)]
                    if gone:
                        raise PagedError(f"request(s) {gone} were aborted inside generate (by on_step); "
                                         "use the engine's step API (add_request/step/abort) to abort "
                                         "requests and keep what they produced")
        except BaseException:  # an error, or Ctrl-C in a notebook: leave no orphaned requests behind
            for rid in ids:
                if rid not in results:
                    with contextlib.suppress(UnknownRequestError):  # on_step aborted it already
                        self.engine.abort(rid)
            raise
        if failed:
            lost = [r for r in ids if r not in results]
            err = StepFailedError(f"the outputs of request(s) {lost} could not be built ({failed[0]}); the "
                                  "others are in .outputs (None for the lost ones)", lost)
            err.outputs = [results.get(r) for r in ids]  # type: ignore[attr-defined]
            raise err from failed[0]
        return [results[r] for r in ids]
