"""The torch executor: the step loop over a real model on the paged KV cache.

``LLMEngine`` (schedule -> cache ops -> forward -> sample -> update -> record) and ``LLM``,
its offline batch API. Imports torch.
"""
from .config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput, StepOutput
from .sampling import SamplingParams

__all__ = ["CompletionOutput", "EngineConfig", "LLM", "LLMEngine", "RequestOutput", "SamplingParams",
           "StepOutput"]
