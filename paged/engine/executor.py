"""The torch executor: a plan's cache operations, forward pass(es) and sampling on the real model.

``ModelExecutor.execute(plan)`` applies the plan's cache operations (``ModelRunner.apply_cache_ops``),
runs one forward pass over the plan's batch (two with ``split_prefill_decode``: decodes, then
prefills), samples a token per sampling chunk through the engine's groups (n > 1, beams) and hands
the loop the actions that must follow ``Scheduler.update`` (forks). A step that fails half-way
aborts exactly that step's requests (``paged.engine.recovery``) and raises ``StepFailedError``.
"""
from __future__ import annotations

from typing import Any

import torch

from paged.core.loop import Executed
from paged.core.plan import Batch, SchedulerOutput
from paged.errors import StepFailedError
from .recovery import abort_failed_step

__all__ = ["ModelExecutor"]


class ModelExecutor:
    """Executes plans on an ``LLMEngine``'s runner (read at every step, so a wrapped
    ``runner.forward`` or ``apply_cache_ops`` is what runs)."""

    executes_empty_plans = True  # a plan of swaps alone still moves blocks

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def execute(self, plan: SchedulerOutput) -> Executed:
        eng = self.engine
        runner, batch = eng.runner, plan.batch
        cache_ms = None
        try:  # all-or-nothing for the caller: a failure aborts exactly this step's requests
            cache_ms = runner.apply_cache_ops(plan)
            swap, nxt = runner.swap, eng.scheduler.swapped
            if swap is not None and nxt and not plan.preempted and eng.kv.is_swapped(nxt[0].request_id):
                # overlap mode: the next swap-in's host->device copy rides beside this forward
                swap.prefetch(eng.kv.swapped_host_blocks(nxt[0].request_id))
            decodes = [i for i in range(len(batch)) if batch.is_decode(i)]
            limits = {r.request_id: len(g.prompt_token_ids) - 1 for r in batch.requests
                      if (g := r.data.group).prompt_logprobs is not None}
            prefill_ms = decode_ms = None
            passes = self._split_passes(batch, decodes) if eng.config.split_prefill_decode else None
            if passes is not None:
                rd, rp = (self._forward(batch.select(p), limits) for p in passes)
                prompt_parts = [rd.prompt_logits, rp.prompt_logits]
                decode_ms, prefill_ms = rd.forward_ms, rp.forward_ms
                sample_ids = rd.sample_ids + rp.sample_ids
                logits = torch.cat([rd.logits, rp.logits])
                forward_ms = decode_ms + prefill_ms
            else:
                r = self._forward(batch, limits)
                sample_ids, logits, forward_ms = r.sample_ids, r.logits, r.forward_ms
                prompt_parts = [r.prompt_logits]
                if len(decodes) == len(batch):
                    decode_ms, prefill_ms = forward_ms, 0.0
                elif not decodes:
                    decode_ms, prefill_ms = 0.0, forward_ms
            sampled, post = eng.groups.sample(sample_ids, logits)
            eng.groups.record_logprobs(sample_ids, logits, sampled, prompt_parts)
        except BaseException as e:
            err = abort_failed_step(eng, plan, e, cache_ms is not None)
            if isinstance(e, Exception):
                raise err from e
            try:  # KeyboardInterrupt & co. propagate as themselves, with the error as their context
                raise err
            except StepFailedError:
                raise e
        eng.groups.note_preempted(plan.preempted)
        ms = lambda x: None if x is None else x * 1e-3  # noqa: E731 - the runner's ms, the record's seconds
        return Executed(sampled, None, {"cache_ops_s": ms(cache_ms), "forward_s": ms(forward_ms),
                                        "prefill_s": ms(prefill_ms), "decode_s": ms(decode_ms)}, post)

    def _forward(self, batch: Batch, limits: dict[str, int]):
        runner = self.engine.runner  # prompt_limits only when asked: callers may wrap runner.forward(batch)
        return runner.forward(batch, prompt_limits=limits) if limits else runner.forward(batch)

    def _split_passes(self, batch: Batch, decodes: list[int]) -> tuple[list[int], list[int]] | None:
        """The two forward passes of ``split_prefill_decode`` (entry indices): decodes first, then
        prefills; None when the step has only one kind.

        Decodes go first because a prefill may hit a block that a decode completes in this
        step. A decode-sized chunk may itself read a block a prefill chunk writes in this
        step (a request readmitted after recompute preemption whose prefix hit covers all but
        its last token, e.g. one of n identical greedy samples): such a chunk joins the
        prefill pass, so every block is written before it is read.
        """
        if not decodes or len(decodes) == len(batch):
            return None
        is_decode = set(decodes)
        prefills = [i for i in range(len(batch)) if i not in is_decode]
        bs, written = self.engine.kv.block_size, set()
        for i in prefills:  # block ids from the plan: each entry carries its request's table
            s, n = batch.starts[i], batch.num_tokens[i]
            written.update(b.block_id for b in batch.tables[i][s // bs:(s + n - 1) // bs + 1])
        late = [i for i in decodes
                if not written.isdisjoint(b.block_id for b in batch.tables[i][:batch.starts[i] // bs + 1])]
        return [i for i in decodes if i not in late], late + prefills
