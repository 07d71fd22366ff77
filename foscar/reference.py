"""The ground truth: dequantize every value, then attend in float64 (or float32).

``decode_exact`` shares nothing with the folded path but the cache reader (:meth:`QuantKVCache.dequantize`,
whose layout is tested on its own): it is the oracle every kernel and ``decode_folded`` are held to.
"""
from __future__ import annotations

import math

import torch

from .cache import QuantKVCache
from .errors import InvalidArgumentError
from ._checks import check_decode_inputs

def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, *,
           operand_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q [H, G, D]`` over ``k, v [H, n, D]``: ``(out [H,G,D], lse [H,G])``.

    Computed in the dtype of ``q`` (``k, v`` are cast to it). ``operand_dtype=torch.bfloat16`` gives
    BF16 attention as FlashAttention / SDPA run it: ``q, k, v`` and the unnormalised ``P`` rounded to
    BF16, float32 math (the baseline a kernel's error is held to). ``lse`` is the natural-log sum of
    exponentials of the scaled scores; with ``n = 0`` the output is zero and ``lse = -inf`` (the
    convention every split and the combine rely on).
    """
    H, G, _ = q.shape
    if operand_dtype is not None:
        q, k, v = (x.to(operand_dtype).float() for x in (q, k, v))
    k, v = k.to(q.dtype), v.to(q.dtype)
    if k.shape[1] == 0:
        return q.new_zeros(H, G, v.shape[-1]), q.new_full((H, G), -math.inf)
    s = torch.einsum("hgd,hnd->hgn", q, k) * sm_scale
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(-1)
    if operand_dtype is not None:
        p = p.to(operand_dtype).float()
    return torch.einsum("hgn,hnd->hgd", p, v) / l[..., None], m[..., 0] + torch.log(l)


def decode_exact(q: torch.Tensor, cache: QuantKVCache, *, sm_scale: float | None = None,
                 dtype: torch.dtype = torch.float64, return_lse: bool = False):
    """Attention of ``q [B, Hq, D]`` over the dequantized cache, in ``dtype`` (float64 by default).

    GQA: query head ``h`` reads KV head ``h // (Hq / Hkv)``. Returns ``out [B, Hq, D]`` in ``dtype``
    (and ``lse [B, Hq]``, natural log, when ``return_lse``). A sequence of length 0 gives zeros and
    ``lse = -inf``. ``q [B, q_len, Hq, D]``: a step of ``q_len`` tokens already in the cache, token ``j``
    attending to the first ``L - q_len + 1 + j`` tokens as the cache held them at that length (a one-token decode
    of the cache cut there: :func:`foscar.multitoken.causal_view`; :mod:`foscar.multitoken`);
    ``out [B, q_len, Hq, D]``, ``lse [B, q_len, Hq]``.
    """
    step = isinstance(q, torch.Tensor) and q.dim() == 4
    if step:
        from .multitoken import check_step
        check_step(q, cache, read_lengths=True)
    G, sm_scale = check_decode_inputs(q[:, 0] if step else q, cache, sm_scale, dtype)
    if dtype is None:
        raise InvalidArgumentError("dtype", "torch.float64 or torch.float32", None)
    B, Hkv, D = cache.batch_size, cache.num_kv_heads, cache.head_dim
    T = q.shape[1] if step else 1
    q4 = q if step else q.unsqueeze(1)
    if step:  # row b T + j: sequence b at token j's length
        from .multitoken import causal_view
        cache = causal_view(cache, T)
    lens = cache.seq_lens.long().cpu()
    k, v = cache.dequantize(dtype)
    out = torch.empty(B, T, Hkv * G, D, dtype=dtype, device=q.device)
    lse = torch.empty(B, T, Hkv * G, dtype=dtype, device=q.device)
    for b in range(B):
        for j in range(T):
            r = b * T + j
            L = int(lens[r])
            o, s = attend(q4[b, j].to(dtype).reshape(Hkv, G, D), k[r, :, :L], v[r, :, :L], sm_scale)
            out[b, j], lse[b, j] = o.reshape(Hkv * G, D), s.reshape(Hkv * G)
    if not step:
        out, lse = out[:, 0], lse[:, 0]
    return (out, lse) if return_lse else out
