"""Our exception types. Every message says what to change; no state changes when one is raised."""
from __future__ import annotations


class PagedError(Exception):
    """Base class of every error raised by the workbench."""


class ConfigError(PagedError, ValueError):
    """A configuration value is invalid (block size, pool size, budgets, ...)."""


class InvalidRequestError(PagedError, ValueError):
    """A request can never be served as given (empty, too long, bad sampling parameters)."""


class UnknownRequestError(PagedError, KeyError):
    """A request id is not known to the component that was asked."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(PagedError, ValueError):
    """A request id is already in use."""


class BlockStateError(PagedError, RuntimeError):
    """A block operation contradicts the block's state (double free, freeing a block in use)."""


class CacheInUseError(PagedError, RuntimeError):
    """An operation that needs an idle cache (e.g. reset) was asked while blocks are in use."""


class ModelLoadError(ConfigError):
    """A model name, path or checkpoint cannot be loaded; the message says what is supported."""


class StepFailedError(PagedError, RuntimeError):
    """An engine step could not complete. ``request_ids``: the requests it aborted (blocks freed)
    or whose output it could not build; ``step_output``: what the step still produced, or None
    when the forward pass or sampling failed (then nothing of the step was applied)."""

    def __init__(self, message: str, request_ids=(), step_output=None) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)
        self.step_output = step_output


class ConnectError(PagedError, ConnectionError):
    """A live source cannot reach its server (wrong endpoint, server down, timed out)."""


class WireFormatError(PagedError, ValueError):
    """A message from a server does not follow the wire format it claims (counted, not fatal, in live sources)."""


class SweepPointError(PagedError, RuntimeError):
    """A point of ``paged.sweep(..., on_error="raise")`` failed; the message names it and its error."""


class PagedWarning(UserWarning):
    """A setting that works but costs what its user would not expect (the message says what to change)."""


class NoReplicaError(PagedError, RuntimeError):
    """A fleet has no replica up to take a request (all marked down)."""


class ReplicaDownWarning(UserWarning):
    """A fleet replica stopped answering: it is marked down and routing goes on without it."""
