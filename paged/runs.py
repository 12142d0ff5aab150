"""Steppable runs: one ``Run`` over either front (the real engine, the simulator), for live views.

    run = Run(paged.LLM(num_blocks=48), chat_workload(tok, 8))   # SmolLM2, real kernels
    run = Run(SimConfig(model="llama-2-70b", gpu="a100-80gb", tensor_parallel=4), trace)
    while not run.done:
        row = run.step()          # dict with exactly paged.telemetry STEP_COLUMNS (seconds)
    run.snapshot()                # paged.core.snapshot.KVSnapshot of the cache now
    run.steps_frame(); run.requests_frame(); run.events   # records so far
    run.fresh(num_blocks=32)      # a new run of the same workload with changed settings

A run keeps `rows` (step rows), `events` (paged.core.events.Event tuples), `request_rows()`
(REQUEST_COLUMNS), `tbt_samples()` (seconds between a request's tokens), `backend` and `label`
("engine" or "simulator"). An engine run's times are seconds on the engine's clock (since it was
built); a simulated run's are simulated. Invariant: `step()` on a done run raises (a simulated
run's last call returns None: the simulator knows its trace is over only when asked for one more
step); every request of an engine workload is added exactly once, at the first step whose index
reaches its `arrival_step`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from paged.core import events as ev
from paged.errors import ConfigError, PagedError

from paged import telemetry
from paged.story import MOMENTS
from paged.telemetry import REQUEST_COLUMNS, STEP_COLUMNS

__all__ = ["EngineRequest", "Run", "STEP_COLUMNS", "REQUEST_COLUMNS", "TOPICS", "chat_workload", "interference_workload",
           "backend_label"]

_USE_KINDS = (ev.ALLOCATE, ev.FREE, ev.PREFIX_HIT, ev.COW)
TOPICS = ("virtual memory", "page tables", "copy-on-write", "caches", "scheduling", "fragmentation", "swapping",
          "hash tables", "queues", "batching", "attention", "tokenizers")
"""What the chat workloads ask about ("Explain <topic> ..."): ``chat_workload`` here, the prefix-caching studies."""


@dataclass
class EngineRequest:
    """One request of an engine workload: added before step `arrival_step` (1 = the first)."""
    request_id: str
    prompt: str | Sequence[int]
    params: Any = None            # paged.engine.SamplingParams (None: defaults)
    arrival_step: int = 1


class RecordFrames:
    """pandas views of a run's records (``rows``, ``events``, ``request_rows()``), through
    :mod:`paged.telemetry`: shared by live runs and :class:`paged.replay.Recording`."""

    rows: list[dict]
    events: list[ev.Event]
    snapshots: dict[int, Any]   # step index (len(rows)) -> KVSnapshot
    noun = "run"                # what the records are of, in messages

    def request_rows(self) -> list[dict]:
        raise NotImplementedError

    def snapshot_at(self, step: int):
        """The kept snapshot of the last step <= `step` that has one (the first kept one before it)."""
        if not self.snapshots:
            raise ConfigError(f"this {self.noun} kept no snapshots; call run.keep_snapshots(stride) before stepping")
        keys = sorted(self.snapshots)
        return self.snapshots[keys[max(int(np.searchsorted(keys, step, side="right")) - 1, 0)]]

    def steps_frame(self):
        """pandas DataFrame of the step rows so far (STEP_COLUMNS)."""
        return telemetry.steps_frame(self.rows)

    def requests_frame(self):
        return telemetry.requests_frame(self.request_rows())

    def events_frame(self):
        return telemetry.events_frame(self.events)


def backend_label(device, backend: str | None) -> str:
    """'triton on cuda' / 'torch on cpu (a CPU run: times are CPU times)'."""
    try:
        from paged._kernels import kernels
        name = kernels.resolve_backend(backend, device)
    except Exception:  # noqa: BLE001 - a label must never fail a view
        name = backend or "auto"
    dev = getattr(device, "type", str(device))
    note = " (a CPU run: step times are this CPU's, not a GPU's)" if dev == "cpu" else ""
    return f"{name} kernels on {dev}{note}"


class Run(RecordFrames):
    """One steppable run of either front: the real engine over a workload of ``EngineRequest``s (or
    dicts of their fields), added at their ``arrival_step``; or the simulator over a trace (a
    ``paged.sim.workload`` DataFrame), its requests added when the simulated clock reaches them.

        Run(paged.LLM(num_blocks=48), chat_workload(tok, 8))     # an LLM or LLMEngine
        Run(SimConfig(model="llama-2-70b", gpu="a100-80gb"), trace)  # a SimConfig or Simulator
    """

    def __init__(self, front: Any, workload: Any) -> None:
        self.rows: list[dict] = []
        self.events: list[ev.Event] = []
        self._last_use: np.ndarray | None = None
        self._written: list[int] = []
        self.done = False
        self.snapshot_stride = 0               # keep_snapshots(k): a snapshot every k steps
        self.max_snapshots: int | None = None  # keep_snapshots(..., max_snapshots): thin beyond this
        self.snapshots: dict[int, Any] = {}
        self._notable: set[int] = set()        # steps whose snapshot thinning keeps (key moments)
        self._peak = 0.0
        from paged.sim.simulator import SimConfig, Simulator
        self.result = None          # the simulator's SimResult once a simulated run is done
        self.last_output = None     # the engine's last StepOutput
        if isinstance(front, (SimConfig, Simulator)):
            self.sim = front if isinstance(front, Simulator) else Simulator(
                dataclasses.replace(front, record_events=True))
            self.engine, self.workload, self.label, self.tokenizer = None, workload, "simulator", None
            cfg = self.sim.config
            self.backend = f"simulated {cfg.model} on {cfg.tensor_parallel}x {cfg.gpu} (cost model, no kernels run)"
            self._steps = iter(self.sim.iter_steps(workload))
            return
        self.sim, self.engine = None, getattr(front, "engine", front)
        self.label, self.tokenizer = "engine", self.engine.tokenizer
        self.workload = [w if isinstance(w, EngineRequest) else EngineRequest(**w) for w in workload]
        self._ids = {w.request_id for w in self.workload}
        if len(self._ids) != len(self.workload):
            raise ConfigError("workload request ids must be unique")
        self._pending = sorted(self.workload, key=lambda w: w.arrival_step)
        self._token_times: dict[str, list[float]] = {}  # request id -> engine-clock end of each step with its tokens
        self.backend = backend_label(self.engine.device, self.engine.runner.backend)

    def keep_snapshots(self, stride: int = 1, max_snapshots: int | None = None) -> "Run":
        """Keep a snapshot after every `stride`-th step and after every step with a key moment
        (copy-on-write, preemption, swap, tier move, compaction, a usage peak 2% above the last
        one or a full pool, the first prefix hit: ``paged.story``), for replays; 0 stops. With `max_snapshots`, when more are kept the
        regular ones are thinned (every other one dropped, the stride doubled), then the notable
        ones, so memory stays bounded on long runs over large pools."""
        if not isinstance(stride, int) or stride < 0:
            raise ConfigError(f"stride must be an integer >= 0 (0 stops keeping snapshots), got {stride!r}")
        if max_snapshots is not None and (not isinstance(max_snapshots, int) or max_snapshots < 2):
            raise ConfigError(f"max_snapshots must be an integer >= 2 or None, got {max_snapshots!r}")
        self.snapshot_stride, self.max_snapshots = stride, max_snapshots
        return self

    def _is_notable(self, row: dict) -> bool:
        first_hit = row["prefix_cache_hits"] > 0 and (len(self.rows) < 2 or self.rows[-2]["prefix_cache_hits"] == 0)
        # a new usage peak, by 2% of the pool at least (rising usage would make every step one)
        u = row["kv_cache_usage_perc"]
        peak = u > self._peak + 0.02 or (u > self._peak and u >= 0.999)
        if peak:
            self._peak = u
        return bool(first_hit or peak or any(row[m.column] for m in MOMENTS.values() if m.column))

    def _after_step(self) -> None:
        k, n = self.snapshot_stride, len(self.rows)
        if not k:
            return
        notable = self._is_notable(self.rows[-1])
        if notable or n % k == 0:
            self.snapshots[n] = self.snapshot()
            if notable:
                self._notable.add(n)
            if self.max_snapshots is not None and len(self.snapshots) > self.max_snapshots:
                self._thin()

    def _thin(self) -> None:
        """Drop every other regular snapshot (doubling the stride); if only notable ones are
        left over the cap, every other notable one (the last usage peak stays)."""
        self.snapshot_stride *= 2
        for s in [s for s in self.snapshots if s not in self._notable and s % self.snapshot_stride]:
            del self.snapshots[s]
        if len(self.snapshots) > self.max_snapshots:
            peak = max(self._notable, key=lambda s: (self.rows[s - 1]["kv_cache_usage_perc"], -s), default=None)
            for s in sorted(self._notable)[1::2]:
                if s != peak:
                    del self.snapshots[s]
                    self._notable.discard(s)

    def _track(self, events: Sequence[ev.Event], num_blocks: int) -> None:
        if self._last_use is None:
            self._last_use = np.full(num_blocks, -1, np.int32)
        self.events.extend(events)
        for e in events:
            if e[3] is not None and e[1] in _USE_KINDS and 0 <= e[3] < num_blocks:
                self._last_use[e[3]] = e[0]

    def run_to_completion(self, max_steps: int = 100_000) -> "Run":
        """Step until done (blocking)."""
        for _ in range(max_steps):
            if self.done:
                break
            self.step()
        return self

    @property
    def kv(self):
        return (self.engine or self.sim).kv

    @property
    def scheduler(self):
        return (self.engine or self.sim).scheduler

    def step(self) -> dict | None:
        """One step: its STEP_COLUMNS row (seconds on the run's clock: the engine's own, which pausing
        between steps does not move, or the simulated one). A simulated run knows its trace is over only
        when asked for one more step: that call returns None and sets ``done``."""
        if self.done:
            raise PagedError("this run is done; use fresh() for a new one")
        if self.engine is not None:
            row, events, plan = self._engine_step()
        else:
            try:
                s = next(self._steps)
            except StopIteration:
                self.done = True
                self.result = self.sim.result()
                return None
            row, events, plan = s.row, list(s.events), s.plan
        from paged.core.snapshot import written_blocks
        self._track(events, self.kv.num_blocks)
        self._written = written_blocks(self.kv, plan.scheduled)
        self.rows.append(row)
        if self.engine is not None:
            self.done = not self._pending and not self.engine.has_unfinished_requests()
        self._after_step()
        return row

    def _engine_step(self):
        from paged.engine import SamplingParams
        from paged.engine.groups import SEQ_ID_SEP  # '<group id>#k': the engine's sequence ids
        while self._pending and self._pending[0].arrival_step <= len(self.rows) + 1:  # the step about to run
            w = self._pending.pop(0)
            self.engine.add_request(w.request_id, w.prompt, w.params or SamplingParams())
            self._token_times[w.request_id] = []
        out = self.last_output = self.engine.step()
        row = out.to_row()
        end = row["time_s"] + row["step_time_s"]
        for gid in {sid.split(SEQ_ID_SEP)[0] for sid in out.new_tokens}:
            if gid in self._token_times:
                self._token_times[gid].append(end)
        return row, out.events, out.plan

    def snapshot(self, with_tokens: bool | None = None, block_range: tuple[int, int] | None = None):
        """KVSnapshot now; blocks written by the last step are marked WRITING (``with_tokens``: the
        blocks' token ids, by default for the engine only; ``block_range``: see
        ``paged.core.snapshot.take_snapshot``)."""
        return self.kv.snapshot(self.scheduler.requests, step=len(self.rows), writing=self._written,
                                last_use=self._last_use, block_range=block_range,
                                with_tokens=self.engine is not None if with_tokens is None else with_tokens)

    def request_rows(self) -> list[dict]:
        """REQUEST_COLUMNS rows: the engine's own records of the workload's finished requests; the
        simulator's once its run is done."""
        if self.engine is not None:
            return [r for r in self.engine.request_rows() if r["request_id"] in self._ids]
        if self.result is None:
            return []
        rq = self.result.requests
        return rq[[c for c in REQUEST_COLUMNS if c in rq.columns]].to_dict("records")

    def tbt_samples(self) -> np.ndarray:
        """Every gap between two consecutive token steps of a request (seconds), all requests."""
        if self.sim is not None:
            return self.sim.tbt_samples()
        gaps = [np.diff(t) for t in self._token_times.values() if len(t) > 1]
        return np.concatenate(gaps) if gaps else np.zeros(0)

    def fresh(self, workload: Any = None, **config: Any) -> "Run":
        """A new run of the same workload (or ``workload``) with changed settings (``config``: the
        front's config fields); the engine's reuses the loaded model."""
        workload = self.workload if workload is None else workload
        if self.sim is not None:
            return Run(dataclasses.replace(self.sim.config, **config), workload)
        from paged.engine import LLMEngine
        return Run(LLMEngine(self.engine.loaded, dataclasses.replace(self.engine.config, **config)), workload)


def chat_workload(tokenizer, num_requests: int = 8, *, system_prompt: str | None = None, max_tokens: int = 24,
                  n: int = 1, arrive_every: int = 2, seed: int = 0) -> list[EngineRequest]:
    """Chat requests sharing one system prompt (prefix-cache hits), arriving every `arrive_every`
    steps; request 0 samples `n` continuations (parallel sampling: shared blocks, copy-on-write)."""
    from paged.engine import SamplingParams
    system = system_prompt or ("You are a helpful assistant for a class on operating systems. Answer in one "
                               "short paragraph, plainly, and say when you are unsure.")
    out = []
    for i in range(num_requests):
        prompt = f"{system}\nUser: Explain {TOPICS[(i + seed) % len(TOPICS)]} in two sentences.\nAssistant:"
        k = n if i == 0 else 1
        params = SamplingParams(max_tokens=max_tokens, n=k, temperature=0.8 if k > 1 else 0.0, seed=seed + i,
                                ignore_eos=True)
        out.append(EngineRequest(f"req-{i}", tokenizer.encode(prompt) if tokenizer else prompt, params,
                                 1 + i * arrive_every))
    return out


def interference_workload(tokenizer, num_decoders: int = 4, decode_tokens: int = 48, num_long: int = 2,
                          long_prompt_tokens: int = 384, long_every: int = 12) -> list[EngineRequest]:
    """Short chats that decode for a while, then long prompts arriving every `long_every` steps:
    without chunked prefill a long prefill stalls every decode for a whole step."""
    from paged.engine import SamplingParams
    base = tokenizer.encode("The history of computing, told as a long story: ") if tokenizer else [17] * 12
    long_ids = (base * (long_prompt_tokens // len(base) + 1))[:long_prompt_tokens]
    out = [EngineRequest(f"chat-{i}", base[:8] + [20 + i], SamplingParams(max_tokens=decode_tokens, ignore_eos=True), 1)
           for i in range(num_decoders)]
    for j in range(num_long):  # distinct prompts (each token + j + 1): no prefix hits between them
        out.append(EngineRequest(f"long-{j}", [min(t + j + 1, 49000) for t in long_ids],
                                 SamplingParams(max_tokens=4, ignore_eos=True), 4 + j * long_every))
    return out
