"""paged: a workbench to see and measure paged KV caches, continuous batching and KV quantization.

The core (pure Python): `BlockPool` -> `KVCacheManager` -> `Scheduler`, observed through a
`Recorder` whose events `paged.telemetry` turns into DataFrames.
"""
from .core import (Block, BlockPool, CacheConfig, Event, Executor, KVCache, KVCacheManager, NullRecorder, Recorder,
                   Request, RequestStatus, ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput, StepLoop,
                   StepRecord)
from .errors import (BlockStateError, CacheInUseError, ConfigError, DuplicateRequestError,
                     InvalidRequestError, ModelLoadError, PagedError, StepFailedError, UnknownRequestError)

__all__ = [
    "Block", "BlockPool", "BlockStateError", "CacheConfig", "CacheInUseError", "ConfigError", "DuplicateRequestError",
    "Event", "Executor", "InvalidRequestError", "KVCache", "KVCacheManager", "ModelLoadError", "NullRecorder", "PagedError", "Recorder", "Request",
    "RequestStatus", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "StepFailedError", "StepLoop", "StepRecord", "UnknownRequestError",
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "Simulator", "SimConfig", "sweep",
]

# The real-model engine needs torch; import it on first use so `import paged` stays light.
_LAZY = {"LLM": ".engine", "LLMEngine": ".engine", "EngineConfig": ".engine", "SamplingParams": ".engine",
         "Simulator": ".sim", "SimConfig": ".sim", "sweep": ".sweeps"}  # paged.sweep(study, grid, ...)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
