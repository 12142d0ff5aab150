"""Grids: the points a sweep runs, as a list of parameter dicts.

- a dict of lists -> their Cartesian product, in the dict's key order, last key fastest
  (a scalar value, or a string, is one fixed value: ``{"model": "llama-2-70b", "rate": [1, 2]}``);
- a list (or tuple) of dicts -> those points as given;
- ``random_sample(space, n, seed)`` / ``latin_hypercube(space, n, seed)`` -> ``n`` points drawn
  from a space whose dimensions are value lists (categorical) or ``Range(low, high)`` (numeric).

Invariants of ``expand(grid)``: every point is a new ``dict`` with string keys; the order is
deterministic (the same grid gives the same points in the same order); repeated points (equal
parameters) are kept once, at their first position.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence, Union

import numpy as np

from paged.errors import ConfigError

Point = dict[str, Any]
Grid = Union[Mapping[str, Any], Sequence[Mapping[str, Any]]]


@dataclass(frozen=True)
class Range:
    """A numeric dimension of a sampled space: ``low <= x <= high``; ``log`` samples evenly in
    log space (``low > 0``); ``integer`` rounds to the nearest int (then both ends are reachable)."""

    low: float
    high: float
    log: bool = False
    integer: bool = False

    def __post_init__(self) -> None:
        lo, hi = float(self.low), float(self.high)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ConfigError(f"Range needs finite low <= high, got low={self.low!r}, high={self.high!r}")
        if self.log and lo <= 0:
            raise ConfigError(f"a log Range needs low > 0, got low={self.low!r}; use log=False or a positive low")

    def at(self, u: np.ndarray) -> list[Any]:
        """Values at quantiles ``u`` in [0, 1)."""
        lo, hi = float(self.low), float(self.high)
        if self.integer:  # widen by half a unit each side so every integer gets an equal share
            lo, hi = lo - 0.5 + 1e-9, hi + 0.5 - 1e-9
        x = np.exp(np.log(lo) + u * (np.log(hi) - np.log(lo))) if self.log else lo + u * (hi - lo)
        if self.integer:
            return [int(v) for v in np.clip(np.rint(x), math.ceil(self.low), math.floor(self.high))]
        return [float(v) for v in x]


def _is_values(v: Any) -> bool:
    """A list of values to sweep (not a scalar, a string or a mapping)."""
    return isinstance(v, (list, tuple, range, np.ndarray))


def _plain(v: Any) -> Any:
    """numpy scalars as Python numbers (so points hash and store the same whatever made them)."""
    return v.item() if isinstance(v, np.generic) else v


def point_id(point: Mapping[str, Any]) -> str:
    """A canonical text of a point (sorted keys, JSON) -- equal points, equal ids."""
    return json.dumps({k: _plain(v) for k, v in point.items()}, sort_keys=True, default=repr)


def _dedupe(points: Iterable[Point]) -> list[Point]:
    first: dict[str, Point] = {}
    for p in points:
        first.setdefault(point_id(p), p)
    return list(first.values())


def _check_keys(point: Mapping[str, Any], where: str) -> None:
    bad = [k for k in point if not isinstance(k, str) or not k]
    if bad:
        raise ConfigError(f"{where}: parameter names must be non-empty strings, got {bad!r}")


def expand(grid: Grid) -> list[Point]:
    """The points of ``grid`` (see the module docstring)."""
    if isinstance(grid, Mapping):
        _check_keys(grid, "grid")
        values = []
        for k, v in grid.items():
            vals = list(v) if _is_values(v) else [v]
            if not vals:
                raise ConfigError(f"grid[{k!r}] is empty; give at least one value (or drop the key)")
            values.append([_plain(x) for x in vals])
        return _dedupe(dict(zip(grid, combo)) for combo in itertools.product(*values))
    if isinstance(grid, (list, tuple)):
        points = []
        for i, p in enumerate(grid):
            if not isinstance(p, Mapping):
                raise ConfigError(f"grid[{i}] is {type(p).__name__}; a list grid holds dicts of parameters")
            _check_keys(p, f"grid[{i}]")
            points.append({k: _plain(v) for k, v in p.items()})
        return _dedupe(points)
    raise ConfigError(f"grid must be a dict of lists or a list of dicts, got {type(grid).__name__}")


def _space(space: Mapping[str, Any]) -> list[tuple[str, Any]]:
    if not isinstance(space, Mapping) or not space:
        raise ConfigError("a sampled space is a non-empty dict: name -> list of values or Range(low, high)")
    _check_keys(space, "space")
    dims = []
    for k, v in space.items():
        if not isinstance(v, Range):  # categorical: a list of values, or one fixed value
            v = [_plain(x) for x in v] if _is_values(v) else [_plain(v)]
            if not v:
                raise ConfigError(f"space[{k!r}] is empty; give at least one value")
        dims.append((k, v))
    return dims


def _check_n(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ConfigError(f"the number of samples must be an integer >= 1, got {n!r}")
    return int(n)


def _points(dims: list[tuple[str, Any]], u: np.ndarray) -> list[Point]:
    cols = []
    for j, (_, d) in enumerate(dims):
        if isinstance(d, Range):
            cols.append(d.at(u[:, j]))
        else:  # categorical: quantile -> index
            idx = np.minimum((u[:, j] * len(d)).astype(int), len(d) - 1)
            cols.append([d[i] for i in idx])
    names = [k for k, _ in dims]
    return [dict(zip(names, row)) for row in zip(*cols)]


def random_sample(space: Mapping[str, Any], n: int, seed: int = 0) -> list[Point]:
    """``n`` points drawn independently and uniformly from ``space`` (seeded; repeats kept once)."""
    dims, n = _space(space), _check_n(n)
    return _dedupe(_points(dims, np.random.default_rng(seed).random((n, len(dims)))))


def latin_hypercube(space: Mapping[str, Any], n: int, seed: int = 0) -> list[Point]:
    """``n`` points of a Latin hypercube over ``space`` (McKay et al., 1979): each dimension's
    range is cut into ``n`` equal strata and every stratum holds exactly one point, the strata
    paired at random across dimensions. A categorical dimension of ``m`` values then gets each
    value about ``n/m`` times. Seeded; repeated points are kept once."""
    dims, n = _space(space), _check_n(n)
    rng = np.random.default_rng(seed)
    u = np.column_stack([(rng.permutation(n) + rng.random(n)) / n for _ in dims])
    return _dedupe(_points(dims, u))


__all__ = ["Range", "expand", "random_sample", "latin_hypercube", "point_id", "Point", "Grid"]
