"""Model-loading errors (subclasses of ``paged.errors.ConfigError``)."""
from __future__ import annotations

from ..errors import ConfigError


class ModelLoadError(ConfigError):
    """A model name, path or checkpoint cannot be loaded; the message says what is supported."""
