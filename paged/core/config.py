"""One configuration for both executors: the KV cache (``CacheConfig``) and the scheduler
(``SchedulerConfig``).

Each knob has one name, one default and one check, written here; both configs are frozen and
check every field in ``__post_init__``, so a config that exists is valid (values are normalized
on the way: numpy integers become ``int``, KV-format aliases their canonical name). The engine's
``EngineConfig`` and the simulator's ``SimConfig`` embed one of each (``.cache``,
``.scheduler``), and both executors build their KV manager from the ``CacheConfig`` with
``paged.core.kv_factory.build_kv_manager``. ``ExecutorConfig`` is the flat base of those two: every cache and
scheduler knob as its own field, the two parts built from them once, in ``__post_init__``.

Units are stated in names where a quantity has one: bytes (``kv_cache_memory_bytes``), GiB
(``swap_space_gib``), seconds (``_s``); a share is a float in [0, 1].

What stays executor-specific is derived from these knobs where the executor knows enough: the
number of GPU blocks (``num_blocks`` wins, then ``kv_cache_memory_bytes``; otherwise the engine
uses 512 MiB on CPU / 40% of free GPU memory, the simulator ``gpu_memory_utilization`` of the
modelled GPU), the ``"auto"`` KV format (the model's dtype) and the CPU pool (``cpu_pool_blocks``).
"""
from __future__ import annotations

import operator
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any, Callable, ClassVar, Mapping

from paged.checks import need_flag, need_int, need_real
from paged.errors import ConfigError

from kernels import format_table as _formats
from .eviction import make_policy
from .prefix_cache import DEFAULT_HASH_FN, resolve_hash_fn

__all__ = ["CacheConfig", "DEFAULT_TOKEN_BUDGET", "ExecutorConfig", "GiB", "KV_CACHE_DTYPES", "SWAP_COMPRESSIONS", "SWAP_MODES",
           "SchedulerConfig", "check_share_map", "cpu_pool_blocks", "flat_knobs"]

GiB = 1024**3
DEFAULT_TOKEN_BUDGET = 2048
"""Tokens per step when chunked prefill is on and no budget is given (vLLM's default)."""
SWAP_MODES = ("sync", "overlap")
SWAP_COMPRESSIONS = (None, "fp8", "int4")
KV_CACHE_DTYPES = ("auto", *_formats.FORMATS, *_formats.ALIASES)
"""Every accepted ``kv_cache_dtype`` spelling: 'auto', the formats, then their aliases ('fp8', 'half', ...)."""


def canonical_kv_cache_dtype(name: Any) -> str:
    """``name`` as its canonical format name ('fp8' -> 'fp8_e4m3'), or 'auto' (the model's dtype,
    resolved by the executor); ConfigError for anything else."""
    if isinstance(name, str) and name.strip().lower() == "auto":
        return "auto"
    if isinstance(name, str):
        try:
            return _formats.lookup(name.strip()).name
        except _formats.KVFormatError as e:
            if "/" in name or "@" in name:  # a split format spelled wrong: its parser says what
                raise ConfigError(f"kv_cache_dtype {name!r}: {e}") from None
    raise ConfigError(f"kv_cache_dtype {name!r} is not a KV format; use 'auto' (the model's dtype), one of "
                      f"{', '.join(_formats.FORMATS)} (aliases: {', '.join(_formats.ALIASES)}), or a split "
                      "format 'K/V[@sinkS][@winW]' (docs/quant.md)")


def check_share_map(share: Mapping[int, int] | None, num_layers: int | None = None) -> dict[int, int] | None:
    """A cross-layer sharing map (``{shared layer: owner layer}``, see ``paged.engine.kv_sharing``)
    as a dict of ints (None when empty or None), or ConfigError saying what to change. Without
    ``num_layers`` only types and the order rules are checked (the engine checks ranges once
    the model is known)."""
    if share is None:
        return None
    if not isinstance(share, Mapping):
        raise ConfigError(f"kv_share_with must be None or a dict {{layer: owner layer}} such as {{1: 0}}, "
                          f"got {type(share).__name__} {str(share)[:60]}")
    out: dict[int, int] = {}
    for i, j in share.items():
        try:
            if isinstance(i, bool) or isinstance(j, bool):
                raise TypeError
            out[operator.index(i)] = operator.index(j)
        except TypeError:
            raise ConfigError(f"kv_share_with entries are integer layer indices, got {i!r}: {j!r}; "
                              "e.g. kv_share_with={1: 0}") from None
    for i, j in sorted(out.items()):
        if i < 0 or j < 0:
            raise ConfigError(f"kv_share_with {{{i}: {j}}}: layer indices are >= 0")
        if i == j:
            raise ConfigError(f"kv_share_with {{{i}: {j}}}: layer {i} shares with itself; drop the entry "
                              "(a layer not in the map keeps its own cache)")
        if j > i:
            raise ConfigError(f"kv_share_with {{{i}: {j}}}: the owner must be an earlier layer (j < i), since "
                              f"layer {i} reads K/V that layer {j} writes earlier in the same pass; use "
                              f"{{{j}: {i}}} to let layer {j} read layer {i}'s cache instead")
        if j in out:
            raise ConfigError(f"kv_share_with {{{i}: {j}}}: layer {j} is itself shared (with layer {out[j]}), so "
                              f"it has no cache; name the owner directly: {{{i}: {out[j]}}}")
    for i, j in sorted(out.items()):
        if num_layers is not None and i >= num_layers:
            raise ConfigError(f"kv_share_with {{{i}: {j}}}: layer {i} is out of range; the model has "
                              f"layers 0..{num_layers - 1}")
    return out or None


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The KV cache: blocks, pool size, format, prefix cache, eviction, host pool and its uses.

    - ``num_blocks`` (GPU blocks) wins over ``kv_cache_memory_bytes`` (all layers' K and V);
      with neither the executor sizes the pool (see the module docstring).
    - ``kv_cache_dtype``: 'auto' (the model's dtype) or a format of ``kernels.format_table``, any
      alias accepted and stored under its canonical name ('fp8' -> 'fp8_e4m3').
    - ``hash_fn``: xxh3_128 (sha256 without the xxhash package): stable across processes, and as
      fast as Python's builtin hash in the simulator; hits are verified on tokens and parent, so
      the hash never changes a result (collisions only cost hits).
    - CPU pool, shared by swap preemption and the host tier: ``num_cpu_blocks`` blocks, or
      ``swap_space_gib`` GiB of host blocks (give at most one); see ``cpu_pool_blocks`` for the default.
    - ``swap_mode``: 'sync' or 'overlap' (transfers beside the forward pass); ``swap_compression``:
      None, 'fp8' or 'int4' host blocks (lossy; fewer bytes over the link).
    - host tier (``paged.core.host_tier``): cached-free prefix blocks go to the CPU pool instead of
      being dropped; ``eviction``/``host_eviction`` are each tier's policy ('lru', 'lfu', 'weighted',
      'score[:k=v,...]'); ``host_tier_threshold`` < 1 demotes proactively once that share of GPU
      blocks is used or cached-free (1.0: only on eviction).
    - ``kv_share_with``: ``{layer: earlier owner layer}``, cross-layer KV sharing (engine; the
      simulator counts only the owner layers' bytes).
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    hash_fn: str | Callable = DEFAULT_HASH_FN
    eviction: str = "lru"
    num_cpu_blocks: int | None = None
    swap_space_gib: float | None = None
    swap_mode: str = "sync"
    swap_compression: str | None = None
    enable_host_tier: bool = False
    host_eviction: str = "lru"
    host_tier_threshold: float = 1.0
    kv_share_with: dict[int, int] | None = None

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen
        put("block_size", need_int("block_size", self.block_size, ConfigError, minimum=1,
                                   hint="a power of two such as 16"))
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two (1, 2, 4, ..., 16, ...), got {self.block_size!r}")
        put("num_blocks", need_int("num_blocks", self.num_blocks, ConfigError, minimum=1, optional=True))
        put("kv_cache_memory_bytes", need_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, ConfigError,
                                              minimum=1, optional=True, hint="bytes, e.g. 1 << 30 for 1 GiB"))
        put("kv_cache_dtype", canonical_kv_cache_dtype(self.kv_cache_dtype))
        for name in ("enable_prefix_caching", "enable_host_tier"):
            need_flag(name, getattr(self, name), ConfigError)
        if not isinstance(self.hash_fn, str) and not callable(self.hash_fn):
            raise ConfigError(f"hash_fn must be a name ('xxh3_128', 'sha256', 'builtin') or a callable, "
                              f"got {self.hash_fn!r}")
        try:
            resolve_hash_fn(self.hash_fn)
        except ConfigError as e:
            raise ConfigError(f"hash_fn={self.hash_fn!r}: {e}") from None
        for name in ("eviction", "host_eviction"):
            spec = getattr(self, name)
            if not isinstance(spec, str):
                raise ConfigError(f"{name} must be a policy name such as 'lru' or 'score:decay=0.999', got {spec!r}")
            try:
                make_policy(spec)  # parses the name and its parameters
            except ConfigError as e:
                raise ConfigError(f"{name}={spec!r}: {e}") from None
        put("num_cpu_blocks", need_int("num_cpu_blocks", self.num_cpu_blocks, ConfigError, minimum=0, optional=True))
        put("swap_space_gib", need_real("swap_space_gib", self.swap_space_gib, ConfigError, minimum=0.0,
                                        optional=True, hint="GiB of host memory for the CPU pool"))
        if self.num_cpu_blocks is not None and self.swap_space_gib is not None:
            raise ConfigError(f"give the CPU pool as num_cpu_blocks (blocks) or swap_space_gib (GiB), not both; got "
                              f"num_cpu_blocks={self.num_cpu_blocks}, swap_space_gib={self.swap_space_gib}")
        if self.swap_mode not in SWAP_MODES:
            raise ConfigError(f"swap_mode must be one of {SWAP_MODES}, got {self.swap_mode!r}")
        if self.swap_compression not in SWAP_COMPRESSIONS:
            raise ConfigError(f"swap_compression must be one of {SWAP_COMPRESSIONS}, got {self.swap_compression!r}")
        put("host_tier_threshold", need_real("host_tier_threshold", self.host_tier_threshold, ConfigError, minimum=0.0,
                                             maximum=1.0, open_min=True, hint="1.0 demotes only on eviction"))
        if self.host_tier_threshold != 1.0 and not self.enable_host_tier:
            raise ConfigError(f"host_tier_threshold={self.host_tier_threshold} needs enable_host_tier=True")
        if self.enable_host_tier and not self.enable_prefix_caching:
            raise ConfigError("enable_host_tier=True keeps prefix-cache blocks: set enable_prefix_caching=True")
        if self.enable_host_tier and (self.num_cpu_blocks == 0 or self.swap_space_gib == 0):
            raise ConfigError("enable_host_tier=True needs a CPU pool: give num_cpu_blocks >= 1 or swap_space_gib > 0 "
                              "(or leave both unset)")
        put("kv_share_with", check_share_map(self.kv_share_with))


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """What runs each step: token budget, sequence slots, chunked prefill, preemption, policy.

    - ``max_num_batched_tokens`` None follows vLLM's rule (``resolved``): 2048 with chunked
      prefill, else ``max(2048, max_model_len)``, so any prompt the model takes fits in one step.
    - ``max_model_len`` None: the model's context (the engine also caps it at the pool's tokens).
    - ``preemption_mode``: 'recompute' or 'swap' (falls back to recompute when the CPU pool is full).
    - ``priority_aging_steps`` (policy 'priority'): one priority level is worth this many steps of
      waiting, so a request is never starved by later arrivals of better priority (None: strict).
    - ``watermark``: share of blocks kept free when admitting new requests.
    - block compaction (``paged.core.compaction``, lossless): every ``compaction_interval`` steps,
      when the running requests' fragmentation exceeds ``compaction_threshold``, one pass of at most
      ``compaction_max_copies`` copies (None: no limit); ``compaction_drop_cached`` may drop
      cached-free blocks. The scheduler decides when, as it decides preemption, so these live here.
    """

    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    policy: str = "fcfs"
    watermark: float = 0.01
    priority_aging_steps: int | None = 1000
    enable_block_compaction: bool = False
    compaction_threshold: float = 0.25
    compaction_interval: int = 16
    compaction_max_copies: int | None = None
    compaction_drop_cached: bool = False

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen
        for name, minimum, optional in (("max_num_batched_tokens", 1, True), ("max_num_seqs", 1, False),
                                        ("max_model_len", 1, True), ("priority_aging_steps", 1, True),
                                        ("compaction_interval", 1, False), ("compaction_max_copies", 1, True)):
            put(name, need_int(name, getattr(self, name), ConfigError, minimum=minimum, optional=optional))
        for name in ("enable_chunked_prefill", "enable_block_compaction", "compaction_drop_cached"):
            need_flag(name, getattr(self, name), ConfigError)
        if self.preemption_mode not in ("recompute", "swap"):
            raise ConfigError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        put("watermark", need_real("watermark", self.watermark, ConfigError, minimum=0.0, maximum=1.0, open_max=True))
        put("compaction_threshold", need_real("compaction_threshold", self.compaction_threshold, ConfigError,
                                              minimum=0.0, maximum=1.0, hint="a fragmentation share"))

    def resolved(self, max_model_len: int) -> "SchedulerConfig":
        """This config for a deployment of ``max_model_len`` tokens per request: that length, and
        the token budget of vLLM's rule when none was given (see the class docstring)."""
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_TOKEN_BUDGET if self.enable_chunked_prefill else max(DEFAULT_TOKEN_BUDGET, max_model_len)
        if budget == self.max_num_batched_tokens and max_model_len == self.max_model_len:
            return self
        return replace(self, max_num_batched_tokens=budget, max_model_len=max_model_len)

    @classmethod
    def of(cls, config: object, max_model_len: int) -> "SchedulerConfig":
        """The resolved scheduler settings of an executor's config (its ``.scheduler``), or of any
        object with some of these field names."""
        sched = getattr(config, "scheduler", None)
        if not isinstance(sched, SchedulerConfig):
            sched = cls(**{f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)})
        return sched.resolved(max_model_len)


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig(SchedulerConfig, CacheConfig):  # fields: the cache's first, then the scheduler's
    """Every ``CacheConfig`` and ``SchedulerConfig`` knob as a flat field of one frozen dataclass
    (the base of ``EngineConfig`` and ``SimConfig``), and the two parts built from them:
    ``cache`` and ``scheduler`` (read-only; ``dataclasses.replace(config, block_size=8)`` builds
    them anew). Each part checks its own fields, once; the normalized values are kept here too,
    so ``config.block_size == config.cache.block_size`` always."""

    PARTS: ClassVar[dict[str, type]] = {"cache": CacheConfig, "scheduler": SchedulerConfig}
    cache: CacheConfig = field(init=False, repr=False, compare=False)
    scheduler: SchedulerConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, part_cls in self.PARTS.items():
            part = part_cls(**{f.name: getattr(self, f.name) for f in fields(part_cls)})
            object.__setattr__(self, name, part)
            for f in fields(part_cls):
                object.__setattr__(self, f.name, getattr(part, f.name))

    @classmethod
    def knob_fields(cls) -> dict[str, Field]:
        """Every setting this config is built from (its ``__init__`` fields), by name."""
        return {f.name: f for f in fields(cls) if f.init}

    @classmethod
    def part_of(cls, name: str) -> str | None:
        """'cache' or 'scheduler' for a knob of that part; None for the config's own."""
        return next((p for p, part_cls in cls.PARTS.items() if name in {f.name for f in fields(part_cls)}), None)

    @classmethod
    def check_names(cls, kwargs: Mapping[str, Any], also: tuple[str, ...] = ()) -> None:
        """ConfigError naming every unknown setting in ``kwargs`` and the valid ones (``also``:
        names the caller takes itself, listed first)."""
        unknown = sorted(set(kwargs) - set(cls.knob_fields()) - set(also))
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; valid: "
                              f"{', '.join([*also, *cls.knob_fields()])}")

    def as_dict(self) -> dict[str, Any]:
        """Every setting by name (``type(self)(**self.as_dict()) == self``)."""
        return {name: getattr(self, name) for name in self.knob_fields()}


def flat_knobs(*parts: CacheConfig | SchedulerConfig) -> dict[str, Any]:
    """The settings of ``parts`` as flat keywords, for ``paged.LLM(**flat_knobs(cache, scheduler))`` or
    ``SimConfig(model=..., **flat_knobs(cache, scheduler))`` (a config is built from its knobs, not its parts)."""
    return {f.name: getattr(p, f.name) for p in parts for f in fields(p) if f.init}


def cpu_pool_blocks(cache: CacheConfig, preemption_mode: str, num_blocks: int, host_block_bytes: float,
                    default_swap_space_gib: float | None) -> int:
    """Blocks of the CPU pool: ``num_cpu_blocks`` when given; else, when swap preemption or the
    host tier needs a pool, ``swap_space_gib`` GiB of ``host_block_bytes`` blocks, where an unset
    ``swap_space_gib`` means ``default_swap_space_gib`` GiB (the simulator: 4, vLLM's default per GPU) or,
    when that is None, as many blocks as the GPU pool (the engine, which allocates the pool on
    this machine); else 0."""
    if cache.num_cpu_blocks is not None:
        return cache.num_cpu_blocks
    if preemption_mode != "swap" and not cache.enable_host_tier:
        return 0
    gib = cache.swap_space_gib if cache.swap_space_gib is not None else default_swap_space_gib
    return num_blocks if gib is None else int(gib * GiB // host_block_bytes)
