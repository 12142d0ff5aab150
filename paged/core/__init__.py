"""The memory manager and scheduler, in pure Python (imports neither torch, pandas nor plotly).

``BlockPool`` (ids, ref counts, the free/LRU queue) -> ``KVCacheManager`` (the one owner of
block tables) <- ``Scheduler`` (continuous batching: budget, chunking, preemption). Every state
change is an event on a ``Recorder``. ``CacheConfig`` and ``SchedulerConfig`` (``paged.core.config``)
are the settings both executors share.
"""
from .block_pool import Block, BlockPool
from .config import CacheConfig
from .events import Event, NullRecorder, Recorder
from .kv_manager import KVCacheManager
from .request import Request, RequestStatus
from .scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput

__all__ = ["Block", "BlockPool", "CacheConfig", "Event", "KVCacheManager", "NullRecorder", "Recorder", "Request",
           "RequestStatus", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
