"""Triton decode kernels (any CUDA GPU): the tunable baseline and fallback.

They read the cache layout of :mod:`foscar.format` (``docs/layout.md``) and compute what
:func:`foscar.decode_folded` specifies. ``TRITON_INTERPRET=1`` runs them on the CPU (tests).
"""
from .launch import append, append_step, decode, decode_bf16

__all__ = ["append", "append_step", "decode", "decode_bf16"]
