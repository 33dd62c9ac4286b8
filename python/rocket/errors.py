"""Exceptions raised by rocket. Every error is a :class:`RocketError`; bad
arguments are also :class:`ValueError` and carry ``parameter`` and ``value``."""

from __future__ import annotations


class RocketError(Exception):
    """Base class of every error rocket raises."""


class ModelLoadError(RocketError):
    """The model path is missing, unreadable, corrupt or unsupported."""


class TokenizerError(RocketError):
    """Tokenizer or chat template failure."""


class InvalidArgumentError(RocketError, ValueError):
    """A bad argument; ``parameter`` names it and ``value`` is the given value as
    text (a Python argument as its ``repr``; for a :class:`ContextLengthError`, the
    prompt's token count)."""

    parameter: str | None = None
    value: object = None


class ContextLengthError(InvalidArgumentError):
    """Prompt plus max_tokens exceeds the context limit."""

    prompt_tokens: int | None = None
    max_tokens: int | None = None
    limit: int | None = None


class DeviceError(RocketError):
    """The requested device is unavailable or out of memory."""


class InternalError(RocketError):
    """A bug in rocket (including a caught Rust panic)."""


__all__ = [
    "RocketError",
    "ModelLoadError",
    "TokenizerError",
    "InvalidArgumentError",
    "ContextLengthError",
    "DeviceError",
    "InternalError",
]
