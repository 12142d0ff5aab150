"""``EngineConfig``: the torch engine's settings (names follow vLLM where it has them).

Every ``CacheConfig`` and ``SchedulerConfig`` knob (shared with the simulator; see
``paged.core.config.ExecutorConfig``), plus what only the engine has: ``sampling_seed`` (the
default seed of requests' random sampling), the ``attention_backend``, ``split_prefill_decode``
(decode chunks and prefill chunks as two forward passes, each timed on its own; default: one mixed
pass, as vLLM does), ``record_events`` and ``warm_up`` (run one tiny request through the model
when the engine is built, so first-call costs -- torch's lazy set-up, compiled kernels -- are not
charged to the first request's TTFT; once per process and model/format/device;
``LLMEngine.warmup_s`` says what it took).

``EngineConfig(block_size=32, kv_cache_dtype="int8")`` (as ``LLM(...)`` passes it), read flat
(``config.block_size``) or by part (``config.cache``); every value is checked when the config
is built, before any model is loaded.

Engine defaults of derived settings (``paged.engine.cache_sizing``): with neither ``num_blocks``
nor ``kv_cache_memory_bytes`` the pool is 512 MiB on CPU or 40% of the free GPU memory (int4_kivi's
fixed staging pool counted inside); the CPU pool (swap preemption and the host tier) is as large
as the GPU pool unless ``num_cpu_blocks`` or ``swap_space_gib`` says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

from paged.checks import need_flag, need_int
from paged.core.config import ExecutorConfig
from paged.errors import ConfigError

__all__ = ["EngineConfig"]


def _error(msg: str) -> ConfigError:
    return ConfigError(f"EngineConfig: {msg}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig(ExecutorConfig):
    """Cache, scheduler and execution settings of an ``LLMEngine`` (see the module docstring)."""

    sampling_seed: int = 0
    attention_backend: str | None = None
    split_prefill_decode: bool = False
    record_events: bool = True
    warm_up: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "sampling_seed", need_int("sampling_seed", self.sampling_seed, _error,
                                                           hint="e.g. sampling_seed=0"))
        for name in ("split_prefill_decode", "record_events", "warm_up"):
            need_flag(name, getattr(self, name), _error)
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            raise _error(f"attention_backend must be None or a backend name, got {self.attention_backend!r}")
