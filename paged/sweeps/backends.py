"""Where points run: this process or a few local processes (``LocalBackend``), or Ray tasks on a
local instance or a cluster (``RayBackend``).

A backend's ``run(study, todo)`` takes ``(index, params)`` pairs and yields ``(index, rows)`` as
points finish, in any order, each index exactly once. A study's own exception is a row with
``status="error"`` (made in the worker); a point whose worker died and could not be retried is a
row with ``status="lost"`` (made here), which the sweep does not store, so a re-run computes it.

Ray is imported only by ``RayBackend`` (``pip install paged-kv-workbench[ray]``).
"""
from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import tempfile
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from paged.errors import ConfigError

from .point import META, execute, plain
from .registry import Study

Todo = Sequence[tuple[int, Mapping[str, Any]]]
Done = Iterator[tuple[int, list[dict[str, Any]]]]


def lost(params: Mapping[str, Any], error: str, backend: str) -> list[dict[str, Any]]:
    """The row of a point whose worker died (no result; not stored, so a re-run computes it)."""
    return [{**{k: plain(v) for k, v in params.items()}, **dict.fromkeys(META), "status": "lost", "error": error,
             "backend": backend, "cached": False}]


class LocalBackend:
    """Serial in this process (``jobs=1``), or ``jobs`` forked worker processes. A worker that
    dies breaks the pool: its point and the unfinished ones come back ``lost`` (Ray retries
    instead: use ``backend="ray"`` where workers may die)."""

    name = "local"

    def __init__(self, jobs: int = 1) -> None:
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise ConfigError(f"jobs must be an integer >= 1 (worker processes of the local backend), got {jobs!r}")
        self.jobs = jobs

    def run(self, study: Study, todo: Todo) -> Done:
        if self.jobs == 1 or len(todo) <= 1:
            for i, params in todo:
                yield i, execute(study, params, self.name)
            return
        # fork: works from notebooks and unguarded scripts (the workers run pure Python/numpy)
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ProcessPoolExecutor(max_workers=min(self.jobs, len(todo)), mp_context=ctx) as ex:
            futures: dict[Future, tuple[int, Mapping[str, Any]]] = {
                ex.submit(execute, study, params, self.name): (i, params) for i, params in todo}
            try:
                for fut in as_completed(futures):
                    i, params = futures[fut]
                    try:
                        yield i, fut.result()
                    except BrokenProcessPool as e:
                        yield i, lost(params, f"worker process died: {e}", self.name)
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise


def default_ray_temp_dir() -> str:
    """Where a local Ray instance keeps its sockets, logs and spill files (short: Unix sockets
    have a ~107-byte path limit)."""
    return os.environ.get("PAGED_RAY_TMPDIR") or str(Path(tempfile.gettempdir()) / "paged-ray")


@contextmanager
def _pythonpath(paths: Sequence[str]) -> Iterator[None]:
    """PYTHONPATH with ``paths`` first while Ray starts: its raylet, and so every worker it
    forks, imports the same ``paged`` as this driver (not another copy installed elsewhere)."""
    old = os.environ.get("PYTHONPATH")
    parts = [p for p in paths if p] + ([old] if old else [])
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("backend='ray' needs Ray: pip install 'paged-kv-workbench[ray]' (ray==2.60.0), "
                          "or use backend='local'") from None
    return ray


def start_local_ray(num_cpus: int | None = None, *, temp_dir: str | None = None, paths: Sequence[str] = (),
                    **init_kwargs: Any) -> bool:
    """Start an embedded Ray instance on this machine unless one is running; True if started.

    ``num_cpus``: the machine's cores by default; no dashboard; files under ``temp_dir``
    (default ``default_ray_temp_dir()``); workers import ``paged`` from where this process did
    (plus ``paths``). It stays up for later sweeps; ``ray.shutdown()`` stops it."""
    import paged
    ray = _import_ray()
    if ray.is_initialized():
        return False
    kw: dict[str, Any] = {"num_cpus": num_cpus or os.cpu_count() or 1, "include_dashboard": False,
                          "_temp_dir": temp_dir or default_ray_temp_dir(), **init_kwargs}
    Path(kw["_temp_dir"]).mkdir(parents=True, exist_ok=True)
    with _pythonpath([str(Path(paged.__file__).resolve().parent.parent), *paths]):
        ray.init(**kw)
    return True


class RayBackend:
    """Each point a Ray task asking for the study's ``num_cpus``/``num_gpus``; a task whose worker
    dies is retried up to ``max_retries`` times (Ray re-runs it on a fresh worker), and the
    driver records each point once, from the attempt that returned.

    ``address=None``: a Ray instance already started in this process, else an embedded local one
    (``start_local_ray``); ``"auto"``: the cluster this machine is part of (``ray start``);
    ``"ray://head:10001"``: a remote cluster through Ray Client. ``init`` goes to ``ray.init``
    (e.g. ``runtime_env={"working_dir": "."}`` to ship code to a cluster)."""

    name = "ray"

    def __init__(self, address: str | None = None, *, max_retries: int = 3,
                 init: Mapping[str, Any] | None = None) -> None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ConfigError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        self.ray, self.max_retries = _import_ray(), max_retries
        if not self.ray.is_initialized():
            if address is None:
                start_local_ray(**dict(init or {}))
            else:
                self.ray.init(address=address, **dict(init or {}))

    def run(self, study: Study, todo: Todo) -> Done:
        ray = self.ray
        task = ray.remote(execute).options(num_cpus=study.num_cpus, num_gpus=study.num_gpus,
                                           max_retries=self.max_retries, retry_exceptions=False)
        # a bounded window of tasks in flight: ray.wait is O(pending), and an interrupt cancels few
        window = max(64, 4 * int(ray.cluster_resources().get("CPU", 1)))
        queue = iter(todo)
        refs: dict[Any, tuple[int, Mapping[str, Any]]] = {}

        def submit(n: int) -> None:
            for i, params in itertools.islice(queue, n):
                refs[task.remote(study, dict(params), self.name)] = (i, params)

        submit(window)
        try:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1)
                more, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)  # all else ready now
                for ref in dict.fromkeys(ready + more):
                    i, params = refs.pop(ref)
                    try:
                        rows = ray.get(ref)
                    except ray.exceptions.RayError as e:  # the worker died more than max_retries times
                        rows = lost(params, f"{type(e).__name__}: {str(e).splitlines()[0]}", self.name)
                    submit(1)
                    yield i, rows
        except BaseException:
            for ref in refs:
                ray.cancel(ref, force=True)
            raise


__all__ = ["LocalBackend", "RayBackend", "start_local_ray", "default_ray_temp_dir", "lost"]
