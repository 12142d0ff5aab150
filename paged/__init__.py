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
]
