"""Query-weighted rounding of the keys' codes: the weights a cache keeps, and where they come from.

A key ``k`` quantized to ``k^`` moves every score by ``q (k - k^)``. Over the queries that will read it, the
scores' squared error is ``e W e^T`` with ``e = k - k^`` and ``W = sum_q q^T q`` (the queries' second moments,
``[D, D]`` per KV head, the query heads of its GQA group together). Round to nearest minimises ``e e^T``;
:func:`foscar.quantize.weighted_codes` chooses each key row's codes for ``e W e^T`` instead (GPTQ's sequential
rounding with ``W`` as its Hessian), on the same grid (the groups' ``s'``, ``z'`` are the quantizer's): the
format, the kernels and the decode are unchanged, only which codes a write stores.

A cache keeps ``k_weights [B, Hkv, D, D]`` (float32, in the stored space: a rotated cache's ``R^T W R``), set
when it is made (``QuantKVCache.empty(..., key_weights=W)``, :func:`foscar.quantize_kv`) or from a prompt's
queries before its keys are written (:func:`query_moments`; the transformers integration's
``key_weights="prefill"``). The PyTorch write path applies them; the Triton write kernels do not (an append
to such a cache takes the PyTorch path). They shape only the codes a write chooses: an exported cache does not
carry them, and one rebuilt from its export rounds its later keys to nearest.
"""
from __future__ import annotations

import torch

from ._checks import check_finite, check_int, check_tensor
from .cache import INPUT_DTYPES
from .errors import InvalidArgumentError


def query_moments(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``W [B, Hkv, D, D]`` (float64): each KV head's ``sum q^T q`` over the queries ``q [B, Hq, T, D]`` of its
    query heads (GQA: ``Hq / Hkv`` consecutive heads a KV head) and tokens."""
    check_tensor("q", q, ndim=4, dtypes=INPUT_DTYPES)
    B, Hq, T, D = q.shape
    check_int("num_kv_heads", num_kv_heads, minimum=1)
    if Hq % num_kv_heads:
        raise InvalidArgumentError("num_kv_heads", f"a divisor of the {Hq} query heads", num_kv_heads)
    check_finite("q", q)
    g = q.double().reshape(B, num_kv_heads, Hq // num_kv_heads * T, D)
    return g.transpose(-1, -2) @ g


def check_key_weights(weights, batch: int, num_kv_heads: int, head_dim: int, device) -> torch.Tensor | None:
    """``weights`` (``[batch, num_kv_heads, head_dim, head_dim]``) as given, or ``None``; refused by name unless
    finite and symmetric positive semi-definite (within float32 rounding)."""
    if weights is None:
        return None
    shape = (batch, num_kv_heads, head_dim, head_dim)
    check_tensor("key_weights", weights, shape=shape, dtypes=INPUT_DTYPES, device=device)
    check_finite("key_weights", weights)
    w = weights.double()
    scale = w.diagonal(dim1=-2, dim2=-1).abs().amax().clamp_min(1e-300)
    if not torch.allclose(w, w.transpose(-1, -2), rtol=0.0, atol=1e-6 * float(scale)):
        raise InvalidArgumentError("key_weights", "symmetric matrices (each KV head's sum of q^T q)", "asymmetric")
    if w.numel() and float(torch.linalg.eigvalsh(w).amin()) < -1e-6 * float(scale):
        raise InvalidArgumentError("key_weights", "positive semi-definite matrices (each KV head's sum of q^T q)",
                                   "a negative eigenvalue")
    return weights


def stored_weights(fmt, weights: torch.Tensor) -> torch.Tensor:
    """The weights in the cache's stored space: ``R^T W R`` for a rotated format (its keys and queries are
    ``x R``), else ``W``; float32."""
    if fmt.rotation is None:
        return weights.to(torch.float32)
    from .rotation import rotation_matrix
    r = rotation_matrix(fmt, torch.float64, weights.device)
    return (r.T @ weights.double() @ r).to(torch.float32)
