"""Each setting is written once: LLM forwards to EngineConfig, both executors build their
SchedulerConfig with one helper, the CLI's simulator flags come from SimConfig."""
from __future__ import annotations

import pandas as pd
import pytest

from paged.core.scheduler import SchedulerConfig
from paged.errors import ConfigError
from paged.sim.simulator import SimConfig, Simulator


def test_llm_rejects_an_unknown_setting_before_loading():
    from paged.engine import LLM

    with pytest.raises(ConfigError, match=r"unknown setting\(s\) block_szie; valid: model, device, dtype, block_size"):
        LLM("no-such-model", block_szie=8)


def test_engine_and_simulator_build_the_same_scheduler_config():
    from paged.engine import EngineConfig

    for chunked in (True, False):
        kw = dict(max_num_seqs=7, enable_chunked_prefill=chunked, preemption_mode="swap", policy="priority",
                  watermark=0.05)
        eng, sim = SchedulerConfig.of(EngineConfig(**kw), 4096), SchedulerConfig.of(SimConfig(**kw), 4096)
        assert eng == sim
        assert eng.max_num_batched_tokens == (2048 if chunked else 4096)
    assert SchedulerConfig.of(SimConfig(max_num_batched_tokens=300), 4096).max_num_batched_tokens == 300


def test_simulator_without_chunked_prefill_takes_prompts_above_2048():
    """As the engine does: the unchunked budget is max(2048, max_model_len), so a long prompt fits."""
    tr = pd.DataFrame({"arrival_time": [0.0, 0.0], "prompt_tokens": [3000, 100], "output_tokens": [4, 4]})
    sim = Simulator(SimConfig(model="mistral-7b", max_model_len=4096, enable_chunked_prefill=False))
    assert sim.scheduler.config.max_num_batched_tokens == 4096
    s = sim.run(tr).summary
    assert s["requests_rejected"] == 0 and s["requests_finished"] == 2


def test_cli_flags_default_to_simconfig():
    from paged.cli import build_parser

    args = build_parser().parse_args(["simulate"])
    knobs = SimConfig.knob_fields()  # flat: the cache's, the scheduler's and the deployment's
    flagged = [name for name in knobs if hasattr(args, name)]
    assert set(knobs) - set(flagged) == {"record_events", "kv_share_with"}  # every other knob has a flag
    for name in flagged:
        assert getattr(args, name) == knobs[name].default, name
    args = build_parser().parse_args(["simulate", "--tp", "2", "--no-chunked-prefill", "--token-budget", "64",
                                      "--kv-cache-dtype", "int4_kivi", "--no-paged-kernel-penalty"])
    assert (args.tensor_parallel, args.enable_chunked_prefill, args.max_num_batched_tokens, args.kv_cache_dtype,
            args.paged_kernel_penalty) == (2, False, 64, "int4_kivi", False)
