"""Shared-system-prompt chat workloads as token ids, the same for a vLLM server and our engine.

Request i = system prompt ``i % systems`` + its own question. Each system prompt is a rule-set
line and two of ``paged.studies.prefix_caching.SYSTEM_PROMPTS`` (~95 tokens with SmolLM2's
tokenizer: two full blocks of 32 shared by every request of that system prompt, the third
holding the question). Token ids, not text, so both engines see exactly the same prompts.
"""
from __future__ import annotations

from typing import Any

from paged.studies.prefix_caching import QUESTIONS, SYSTEM_PROMPTS


def system_prompt(k: int) -> str:
    """System prompt ``k`` (distinct for every k)."""
    return f"Rule set {k}. {SYSTEM_PROMPTS[k % len(SYSTEM_PROMPTS)]} {SYSTEM_PROMPTS[(k + 1) % len(SYSTEM_PROMPTS)]}"


def chat_prompts(tokenizer: Any, n: int, systems: int = 4) -> list[list[int]]:
    """``n`` prompts as token ids over ``systems`` system prompts."""
    return [tokenizer.encode(f"{system_prompt(i % systems)}\nUser: Explain {QUESTIONS[i % len(QUESTIONS)]} "
                             f"to student {i}.\nAssistant:") for i in range(n)]
