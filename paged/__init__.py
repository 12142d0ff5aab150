"""paged: a workbench to see and measure paged KV caches, continuous batching and KV quantization.

The core (pure Python): `BlockPool` -> `KVCacheManager` -> `Scheduler`, observed through a
`Recorder` whose events `paged.telemetry` turns into DataFrames.
"""
from .block_pool import Block, BlockPool
from .errors import (BlockStateError, CacheInUseError, ConfigError, DuplicateRequestError,
                     InvalidRequestError, PagedError, UnknownRequestError)
from .events import Event, NullRecorder, Recorder
from .kv_manager import KVCacheManager
from .request import Request, RequestStatus
from .scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "Block", "BlockPool", "BlockStateError", "CacheInUseError", "ConfigError", "DuplicateRequestError",
    "Event", "InvalidRequestError", "KVCacheManager", "NullRecorder", "PagedError", "Recorder", "Request",
    "RequestStatus", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "UnknownRequestError",
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams",
]

# The real-model engine needs torch; import it on first use so `import paged` stays light.
_LAZY = {"LLM": ".llm", "LLMEngine": ".engine", "EngineConfig": ".engine", "SamplingParams": ".sampling"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
