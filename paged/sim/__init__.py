"""The modelled executor (numpy): the engine's own scheduler and KV-cache manager against a
roofline cost model of a model/GPU preset, so a 70B deployment runs without a GPU.

``Simulator`` (steppable: ``iter_steps``/``result``, or ``run``), its ``SimConfig`` and
``SimResult``; the studies run on it live in ``paged.studies``."""
from .simulator import SimConfig, SimResult, Simulator, simulate

__all__ = ["SimConfig", "SimResult", "Simulator", "simulate"]
