"""An executor's config made of parts: a ``CacheConfig`` (``.cache``) and a ``SchedulerConfig``
(``.scheduler``) beside the executor's own fields, built and read with flat names too.

``@composed`` on a frozen, keyword-only dataclass deriving from ``ComposedConfig`` gives it:

- flat construction: ``SimConfig(block_size=32, policy="priority", model="llama-2-7b")`` puts each
  knob in its part (``cache``/``scheduler`` objects may be passed too; flat knobs then override
  theirs, which is also how ``dataclasses.replace(config, block_size=8)`` works); an unknown name
  is a ConfigError listing the valid ones;
- flat reading: ``config.block_size`` is ``config.cache.block_size`` (read-only: configs are frozen);
- old spellings (``DEPRECATED``) keep working for a while with a DeprecationWarning naming the new one;
- ``knobs()`` (every flat name, in order: cache, scheduler, own fields), ``knob_fields()`` and
  ``as_dict()`` (flat values, so ``type(c)(**c.as_dict()) == c``).

Each part validates its own fields once, in its ``__post_init__``.
"""
from __future__ import annotations

import dataclasses
import typing
import warnings
from typing import Any, Callable, ClassVar, TypeVar

from paged.errors import ConfigError
from .config import CacheConfig, SchedulerConfig

__all__ = ["ComposedConfig", "DEPRECATED", "composed"]


def _swap_overlap(value: Any) -> str:
    if not isinstance(value, bool):
        raise ConfigError(f"swap_overlap (deprecated: use swap_mode='overlap' or 'sync') must be True or False, "
                          f"got {value!r}")
    return "overlap" if value else "sync"


# old name -> (new name, old value -> new value, new value -> old value)
DEPRECATED: dict[str, tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = {
    "kv_format": ("kv_cache_dtype", lambda v: v, lambda v: v),
    "swap_space_gib": ("swap_space", lambda v: v, lambda v: v),
    "swap_overlap": ("swap_mode", _swap_overlap, lambda v: v == "overlap"),
}


def warn_deprecated(old: str, stacklevel: int = 3) -> None:
    new = DEPRECATED[old][0]
    hint = " ('overlap' for True, 'sync' for False)" if old == "swap_overlap" else ""
    warnings.warn(f"{old!r} is deprecated; use {new!r}{hint}", DeprecationWarning, stacklevel=stacklevel)


def renamed(kw: dict[str, Any], stacklevel: int = 4) -> dict[str, Any]:
    """``kw`` with deprecated names replaced by today's (warning once per name used)."""
    if not DEPRECATED.keys() & kw.keys():
        return kw
    out = dict(kw)
    for old, (new, convert, _) in DEPRECATED.items():
        if old in out:
            if new in out:
                raise ConfigError(f"{old!r} and {new!r} name the same setting; give only {new!r}")
            warn_deprecated(old, stacklevel)
            out[new] = convert(out.pop(old))
    return out


class ComposedConfig:
    """Base of ``EngineConfig`` and ``SimConfig``; see the module docstring."""

    PARTS: ClassVar[dict[str, type]] = {"cache": CacheConfig, "scheduler": SchedulerConfig}

    @classmethod
    def knob_fields(cls) -> dict[str, tuple[str | None, dataclasses.Field]]:
        """Flat name -> (the part holding it, or None for the config's own field; its Field)."""
        out: dict[str, tuple[str | None, dataclasses.Field]] = {}
        for part, part_cls in cls.PARTS.items():
            out.update((f.name, (part, f)) for f in dataclasses.fields(part_cls))
        out.update((f.name, (None, f)) for f in dataclasses.fields(cls) if f.name not in cls.PARTS)
        return out

    @classmethod
    def knobs(cls) -> list[str]:
        """Every flat setting name: the cache's, the scheduler's, then the config's own."""
        return list(cls.knob_fields())

    @classmethod
    def knob_types(cls) -> dict[str, Any]:
        """Flat name -> its annotated type (``int | None`` and such, resolved)."""
        hints = {part: typing.get_type_hints(part_cls) for part, part_cls in cls.PARTS.items()}
        own = typing.get_type_hints(cls)
        return {name: (hints[part] if part else own)[name] for name, (part, _) in cls.knob_fields().items()}

    def as_dict(self) -> dict[str, Any]:
        """Every knob by its flat name (``type(self)(**self.as_dict())`` rebuilds this config)."""
        return {name: getattr(getattr(self, part) if part else self, name)
                for name, (part, _) in self.knob_fields().items()}


C = TypeVar("C", bound=type)


def composed(cls: C) -> C:
    """Flat construction and reading for a dataclass deriving from ``ComposedConfig``."""
    init = cls.__init__
    knob_fields = cls.knob_fields()
    owned = {part: [f.name for f in dataclasses.fields(part_cls)] for part, part_cls in cls.PARTS.items()}
    clash = [n for n, (part, _) in knob_fields.items() if part is None and any(n in v for v in owned.values())]
    assert not clash, f"{cls.__name__}: own fields {clash} shadow part knobs"

    def __init__(self: Any, **kw: Any) -> None:
        kw = renamed(kw)
        unknown = sorted(set(kw) - set(knob_fields) - set(cls.PARTS))
        if unknown:
            raise ConfigError(f"{cls.__name__}: unknown setting(s) {', '.join(unknown)}; valid: "
                              f"{', '.join(knob_fields)}")
        for part, part_cls in cls.PARTS.items():
            flat = {name: kw.pop(name) for name in owned[part] if name in kw}
            base = kw.pop(part, None)
            if base is None:
                kw[part] = part_cls(**flat)
            elif isinstance(base, part_cls):
                kw[part] = dataclasses.replace(base, **flat) if flat else base
            else:
                raise ConfigError(f"{cls.__name__}: {part} must be a {part_cls.__name__}, got {type(base).__name__}")
        init(self, **kw)

    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__
    for name, (part, _) in knob_fields.items():
        if part is not None:
            setattr(cls, name, property(lambda self, p=part, n=name: getattr(getattr(self, p), n),
                                        doc=f"``{part}.{name}``"))
    for old, (new, _, back) in DEPRECATED.items():
        def read(self: Any, old: str = old, new: str = new, back: Callable[[Any], Any] = back) -> Any:
            warn_deprecated(old, 2)
            return back(getattr(self, new))
        setattr(cls, old, property(read, doc=f"deprecated: ``{new}``"))
    return cls
