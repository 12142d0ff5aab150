"""A simulated replica's step records, in the order its steps ran, without an object per coasted step.

The replica's loop steps are ``StepRecord``s (``append``). A run of the decode fast-forward
(``paged.fleet.coast``) is stored as columns: the run's constant fields once (``add_run``), and
per step only the fields that move (start time and the five pool columns, as machine values in
``array``s; durations and step numbers per run). Millions of coasted steps then cost 56 bytes each,
not a record each.

Invariant: ``len(log)`` rows; ``columns()`` are the ``STEP_COLUMNS`` of those rows in the order they
were taken, typed as ``telemetry.steps_frame`` types them, equal value for value to the frame of
the same steps recorded as ``StepRecord``s.
"""
from __future__ import annotations

from array import array
from typing import Sequence

import numpy as np

from paged.core.record import STEP_FIELDS, STEP_FLOAT_FIELDS, StepRecord

POOL = STEP_FIELDS.index("kv_cache_usage_perc")   # the five pool columns start here, in this order
assert STEP_FIELDS[POOL:POOL + 5] == ("kv_cache_usage_perc", "token_usage", "num_used_blocks", "num_free_blocks",
                                       "num_cached_free_blocks")
CONSTANT = STEP_FIELDS[3:POOL] + STEP_FIELDS[POOL + 5:]
"""The fields that stay the same over a coasted run (all counts), in ``STEP_FIELDS`` order."""
MOVING = ("time_s",) + STEP_FIELDS[POOL:POOL + 5]
"""The fields a coasted run stores per step (its ``add_run`` gives durations and step numbers)."""


class StepLog:
    """See the module docstring. ``moving[f]``: field ``f`` of every coasted step so far, for ``f``
    in ``MOVING`` (``coast`` appends to them, then calls ``add_run``)."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []     # the loop's steps
        self.coasted_before: list[int] = []     # per loop step: coasted steps taken before it
        self.moving: dict[str, array] = {f: array(_code(f)) for f in MOVING}   # machine values, not objects
        self.step_time_s = array("d")           # per coasted step
        self.runs: list[tuple[int, ...]] = []   # per coasted run: its CONSTANT fields
        self.run_first_step: list[int] = []
        self.run_length: list[int] = []

    def __len__(self) -> int:
        return len(self.records) + len(self.step_time_s)

    def append(self, record: StepRecord) -> None:
        """A step the loop took."""
        self.coasted_before.append(len(self.step_time_s))
        self.records.append(record)

    def add_run(self, first_step: int, constants: tuple[int, ...], step_times: Sequence[float]) -> None:
        """Close a coasted run: steps ``first_step``, ``first_step + 1``, ... taking ``step_times``,
        whose ``moving`` fields were appended already, one per step."""
        if len(self.moving["time_s"]) != len(self.step_time_s) + len(step_times):
            raise ValueError("a coasted run needs its moving fields appended first, one per step")
        self.step_time_s.extend(step_times)
        self.runs.append(constants)
        self.run_first_step.append(first_step)
        self.run_length.append(len(step_times))

    def columns(self) -> dict[str, np.ndarray]:
        """One typed array per ``STEP_FIELDS`` name (float64 for the float fields, else int64)."""
        return concat_columns([self])

    def fill(self, out: dict[str, np.ndarray], at: int) -> None:
        """Write this log's ``columns()`` into rows ``at .. at + len(self)`` of ``out``'s arrays."""
        from paged.telemetry import steps_frame
        n_loop, n_coast = len(self.records), len(self.step_time_s)
        at_loop = np.asarray(self.coasted_before, np.int64) + np.arange(n_loop, dtype=np.int64)
        coasted = np.ones(n_loop + n_coast, bool)
        coasted[at_loop] = False
        lengths = np.asarray(self.run_length, np.int64)
        consts = np.asarray(self.runs, np.int64).reshape(len(self.runs), len(CONSTANT))
        starts = np.cumsum(lengths) - lengths
        coast = {"step": np.repeat(np.asarray(self.run_first_step, np.int64) - starts, lengths)
                 + np.arange(n_coast, dtype=np.int64),
                 "step_time_s": np.frombuffer(self.step_time_s, np.float64)}
        for f, values in self.moving.items():
            coast[f] = np.frombuffer(values, _dtype(f))   # views, released when ``fill`` returns
        for j, f in enumerate(CONSTANT):
            coast[f] = np.repeat(consts[:, j], lengths)
        loop = steps_frame(self.records) if n_loop else None
        for f in STEP_FIELDS:
            col = out[f][at:at + n_loop + n_coast]
            if n_loop:
                col[at_loop] = loop[f].to_numpy()
            col[coasted] = coast[f]


def _dtype(field: str) -> type:
    return np.float64 if field in STEP_FLOAT_FIELDS else np.int64


def _code(field: str) -> str:
    """The ``array`` type code of ``_dtype(field)``."""
    return "d" if field in STEP_FLOAT_FIELDS else "q"


def concat_columns(logs: Sequence[StepLog]) -> dict[str, np.ndarray]:
    """The ``columns()`` of ``logs``, one log's rows after another's, each written once in place."""
    out = {f: np.empty(sum(map(len, logs)), _dtype(f)) for f in STEP_FIELDS}
    at = 0
    for log in logs:
        log.fill(out, at)
        at += len(log)
    return out
