"""paged.studies: one module per question, each a set of plain functions that run an executor
(the torch engine, the simulator, or the core alone) and return DataFrames (or a dict / a small
dataclass where the answer is a verdict). Nothing here draws: the figures of a study live in
``paged.viz`` and take its frames; notebooks call a study, then its figures.

    budget          how many bytes a request's K/V take; preallocation waste; circulating claims checked
    fragmentation   contiguous allocators vs paging on one trace; block size; the engine at small scale
    papers          the papers' experiments: memory story (vLLM Fig. 2), interference (Sarathi-Serve),
                    block-size ablation (vLLM Fig. 18)
    prefix_caching  shared system prompts on the engine, LRU eviction vs pool size, verified hits
    preemption      recompute vs swap: on the engine (and its swap transports), priced, simulated
    offload         when CPU offload pays: swap preemption and KV streaming at scale; the seed's swap claims
    swap_error      the error compressed swap adds, measured on the engine
    host_tier       recompute evicted prefixes vs bring them back from host memory (simulator, engine)
    compaction      does block compaction pay: reads, copies, the engine, the simulator, a before/after demo
    sharing         cross-layer KV sharing: memory saved vs quality lost, and what predicts it
    cache_replay    a trace's prompts through the prefix cache alone (no model): hit rate per capacity
    mooncake        Mooncake FAST'25 reproduced: the trace table (Table 2), hit rate vs capacity (Fig. 9)
    kv_formats      greedy output and capacity under each KV format on the engine
    demo            the headline demo and its markdown report (``python -m paged demo``)
    grid            simulated runs over a grid of points (trace keys + ``SimConfig`` fields)
    engine_setup    what the engine studies share: the model they load, a greedy generate

The KV-quantization error study keeps its home in ``paged.quant`` (formats, metrics, ``study``).

A new ablation is one new module here (functions taking plain settings, returning DataFrames)
plus, if it needs a figure, one builder in ``paged.viz``. Studies may import ``paged.core``,
``paged.engine``, ``paged.sim``, ``paged.quant`` and ``paged.models``; nothing below imports a
study, and no study imports ``paged.viz`` (``tests/test_imports.py``).
"""
