"""``SimConfig.linear`` / ``--linear``: the per-kernel linear part as a simulator knob, checked once."""
import json

import pytest

from paged.cli import main
from paged.errors import ConfigError
from paged.sim.config import LINEAR_MODELS
from paged.sim.cost_model import CostModel
from paged.sim.simulator import SimConfig, Simulator
from paged.sim.shapes import StepShape
from paged.studies.grid import point_keys

SMALL = ["simulate", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--max-model-len", "1024", "-n", "20",
         "--rate", "8", "--json"]


def test_the_config_builds_the_kernel_cost_model():
    sim = Simulator(SimConfig(model="llama-2-7b", gpu="h100-sxm", tensor_parallel=2, linear="kernels"))
    ref = CostModel("llama-2-7b", "h100-sxm", tensor_parallel=2, linear="kernels", kv_block_size=16)
    s = StepShape.make([1] * 8, [1000] * 8, num_sampled=8)
    assert sim.cost.linear == "kernels"
    assert sim.cost.step_time(s) == pytest.approx(ref.step_time(s), rel=1e-12)
    closed = Simulator(SimConfig(model="llama-2-7b", gpu="h100-sxm", tensor_parallel=2)).cost
    assert closed.linear is None and closed.step_time(s) != pytest.approx(sim.cost.step_time(s), rel=1e-3)


@pytest.mark.parametrize("kw, words", [
    (dict(linear="vidur"), ["linear must be None", "'kernels'", "'vidur'"]),
    (dict(linear="kernels", gpu="l4"), ["'l4'", "a100-80gb", "h100-sxm", "a40", "leave linear unset"]),
    (dict(linear="kernels", calibration="steps.csv"), ["calibration", "leave linear unset"]),
])
def test_bad_values_are_refused_once_naming_the_choices(kw, words):
    with pytest.raises(ConfigError) as e:
        SimConfig(model="llama-2-7b", **kw)
    assert str(e.value).startswith("SimConfig:") and all(w in str(e.value) for w in words), str(e.value)


def test_cli_flag_changes_the_step_times(capsys):
    assert main(SMALL) == 0
    closed = json.loads(capsys.readouterr().out)
    assert main([*SMALL, "--linear", "kernels"]) == 0
    kern = json.loads(capsys.readouterr().out)
    assert closed["requests_finished"] == kern["requests_finished"] == 20
    assert kern["tbt_p50_s"] != pytest.approx(closed["tbt_p50_s"], rel=1e-3)  # decode floors price differently
    with pytest.raises(SystemExit):
        main([*SMALL, "--linear", "roofline"])
    assert "invalid choice" in capsys.readouterr().err and all(c in LINEAR_MODELS for c in ("kernels",))


def test_linear_is_a_sweep_key():
    assert "linear" in point_keys()
