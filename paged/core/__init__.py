"""The memory manager, the scheduler and the step loop, in pure Python (imports neither torch, pandas nor plotly).

``BlockPool`` (ids, ref counts, the free/LRU queue) -> ``KVCacheManager`` (the one owner of
block tables; ``KVCache`` is the protocol it and the contiguous baselines implement) <-
``Scheduler`` (continuous batching: budget, chunking, preemption) <- ``StepLoop`` (schedule ->
an ``Executor`` -> update -> one ``StepRecord``). Every state change is an event on a ``Recorder``.
``CacheConfig`` and ``SchedulerConfig`` (``paged.core.config``) are the settings both executors share.
"""
from .block_pool import Block, BlockPool
from .config import CacheConfig
from .events import Event, NullRecorder, Recorder
from .kv_cache import KVCache
from .kv_manager import KVCacheManager
from .request import Request, RequestStatus
from .scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from .loop import Executed, Executor, Step, StepLoop
from .record import StepRecord

__all__ = ["Block", "BlockPool", "CacheConfig", "Event", "Executed", "Executor", "KVCache", "KVCacheManager",
           "NullRecorder", "Recorder", "Request", "RequestStatus", "ScheduledChunk", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "Step", "StepLoop", "StepRecord"]
