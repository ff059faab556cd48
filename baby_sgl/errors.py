"""Errors that are not the client's bad input (that is ValueError, a 400): the server answers
these with 503, and the client may try again later."""

from __future__ import annotations


class ServerBusyError(RuntimeError):
    """A limit is reached (queued requests, open sessions): try again later."""


class EngineDeadError(RuntimeError):
    """The scheduler thread has stopped; the engine serves nothing more."""


class MemoryLeakError(AssertionError):
    """A memory structure's integrity check failed (a KV slot or request slot lost or owned
    twice): a bug, never the client's doing."""
