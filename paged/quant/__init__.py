"""KV-cache quantization study: formats, llama-perplexity's KL protocol, per-layer diagnostics.

``paged.quant.study(formats=["int8", "int4"], context_lengths=(512,))`` returns a tidy DataFrame
(one row per context length, text source and format; see :mod:`paged.quant.study`);
:func:`perplexity` scores texts through the serving engine (``paged.LLM``) with prompt
log-probabilities; :mod:`paged.quant.diagnostics` has per-layer errors, one-layer sensitivity and
key outliers; their plotly figures are in :mod:`paged.viz.quant`. Formats are named by
:func:`parse_scheme` (``"int8"``, ``"int8/int4"``, ``"int4_g64+rot"``, ``"int4_kivi"``, ...);
:func:`engine_settings` gives the ``paged.LLM`` settings of the ones the engine serves.
"""
from .perplexity import chunk_nll, perplexity
from .schemes import DEFAULT_SCHEMES, NOISE_FLOOR, Scheme, Side, engine_settings, parse_scheme
from .study import describe_formats, resolve_schemes, study
from .text import SOURCES, load_texts, make_chunks

__all__ = ["DEFAULT_SCHEMES", "NOISE_FLOOR", "SOURCES", "Scheme", "Side", "describe_formats", "engine_settings",
           "load_texts", "make_chunks", "parse_scheme", "chunk_nll", "perplexity", "resolve_schemes", "study"]
