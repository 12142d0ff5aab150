"""Disaggregated serving: a prefill pool and a decode pool of simulated replicas (each its own
``StepLoop``, scheduler, KV pool and cost model), the prompt's KV sent between them.

A request runs its prompt on a prefill replica (``max_tokens=1``: the first token comes from there),
then its KV crosses the link (``paged.fleet.disagg.transfer_seconds``, optionally overlapped layer by
layer with the prefill) and it joins a decode replica, whose scheduler allocates blocks for the whole
prompt (the imported KV) and decodes the rest. The decode replica's executor prices chunks of an
imported prompt at nothing (the KV arrived; only the blocks are held). Both pools route by least
outstanding requests. Limitation: a decode-side preemption by recompute is also priced at nothing.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from paged.core.loop import Executed
from paged.core.request import Request
from paged.sim.arrivals import Arrivals, SyntheticPrompts
from paged.sim.executor import RooflineExecutor
from paged.sim.shapes import StepShape
from paged.sim.workload import normalize_trace

from .disagg import kv_transfer_bytes, transfer_seconds
from .sim_replica import RequestStamps, SimReplica


class _Stamps(RequestStamps):
    __slots__ = ("prompt",)


class ImportedPrefillExecutor(RooflineExecutor):
    """The decode side's roofline: chunks inside a request's prompt cost nothing (its KV was imported)."""

    def execute(self, plan: Any) -> Executed:
        b = plan.batch
        keep = [i for i, r in enumerate(b.requests) if b.starts[i] >= r.data.prompt]
        shape = StepShape(np.array([b.num_tokens[i] for i in keep], dtype=np.float64),
                          np.array([b.starts[i] for i in keep], dtype=np.float64),
                          sum(1 for i in keep if b.samples[i]), plan.num_moved_blocks * self.block_bytes,
                          plan.num_copied_blocks * self.block_bytes)
        return Executed(self.tokens, self.cost.step_time(shape) if keep or shape.swap_bytes else 0.0)


def run_disagg(cfg: Any, trace: pd.DataFrame, prefill_replicas: int, decode_replicas: int,
               bandwidth: float, layerwise: bool = True, seed: int = 0) -> pd.DataFrame:
    """The request frame (``arrival_time_s, first_token_s, finish_s, num_output_tokens``, plus
    ``transfer_s``) of ``trace`` served disaggregated (see the module docstring)."""
    pre = [SimReplica(i, f"p{i}", cfg, precise=False) for i in range(prefill_replicas)]
    dcfg = replace(cfg, enable_chunked_prefill=False,
                   max_num_batched_tokens=(cfg.max_model_len or 4096) + cfg.max_num_seqs)
    dec = [SimReplica(i, f"d{i}", dcfg, precise=False) for i in range(decode_replicas)]
    for r in dec:
        r.loop.executor = ImportedPrefillExecutor(r.loop.executor.cost, r.loop.executor.block_bytes)
    tr = normalize_trace(trace)
    a = Arrivals(tr)
    toks = SyntheticPrompts(pre[0].model.vocab_size, seed)
    model, layers = pre[0].model, pre[0].model.num_layers
    out = {p: [0] * len(pool) for p, pool in (("p", pre), ("d", dec))}
    first = np.full(a.n, np.nan)
    fin = np.full(a.n, np.nan)
    xfer = np.zeros(a.n)
    prompts: dict[int, list[int]] = {}
    pending: list[tuple[float, int]] = []
    stalled: set[str] = set()
    while True:
        t_next = min(float(a.time[a.next]) if a.next < a.n else math.inf, pending[0][0] if pending else math.inf)
        busy = [r for r in pre + dec if r.busy() and r.name not in stalled]
        r = min(busy, key=lambda x: x.now) if busy else None
        if r is not None and r.now <= t_next:
            moved = r.step()
            for done in r.take_finished():
                i = int(done.request_id)
                kind = r.name[0]
                out[kind][r.index] -= 1
                if kind == "p":
                    st = done.data
                    first[i] = st.first_token
                    x = transfer_seconds(kv_transfer_bytes(model, int(a.prompt[i]), cfg.kv_cache_dtype
                                                           if cfg.kv_cache_dtype != "auto" else "fp16"),
                                         bandwidth, layers, st.first_token - st.first_scheduled, layerwise)
                    xfer[i] = x
                    heapq.heappush(pending, (st.first_token + x, i))
                else:
                    fin[i] = done.data.finish
            if not moved:
                if math.isinf(t_next):
                    raise RuntimeError(f"replica {r.name} cannot schedule and nothing is pending")
                r.clock.advance_to(max(r.now, t_next))
                stalled.add(r.name)
            continue
        if math.isinf(t_next):
            break
        stalled.clear()
        if pending and pending[0][0] <= t_next:
            t, i = heapq.heappop(pending)
            k = int(np.argmin(out["d"]))
            out["d"][k] += 1
            st = _Stamps(i, k, t)
            st.prompt = int(a.prompt[i])
            dec[k].add(Request(str(i), prompts.pop(i), int(a.output[i]), arrival_time=t, data=st))
            continue
        i = a.next
        a.next += 1
        prompts[i] = list(a.prompt_ids(i, toks))
        k = int(np.argmin(out["p"]))
        out["p"][k] += 1
        st = _Stamps(i, k, t_next)
        st.prompt = 0
        pre[k].add(Request(str(i), list(prompts[i]), 1, arrival_time=t_next, data=st))
    return pd.DataFrame({"arrival_time_s": a.time[:a.n].astype(float), "first_token_s": first, "finish_s": fin,
                         "num_output_tokens": a.output[:a.n].astype(int), "transfer_s": xfer})


def disagg_study(num_gpus: int = 4, prefill_gpus: tuple[int, ...] = (1, 2), model: str = "llama-2-13b",
                 gpu: str = "a100-80gb", num_requests: int = 200, rate: float = 4.0, prompt_tokens: int = 2048,
                 output_tokens: int = 128, bandwidth: float = 50e9, layerwise: bool = True,
                 ttft_slo_s: float = 2.0, tpot_slo_s: float = 0.05, token_budget: int = 512,
                 seed: int = 0) -> pd.DataFrame:
    """Same requests, same GPUs (one-GPU replicas): colocated without and with chunked prefill, and
    each prefill/decode split of ``prefill_gpus``; one row each, ``goodput_vs_colocated`` the ratio
    to the colocated row. ``bandwidth``: bytes/s of the KV link (50e9: 400 Gb/s InfiniBand NDR)."""
    from paged.errors import ConfigError
    from paged.sim.config import SimConfig

    from .disagg import colocated_slo, slo_metrics
    from .workloads import shared_prefix_trace
    if any(not 1 <= p < num_gpus for p in prefill_gpus):
        raise ConfigError(f"prefill_gpus {prefill_gpus} must each be in [1, num_gpus - 1 = {num_gpus - 1}]")
    kw = dict(num_gpus=num_gpus, model=model, gpu=gpu, num_requests=num_requests, rate=rate,
              prompt_tokens=prompt_tokens, output_tokens=output_tokens, ttft_slo_s=ttft_slo_s,
              tpot_slo_s=tpot_slo_s, token_budget=token_budget, seed=seed)
    rows = [colocated_slo(False, **kw), colocated_slo(True, **kw)]
    trace = shared_prefix_trace(num_requests, rate, 1, prompt_tokens, 0, output_tokens, seed=seed)
    trace["prefix_id"], trace["prefix_tokens"] = -1, 0
    cfg = SimConfig(model=model, gpu=gpu, enable_prefix_caching=False, enable_chunked_prefill=False,
                    prompt_seed=seed)
    for p in prefill_gpus:
        df = run_disagg(cfg, trace, p, num_gpus - p, bandwidth, layerwise, seed)
        ttft = (df["first_token_s"] - df["arrival_time_s"]).to_numpy()
        rows.append({"mode": f"disagg_{p}p{num_gpus - p}d", "gpus": num_gpus, "rate": rate,
                     "prompt_tokens": prompt_tokens, **slo_metrics(df, ttft_slo_s, tpot_slo_s),
                     "ttft_p99_s": float(np.nanquantile(ttft, 0.99)), "transfer_s_mean": float(df["transfer_s"].mean())})
    out = pd.DataFrame(rows)
    out["goodput_vs_colocated"] = out["goodput_rps"] / out["goodput_rps"].iloc[0]
    return out
