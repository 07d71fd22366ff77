"""The quantized tokens each query column of a decode sees: a sequence's quantized length under its BF16 windows
(:func:`quantized_length`), and in a step of several tokens each column's causal limit (:func:`causal_limits`) and
the first token any score is masked at (:func:`first_masked`)."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .config import Sm90Config
from .fragment import column_token, slot_column


@cute.jit
def first_masked(cfg: Sm90Config, n, last):
    """:attr:`~foscar.cute.warpgroup.Warpgroup.mask_from`: ``n``, or in a step (``cfg.causal``) the causal limit of
    its first token, which no column's is below (:func:`causal_limits` with ``j = 0``; ``last``:
    :func:`causal_last`)."""
    lo = n
    if cutlass.const_expr(cfg.causal):
        lo = last - (cfg.tail + cfg.step - 1)
        if cutlass.const_expr(cfg.windows):
            lo = quantized_length(cfg, lo)
    return lo


def causal_limits(cfg: Sm90Config, col0, last) -> list | None:
    """A step of several tokens, or a part of one (``cfg.causal``): the quantized tokens each of this thread's
    columns sees (by column slot; ``col0`` its first column), those of its step token ``j``'s length (``last``,
    :func:`causal_last`, less ``tail + step - 1 - j``): without windows that length's count, with them its quantized
    count (the rest of that length is read from the ring, as a one-token decode at that length); else None."""
    if not cfg.causal:
        return None
    if cfg.tail:
        last = last - cfg.tail
    limits = []
    for k in range(2 * cfg.nb):
        n = last - (cfg.step - 1 - column_token(slot_column(k, col0), cfg.gqa, cfg.step))
        limits.append(quantized_length(cfg, n) if cfg.windows else n)
    return limits


@cute.jit
def causal_last(cfg: Sm90Config, mSEQ: cute.Tensor, b, n):
    """What :func:`causal_limits` counts back from: the sequence's ``n`` quantized tokens, or with BF16 windows its
    length ``L``."""
    last = n
    if cutlass.const_expr(cfg.windows):
        last = mSEQ[b]
    return last


@cute.jit
def quantized_length(cfg, L):
    """``n_quant`` of a sequence of ``L`` tokens, as :meth:`foscar.KVFormat.split_length` computes it (``cfg`` a
    stage-1 or combine config: its ``sink``, ``recent`` and ``flush``)."""
    rest = L - cutlass.min(L, cfg.sink) - cfg.recent
    return cutlass.max(rest, 0) // cfg.flush * cfg.flush
