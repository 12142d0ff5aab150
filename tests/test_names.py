"""One name per concept and one unit per kind of quantity, across every config and entry point:
the engine's and the simulator's configs, ``LLM``, the CLI, the sweep's ``simulate`` keys, the
trace generators and the KV manager. Fails when two of them spell the same knob differently."""
from __future__ import annotations

import inspect
import itertools

from paged.core.kv_parts import KVCacheParts
from paged.engine import LLM, EngineConfig
from paged.sim.simulator import SimConfig
from paged.sim.workload import synthetic_trace, with_shared_prefix

# A word that only qualifies a name (unit, "enable", what a seed seeds): a name that is another name
# plus only such words spells the same knob twice (seed / trace_seed, fraction / prefix_fraction,
# host_tier / enable_host_tier, swap_space / swap_space_gib).
QUALIFIERS = {"gib", "bytes", "mib", "gb", "ms", "s", "enable", "trace", "prompt", "sampling", "prefix", "policy"}
# Spellings retired for today's (kv_format -> kv_cache_dtype, swap_overlap -> swap_mode, ...)
RETIRED = {"kv_format", "swap_overlap", "seed", "swap_space", "kv_cache_memory", "fraction", "host_tier", "zipf"}
UNITS = ("_bytes", "_gib", "_utilization")


def _params(fn) -> set[str]:
    return {p.name for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}


def sources() -> dict[str, set[str]]:
    from paged.cli import build_parser
    from paged.studies import grid

    sub = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse offers no public walk
    cli = {a.dest for name in ("simulate", "sweep") for a in sub[name]._actions}  # noqa: SLF001
    return {"EngineConfig": set(EngineConfig.knob_fields()), "SimConfig": set(SimConfig.knob_fields()),
            "LLM": _params(LLM.__init__), "cli": cli - {"help", "func", "command"},
            "sweep": set(grid.point_keys()) if hasattr(grid, "point_keys") else {*SimConfig.knob_fields(), *grid.TRACE_KEYS},
            "synthetic_trace": _params(synthetic_trace), "with_shared_prefix": _params(with_shared_prefix),
            "KVCacheManager": _params(KVCacheParts.__init__)}


def test_no_two_entry_points_spell_one_knob_differently():
    names = {n: src for src, ns in sources().items() for n in ns}
    clashes = []
    for a, b in itertools.permutations(names, 2):
        ta, tb = set(a.split("_")), set(b.split("_"))
        if ta < tb and tb - ta <= QUALIFIERS:
            clashes.append(f"{a!r} ({names[a]}) vs {b!r} ({names[b]})")
    assert not clashes, "one knob, two spellings: " + "; ".join(sorted(clashes))


def test_retired_spellings_are_accepted_nowhere():
    found = {src: sorted(ns & RETIRED) for src, ns in sources().items() if ns & RETIRED}
    assert not found, f"old spellings still accepted: {found}"


def test_a_memory_quantity_states_its_unit():
    """Bytes or GiB, said in the name; a share of memory says it is one."""
    bad = sorted(n for ns in sources().values() for n in ns
                 if ("memory" in n or "space" in n) and not n.endswith(UNITS))
    assert not bad, f"memory knobs without a unit in their name: {bad}"


def test_the_check_sees_a_clash():
    """The heuristic flags the spellings it exists for (so the tests above can fail)."""
    for a, b in (("seed", "trace_seed"), ("fraction", "prefix_fraction"), ("host_tier", "enable_host_tier"),
                 ("swap_space", "swap_space_gib")):
        ta, tb = set(a.split("_")), set(b.split("_"))
        assert ta < tb and tb - ta <= QUALIFIERS
    for a, b in (("num_blocks", "num_cpu_blocks"), ("eviction", "host_eviction"), ("dtype", "kv_cache_dtype"),
                 ("trace", "trace_seed")):
        ta, tb = set(a.split("_")), set(b.split("_"))
        assert not (ta < tb and tb - ta <= QUALIFIERS)
