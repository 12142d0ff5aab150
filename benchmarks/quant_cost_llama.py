"""llama.cpp's batched decode step per KV cache type, for ``benchmarks/quant_cost.py`` (a worker
process without torch: two OpenMP runtimes in one process crash llama.cpp's decode).

    python benchmarks/quant_cost_llama.py GGUF --batch 8 --prompt 512 --steps 8 --rounds 3 --out t.json \
        --llama-site /tmp/venv-llamacpp/lib/python3.11/site-packages

One context per type (f16, q8_0, q4_0 for K and V; flash attention on, one thread, a KV buffer
per sequence), ``--batch`` sequences of seeded random prompts prefilled one per call, then
``--rounds`` rounds of ``--steps`` decode steps of one token per sequence, the types taking turns
per round. Writes ``{"version", "times": {type: [median thread CPU ms per step, per round]}}``.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time


def llama_worker(gguf: str, batch: int, prompt: int, steps: int, rounds: int, out: str) -> None:
    """In a process without torch: median batched decode step (thread CPU ms) of llama.cpp per cache type."""
    import llama_cpp as L
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False  # no weight repacking (its AMX path crashes the prefill on this VM)
    model = L.llama_model_load_from_file(gguf.encode(), mp)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(prompt)] for _ in range(batch)]
    types = {"f16": L.GGML_TYPE_F16, "q8_0": L.GGML_TYPE_Q8_0, "q4_0": L.GGML_TYPE_Q4_0}
    ctxs, pos = {}, {}
    for name, t in types.items():
        p = L.llama_context_default_params()
        p.n_ctx = batch * (prompt + steps * rounds + 8)
        p.n_batch = p.n_ubatch = prompt
        p.n_seq_max, p.n_threads, p.n_threads_batch = batch, 1, 1
        p.type_k = p.type_v = t
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        p.kv_unified = False
        ctx = L.llama_init_from_model(model, p)
        b = L.llama_batch_init(prompt, 0, 1)
        for s_, toks in enumerate(prompts):  # prefill one sequence per call
            for i, tok in enumerate(toks):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, i, 1, i == prompt - 1
                b.seq_id[i][0] = s_
            b.n_tokens = prompt
            assert L.llama_decode(ctx, b) == 0
        L.llama_batch_free(b)
        ctxs[name], pos[name] = ctx, prompt
    times = {n: [] for n in types}
    b = L.llama_batch_init(batch, 0, 1)
    for _ in range(rounds):
        for name, ctx in ctxs.items():
            c0 = time.thread_time()
            for _ in range(steps):
                for s_ in range(batch):
                    b.token[s_], b.pos[s_], b.n_seq_id[s_], b.logits[s_] = rng.randrange(100, 40000), pos[name], 1, True
                    b.seq_id[s_][0] = s_
                b.n_tokens = batch
                assert L.llama_decode(ctx, b) == 0
                pos[name] += 1
            times[name].append((time.thread_time() - c0) / steps * 1e3)
    with open(out, "w") as f:
        json.dump({"version": L.__version__, "times": times}, f)




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--llama-site", default=None)
    a = ap.parse_args()
    if a.llama_site:
        sys.path.append(a.llama_site)  # last: this venv's packages win
    llama_worker(a.gguf, a.batch, a.prompt, a.steps, a.rounds, a.out)


if __name__ == "__main__":
    main()
