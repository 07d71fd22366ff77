"""Errors raised by foscar.

Every check on a caller's input raises one of these (never ``assert``), and every message
names the argument and says what was expected and what was given.
"""
from __future__ import annotations


class FoscarError(Exception):
    """Base class of every error foscar raises on purpose."""


class InvalidArgumentError(FoscarError, ValueError):
    """An argument has the wrong shape, dtype, device, stride, value or range."""

    def __init__(self, name: str, expected: str, got: object):
        self.argument = name
        self.expected = expected
        self.got = got
        super().__init__(f"{name}: expected {expected}, got {got}")


class UnsupportedError(FoscarError, NotImplementedError):
    """A combination of options that foscar (or one backend) does not implement."""

    def __init__(self, what: str, reason: str):
        self.what = what
        self.reason = reason
        super().__init__(f"{what}: unsupported: {reason}")
