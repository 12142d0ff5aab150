"""Studies a sweep can run, by name.

A study is a named, importable function of plain parameters returning its results: a dict (one
row), or a DataFrame (one or more rows; each row becomes a row of the sweep's table next to the
point's parameters). It is called as ``fn(**defaults, **point)`` or, for ``call="point"``, as
``fn({**defaults, **point})``. It declares what one call needs (``num_cpus``, ``num_gpus``: the
resources of one Ray task), which result columns to leave out (``drop``: e.g. its own timing,
which the sweep measures for every point), which parameters name files whose contents are
part of the point's identity (``files``: a changed trace file is a new point) and which keys a
point may have (``keys``: an import path of a function returning them; by default a
``"kwargs"`` study's parameter names, unless it takes ``**kwargs``). ``sweep`` checks every
point's keys before any point runs, so a typo is one error naming the valid keys.

``STUDIES`` maps a name to a ``Study`` whose ``target`` is an import path ``"module:function"``,
so re-pointing a study after a module moves is a change of one string. Workers import the target
themselves: a study runs wherever the package is installed, whatever the driver imported.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Mapping

from paged.errors import ConfigError


@dataclass(frozen=True)
class Study:
    """One study: ``name`` (its identity in the point store), ``target`` (``"module:function"``
    or a picklable callable), how it is called, its resources and result filters."""

    name: str
    target: str | Callable[..., Any]
    call: Literal["kwargs", "point"] = "kwargs"
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    defaults: Mapping[str, Any] = field(default_factory=dict)
    drop: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    keys: str | None = None
    doc: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ConfigError(f"a study name is a non-empty string without '/', got {self.name!r}")
        if self.call not in ("kwargs", "point"):
            raise ConfigError(f"Study.call must be 'kwargs' or 'point', got {self.call!r}")
        if isinstance(self.target, str) and ":" not in self.target:
            raise ConfigError(f"Study.target {self.target!r}: write 'package.module:function'")
        if not isinstance(self.target, str) and not callable(self.target):
            raise ConfigError(f"Study.target must be 'module:function' or a callable, got {self.target!r}")
        if not (self.num_cpus >= 0 and self.num_gpus >= 0):
            raise ConfigError(f"study {self.name!r}: num_cpus and num_gpus must be >= 0, "
                              f"got {self.num_cpus!r}, {self.num_gpus!r}")

    def resolve(self) -> Callable[..., Any]:
        """The function (imported here: in a worker, the worker's own copy of the package)."""
        if not isinstance(self.target, str):
            return self.target
        module, _, attr = self.target.partition(":")
        try:
            fn: Any = importlib.import_module(module)
            for part in attr.split("."):
                fn = getattr(fn, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"study {self.name!r}: cannot import {self.target!r} ({e}); "
                              f"re-point it in paged/sweeps/registry.py") from e
        if not callable(fn):
            raise ConfigError(f"study {self.name!r}: {self.target!r} is not callable")
        return fn

    def valid_keys(self) -> tuple[str, ...] | None:
        """The keys a point may have (``keys``, else the parameters of a ``"kwargs"`` study's
        function); None when any key may be given."""
        if self.keys is not None:
            return tuple(Study(self.name, self.keys).resolve()())
        if self.call == "point":
            return None
        params = signature_of(self).parameters.values()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return None
        return tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))

    def check_keys(self, points: "list[Mapping[str, Any]]") -> None:
        """ConfigError naming every key of ``points`` this study does not take, and the valid
        keys (``"point"`` studies may also carry ``_``-prefixed labels)."""
        valid = self.valid_keys()
        if valid is None:
            return
        given = {k for p in points for k in p}
        unknown = sorted(k for k in given - set(valid) - set(self.defaults)
                         if not (self.call == "point" and k.startswith("_")))
        if unknown:
            raise ConfigError(f"study {self.name!r}: unknown key(s) {', '.join(unknown)}; valid keys: "
                              f"{', '.join(valid)}")

    def __call__(self, params: Mapping[str, Any]) -> Any:
        fn = self.resolve()
        args = {**self.defaults, **params}
        return fn(args) if self.call == "point" else fn(**args)

    @property
    def identity(self) -> str:
        """What the point store keys on besides the parameters: the name and the fixed defaults
        (not the target, so a study that moves keeps its stored points)."""
        if not self.defaults:
            return self.name
        return self.name + "|" + ",".join(f"{k}={self.defaults[k]!r}" for k in sorted(self.defaults))


_SIM_TIMING = ("wall_s", "sim_requests_per_wall_s")  # the simulator's own wall time: varies run to run

# Import paths (paged.studies, paged.quant); after a module moves, change its target string here.
STUDIES: dict[str, Study] = {s.name: s for s in (
    Study("simulate", "paged.studies.grid:run_point", call="point", drop=_SIM_TIMING, files=("trace", "calibration"),
          keys="paged.studies.grid:point_keys", doc="one simulated deployment: SimConfig fields + trace keys -> the run summary"),
    Study("memory_story", "paged.studies.papers:memory_story", doc="vLLM paper Fig. 2: token share per allocator"),
    Study("interference", "paged.studies.papers:interference_study",
          doc="Sarathi-Serve: p99 TBT/TTFT without and with chunked prefill"),
    Study("block_size_ablation", "paged.studies.papers:block_size_ablation", doc="vLLM paper Fig. 18"),
    Study("host_tier", "paged.studies.host_tier:tier_study", doc="recompute vs host tier on shared prefixes (simulated)"),
    Study("offload", "paged.studies.offload:offload_study", doc="when swap preemption pays at scale (simulated)"),
    Study("streaming", "paged.studies.offload:streaming_study", doc="KV streaming from host memory (modelled)"),
    Study("compaction", "paged.studies.compaction:compaction_sim_table", doc="block compaction on vs off (simulated)"),
    Study("preemption_modes", "paged.studies.preemption:simulate_modes", doc="recompute vs swap (simulated)"),
    Study("prefix_eviction", "paged.studies.prefix_caching:eviction_sweep", doc="prefix hit rate vs pool size (simulated)"),
    Study("preemption_cost", "paged.studies.preemption:cost_table", doc="recompute vs swap priced per context length"),
    Study("engine_swap", "paged.studies.preemption:engine_swap_study", doc="swap transports on the real engine"),
    Study("engine_host_tier", "paged.studies.host_tier:engine_tier_study", doc="host tier on the real engine"),
    Study("kv_formats", "paged.studies.kv_formats:side_by_side",
          doc="greedy text of one prompt under each KV format on the real engine"),
    Study("quant", "paged.quant.study:study", defaults={"progress": False},
          doc="KV-quantization error study (perplexity, KL, greedy divergence)"),
    Study("sharing", "paged.studies.sharing:sharing_study", doc="cross-layer KV sharing: memory vs quality"),
    Study("fleet_routing", "paged.fleet.study:routing_study", drop=("wall_s",),
          doc="a simulated fleet: routing policy x replicas x pool -> hit rate, TTFT, replica spread"),
    Study("fleet_numa", "paged.fleet.numa:numa_point",
          doc="NUMA host tier: one placement policy (and interleave) -> remote-socket accesses, transfer time"),
    Study("fleet_disagg", "paged.fleet.disagg_pools:disagg_study",
          doc="prefill/decode pools vs colocated (with and without chunked prefill): SLO attainment, goodput"),
    Study("swap_error", "paged.studies.swap_error:swap_error_study", doc="the error compressed swap adds"),
    Study("mooncake_table", "paged.studies.mooncake:table2", doc="Mooncake Table 2: requests, lengths, reuse"),
    Study("fleet_pool", "paged.fleet.pool_study:pool_point", files=("trace",),
          doc="Mooncake Fig. 10: per-node caches vs a pooled KV tier (cache-only replay, cost-model prefill)"),
    Study("prefix_capacity", "paged.studies.mooncake:capacity_point", files=("trace",),
          doc="Mooncake Fig. 9: prefix hit rate at one cache capacity (cache-only replay)"),
)}


def get_study(study: "str | Study | Callable[..., Any]", *, num_cpus: float | None = None,
              num_gpus: float | None = None) -> Study:
    """A ``Study`` from a registered name, a ``Study`` or a function (named after its import
    path), with its resources overridden where given."""
    if isinstance(study, Study):
        s = study
    elif isinstance(study, str):
        if study not in STUDIES:
            raise ConfigError(f"unknown study {study!r}; registered: {', '.join(sorted(STUDIES))} "
                              f"(or pass a function or a paged.sweeps.Study)")
        s = STUDIES[study]
    elif callable(study):
        name = f"{getattr(study, '__module__', None) or 'callable'}.{getattr(study, '__qualname__', repr(study))}"
        if "<lambda>" in name or "<locals>" in name:
            raise ConfigError(f"{name} cannot be sent to a worker process by name; define the study at the top "
                              f"level of a module (or wrap it in paged.sweeps.Study with a name)")
        s = Study(name.replace("/", "."), study)
    else:
        raise ConfigError(f"study must be a registered name, a Study or a function, got {type(study).__name__}")
    over = {k: v for k, v in (("num_cpus", num_cpus), ("num_gpus", num_gpus)) if v is not None}
    return replace(s, **over) if over else s


def register(study: Study, *, replace_existing: bool = False) -> Study:
    """Add ``study`` to ``STUDIES`` (refuses to shadow a registered name unless asked)."""
    if study.name in STUDIES and not replace_existing:
        raise ConfigError(f"a study named {study.name!r} is registered already; pass replace_existing=True")
    STUDIES[study.name] = study
    return study


def signature_of(study: Study) -> inspect.Signature:
    """The resolved function's signature (for checks and docs)."""
    return inspect.signature(study.resolve())


__all__ = ["Study", "STUDIES", "get_study", "register", "signature_of"]
