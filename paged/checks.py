"""One rule for user-facing types, used by SamplingParams, EngineConfig, LLM and generate.

- an integer is a ``numbers.Integral`` that is not a ``bool`` (numpy integers count);
- a real number is a finite ``numbers.Real`` that is not a ``bool``;
- a flag is a ``bool``.

Each ``need_*`` helper returns the value as a plain Python ``int``/``float``/``bool`` or raises
``error(message)`` naming the field, the value given and what is expected.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable

Error = Callable[[str], Exception]


def is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))


def need_int(name: str, v: Any, error: Error, *, minimum: int | None = None, optional: bool = False,
             hint: str = "") -> int | None:
    """``v`` as an int (``None`` passes when ``optional``); ``minimum`` inclusive."""
    if v is None and optional:
        return None
    if not is_int(v) or (minimum is not None and v < minimum):
        need = "an integer" + (f" >= {minimum}" if minimum is not None else "") + (" or None" if optional else "")
        raise error(f"{name} must be {need}, got {v!r}" + (f"; {hint}" if hint else ""))
    return int(v)


def need_real(name: str, v: Any, error: Error, *, minimum: float | None = None, maximum: float | None = None,
              open_min: bool = False, open_max: bool = False, optional: bool = False, hint: str = "") -> float | None:
    """``v`` as a finite float within the given bounds (``open_*``: bound excluded)."""
    if v is None and optional:
        return None
    ok = is_real(v)
    if ok and minimum is not None:
        ok = v > minimum if open_min else v >= minimum
    if ok and maximum is not None:
        ok = v < maximum if open_max else v <= maximum
    if not ok:
        rng = f" in {'(' if open_min else '['}{minimum}, {maximum}{')' if open_max else ']'}" \
            if minimum is not None and maximum is not None else \
            (f" {'>' if open_min else '>='} {minimum}" if minimum is not None else
             (f" {'<' if open_max else '<='} {maximum}" if maximum is not None else ""))
        raise error(f"{name} must be a finite number{rng}, got {v!r}" + (f"; {hint}" if hint else ""))
    return float(v)


def need_flag(name: str, v: Any, error: Error) -> bool:
    if not isinstance(v, bool):
        raise error(f"{name} must be True or False, got {v!r}")
    return v
