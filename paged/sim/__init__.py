"""The modelled executor (numpy): the engine's own scheduler and KV-cache manager against a
roofline cost model of a model/GPU preset, so a 70B deployment runs without a GPU."""
from .simulator import SimConfig, Simulator, simulate

__all__ = ["SimConfig", "Simulator", "simulate"]
