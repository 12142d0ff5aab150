"""The step loop: one scheduler, one KV cache, one executor, one clock. The only place a step is taken.

    loop = StepLoop(scheduler, executor, clock, observer=front)
    loop.add_request(request)
    step = loop.step()      # schedule -> executor.execute(plan) -> scheduler.update -> observer -> record

An ``Executor`` turns a plan into tokens and time: the torch engine's ``ModelExecutor`` (real
kernels, measured time) and the simulator's ``RooflineExecutor`` (modelled time, a dummy token
per sampling chunk). Anything that wants a step taken asks a ``StepLoop``: ``LLMEngine`` and
``Simulator`` are fronts that own one loop each (requests in, outputs and summaries out); a fleet
is N loops and a router.

Invariants: every executed step yields exactly one ``StepRecord`` (``paged.core.record``), built
from the plan after the scheduler moved the requests on; ``observer.after_update`` runs after
``update`` and before the record is closed, so its bookkeeping counts in a measured step's time;
a plan with no work is executed only by executors that say so (the engine applies its cache
operations; the roofline models no time for it) and then yields no record.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

from . import events as ev
from .plan import SchedulerOutput
from .record import StepRecord
from .request import Request
from .scheduler import Scheduler

__all__ = ["Clock", "Executed", "Executor", "MemoryOnlyExecutor", "Step", "StepLoop", "StepObserver"]


@dataclass(slots=True)
class Executed:
    """What an executor did with a plan: one token per sampling chunk (``sampled``, by request
    id), its modelled duration (None: measured by the loop's clock), its own timing breakdown in
    seconds, and actions to run once the scheduler has moved the requests on (e.g. forks)."""

    sampled: Mapping[str, int]
    duration_s: float | None = None
    phases: dict[str, float | None] = field(default_factory=dict)
    after_update: list[Callable[[], None]] = field(default_factory=list)


class Executor(Protocol):
    """Turns a plan into tokens and time. ``executes_empty_plans``: whether a plan without work
    is still executed (its cache operations applied) and recorded."""

    executes_empty_plans: bool

    def execute(self, plan: SchedulerOutput) -> Executed: ...


class MemoryOnlyExecutor:
    """An executor for studies that watch memory only: each sampling chunk's token is
    ``token(request_id)``, and no time passes."""

    executes_empty_plans = False

    def __init__(self, token: Callable[[str], int]) -> None:
        self.token = token

    def execute(self, plan: SchedulerOutput) -> Executed:
        b = plan.batch
        return Executed({r.request_id: self.token(r.request_id) for r, x in zip(b.requests, b.samples) if x}, 0.0)


class Clock(Protocol):
    def now(self) -> float: ...
    def start(self) -> float: ...
    def stop(self, duration_s: float | None = None) -> float: ...


@dataclass(slots=True)
class Step:
    """One pass of the loop: the plan; what ran (``executed`` None: nothing, the plan had no
    work); the requests that finished; the record (None when nothing ran); the step's events;
    its start and end on the loop's clock; the seconds ``schedule()`` took."""

    plan: SchedulerOutput
    executed: Executed | None
    finished: list[Request]
    record: StepRecord | None
    events: list[ev.Event]
    start_s: float
    end_s: float
    schedule_s: float

    @property
    def row(self) -> dict:
        """The record as a dict of exactly ``paged.telemetry.STEP_COLUMNS``."""
        return self.record.to_row()


class StepObserver(Protocol):
    """A front's bookkeeping for a step (request stamps, outputs), once the scheduler moved the
    requests on; ``step.record`` is still None then."""

    def after_update(self, step: Step) -> None: ...


class StepLoop:
    """scheduler + KV cache (the scheduler's) + executor + clock (see the module docstring)."""

    __slots__ = ("scheduler", "executor", "clock", "observer")

    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Clock,
                 observer: StepObserver | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.observer = observer

    def add_request(self, request: Request) -> None:
        """Queue ``request`` (raises, changing nothing, when it can never be served)."""
        self.scheduler.add_request(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> Step:
        """Take one step (see the module docstring); an executor's error propagates as raised,
        with the clock stopped."""
        clock, recorder, scheduler = self.clock, self.scheduler.recorder, self.scheduler
        start = clock.start()
        t0 = time.perf_counter()
        mark = len(recorder)
        try:
            plan = scheduler.schedule()
            schedule_s = time.perf_counter() - t0
            if not plan.batch and not self.executor.executes_empty_plans:
                return Step(plan, None, [], None, recorder.since(mark), start, clock.stop(0.0), schedule_s)
            executed = self.executor.execute(plan)
            finished = scheduler.update(plan, executed.sampled)
            for action in executed.after_update:
                action()
            duration = executed.duration_s
            end = start + duration if duration is not None else clock.now()
            step = Step(plan, executed, finished, None, [], start, end, schedule_s)
            if self.observer is not None:
                self.observer.after_update(step)
            if duration is None:
                duration = time.perf_counter() - t0
            step.record = StepRecord.of(plan, start, duration, len(finished))
            step.events = recorder.since(mark)
            step.end_s = clock.stop(executed.duration_s)
            return step
        except BaseException:
            clock.stop(0.0)
            raise
