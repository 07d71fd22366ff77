"""Folded decode of the FP4 block formats (:mod:`foscar.fp4`): the executable spec of their kernels.

A stored value is ``x = T v s``: ``v`` the E2M1 value of a code, ``s`` the scale of its block (16 or 32
channels of one token), ``T`` the tensor's scale (NVFP4; 1 for MXFP4). Nothing multiplies ``s`` per value
on the K side, and no offset exists, so no offset correction:

============  ===========  ====================================================================
cache         product      fold
============  ===========  ====================================================================
K (blocks     Q K^T (sum   **acc-fold** over block-local partials: per block ``j`` of a token, the
along D)      over D)      partial ``Q[:, j] . v[t, j]`` (E2M1 values are exact operands), scaled by
                           ``s[t, j]`` before it joins the score; ``T_K`` with the softmax scale
V (blocks     P V (sum     the block scale varies with the token (the product's k) and the channel
along D)      over L)      block (its M rows), so neither P nor the accumulator carries it: the
                           operand is ``v s`` (exact in FP16 within its normal range, the plan's
                           candidate 1, ``docs/fp4-plan.md``), ``T_V`` on the output
============  ===========  ====================================================================

Numerics: with ``operand_dtype`` the query is rounded to it (the QK operand), with ``pv_operand_dtype``
the probabilities ``P`` (at most 1, under the running maximum) are; the softmax sums take the unrounded
``P``, as the kernels' FP32 sums do. Tiles of ``tile_tokens`` in ``num_splits`` splits, an online softmax
per split, the BF16 windows one more partial, an LSE merge: as :func:`foscar.fold.folded`.
"""
from __future__ import annotations

import torch

from .cache import QuantKVCache
from .fp4 import decode_scale
from .format import e2m1_decode
from .multitoken import SequenceStep, causal_view
from .splitkv import split_ranges


def _round(x: torch.Tensor, dt: torch.dtype | None, dtype: torch.dtype) -> torch.Tensor:
    return x if dt is None else x.to(dt).to(dtype)


def folded_fp4(q: torch.Tensor, cache: QuantKVCache, G: int, sm_scale: float, *, tile_tokens: int = 64,
               num_splits: int = 1, dtype: torch.dtype = torch.float64, operand_dtype: torch.dtype | None = None,
               pv_operand_dtype: torch.dtype | None = None, q_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`foscar.fold.folded` of an FP4 cache (validated arguments, the cache's space): ``(out, lse)``; ``q_len
    > 1``: ``q``, ``out`` and ``lse`` the rows of steps (:class:`~foscar.multitoken.SequenceStep`)."""
    from .fold import combine_partials
    fmt = cache.fmt
    spec = fmt.fp4_spec
    B, Hkv, D = cache.batch_size, cache.num_kv_heads, cache.head_dim
    T = q_len
    nb = D // spec.block
    t_k, t_v = cache.tensor_scale("k"), cache.tensor_scale("v")
    out = torch.empty(B * T, Hkv * G, D, dtype=dtype, device=q.device)
    lse = torch.empty(B * T, Hkv * G, dtype=dtype, device=q.device)
    view = causal_view(cache, T)  # each step token's cache (one token: the cache's)
    for b in range(B):
        step = SequenceStep(view, b, T, G)
        Qt = _round(step.rows(q[b * T:(b + 1) * T].to(dtype)), operand_dtype, dtype)
        R = Qt.shape[1]  # query rows of a KV head
        n = int(cache.split()[1][b])
        vk, vv = (e2m1_decode(cache.quantized_codes(t, b)).to(dtype) for t in ("k", "v"))  # [H, n, D]
        sk, sv = (decode_scale(cache.quantized_scales(t, b), spec, dtype) for t in ("k", "v"))  # [H, n, nb]
        xv = (vv.reshape(Hkv, n, nb, spec.block) * sv[..., None]).reshape(Hkv, n, D)  # the V operand, v s
        outs, lses = [], []
        for tiles in split_ranges(-(-n // tile_tokens), num_splits):
            m = torch.full((Hkv, R), float("-inf"), dtype=dtype, device=q.device)
            acc = torch.zeros(Hkv, R, D, dtype=dtype, device=q.device)
            l_ = torch.zeros(Hkv, R, dtype=dtype, device=q.device)
            for t in tiles:
                t0, t1 = t * tile_tokens, min(n, (t + 1) * tile_tokens)
                partials = torch.einsum("hgjc,htjc->hgtj", Qt.reshape(Hkv, R, nb, spec.block),
                                        vk[:, t0:t1].reshape(Hkv, t1 - t0, nb, spec.block))  # block-local
                s = (partials * sk[:, None, t0:t1]).sum(-1) * (t_k * sm_scale)  # the acc-fold: [H, G, tile]
                s = step.mask(s, t0)
                m_new = torch.maximum(m, s.amax(-1))
                m_use = torch.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing weighs 0
                alpha = torch.exp(m - m_use)
                p = torch.exp(s - m_use[..., None])
                acc = acc * alpha[..., None] + _round(p, pv_operand_dtype, dtype) @ xv[:, t0:t1]
                l_ = l_ * alpha + p.sum(-1)
                m = m_new
            empty = l_ == 0
            safe = torch.where(empty, torch.ones_like(l_), l_)
            outs.append(torch.where(empty[..., None], torch.zeros_like(acc), acc * t_v / safe[..., None]))
            lses.append(torch.where(empty, torch.full_like(l_, float("-inf")), m + torch.log(safe)))
        o, l_ = step.attend_windows(Qt, sm_scale, dtype)  # each token's BF16 sink + recent
        outs.append(o)
        lses.append(l_)
        o, l_ = combine_partials(outs, lses)
        out[b * T:(b + 1) * T], lse[b * T:(b + 1) * T] = step.unrows(o), step.unrows(l_)
    return out, lse
