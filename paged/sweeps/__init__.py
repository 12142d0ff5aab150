"""paged.sweeps: grids of any study, run locally or on Ray, stored per point and resumable.

    import paged
    df = paged.sweep("simulate", {"model": "llama-2-70b", "tensor_parallel": 2, "num_requests": 200,
                                  "rate": [1, 2, 4], "block_size": [8, 16, 32]})          # 9 points, this process
    df = paged.sweep("simulate", grid, backend="ray")                 # Ray tasks on an embedded local instance
    df = paged.sweep("simulate", grid, backend="ray", address="auto") # ... or the cluster of `ray start`

One row per point: its parameters, its results, then ``status``/``error``/``wall_s``/``cpu_s``/
``host``/``pid``/``node``/``backend``/``cached``/``point`` (see ``api``). Modules:

    grid      dict of lists (product), list of dicts, random_sample, latin_hypercube (Range dims)
    registry  Study (a named "module:function" + resources), STUDIES (today's studies by name)
    point     one point in a worker: call, time, catch -> rows
    store     PointStore: one Parquet file per finished point, keyed by study + params + version
    backends  LocalBackend (serial / processes), RayBackend (local instance or cluster)
    api       sweep(), load()
    pareto    pareto_front(df, maximize=..., minimize=...)

The live view is ``paged.viz.sweep``; the benchmark ``benchmarks/sweep.py``; the guide docs/sweeps.md.
Ray is optional (``pip install 'paged-kv-workbench[ray]'``) and imported only by backend="ray".
"""
from __future__ import annotations

from .api import default_store_dir, load, sweep
from .grid import Range, expand, latin_hypercube, random_sample
from .pareto import pareto_front
from .point import META
from .registry import STUDIES, Study, get_study, register
from .store import PointStore, project_version

__all__ = ["sweep", "load", "default_store_dir", "Range", "expand", "latin_hypercube", "random_sample",
           "pareto_front", "META", "STUDIES", "Study", "get_study", "register", "PointStore", "project_version"]
