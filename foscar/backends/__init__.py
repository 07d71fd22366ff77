"""The decode backends, one module each behind one protocol (:mod:`foscar.backends.base`):

- ``"cute"`` (:mod:`.cute_sm90`): the CuTe DSL sm_90a kernels, on Hopper with ``foscar[cute]``;
- ``"triton"`` (:mod:`.triton`): the Triton kernels, on any CUDA GPU;
- ``"reference"`` (:mod:`.reference`): :func:`foscar.decode_folded` in PyTorch with the kernels' operand
  rounding, on any device.

:data:`AUTO_ORDER` is the order ``backend="auto"`` tries them in. Nothing outside this package dispatches
on a backend's name: :func:`get` returns the object, whose ``status`` says whether it can run.
"""
from __future__ import annotations

from .base import Backend, BackendStatus, LaunchPlan, ProblemKey
from .cute_sm90 import CuteSm90
from .reference import Reference
from .triton import Triton

REGISTRY: dict[str, Backend] = {b.name: b for b in (CuteSm90(), Triton(), Reference())}
BACKENDS = tuple(REGISTRY)
AUTO_ORDER = ("cute", "triton", "reference")
TUNABLE = tuple(name for name, b in REGISTRY.items() if b.tunable)


def get(name: str) -> Backend:
    """The backend called ``name`` (one of :data:`BACKENDS`)."""
    if name not in REGISTRY:
        from ..errors import InvalidArgumentError
        raise InvalidArgumentError("backend", f"one of {BACKENDS}", repr(name))
    return REGISTRY[name]


def statuses(key: ProblemKey) -> list[BackendStatus]:
    """Every backend's status for ``key``, in :data:`BACKENDS` order."""
    return [b.status(key) for b in REGISTRY.values()]


__all__ = ["AUTO_ORDER", "BACKENDS", "TUNABLE", "REGISTRY", "Backend", "BackendStatus", "LaunchPlan", "ProblemKey", "get",
           "statuses"]
