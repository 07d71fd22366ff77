"""Key centring (BitDecoding-FP4, Sec. 3): a per-(sequence, KV head) channel mean ``mu`` of K is subtracted
before quantization and stored with the cache (``QuantKVCache.k_mean``, float32 ``[B, Hkv, D]``).

Softmax is shift-invariant along a query's scores, and ``q (k - mu) = q k - q mu`` shifts all of one
query's scores by the same ``q mu``: the attention output is unchanged, and the returned LSE is corrected
by ``sm_scale q mu`` (:func:`lse_correction`) so that it still merges with other attention partials.
Centring is applied before the rotation (:attr:`foscar.KVFormat.rotation`): a stored key is
``(k - mu) R``; :meth:`QuantKVCache.dequantize` adds ``mu`` back.

``key_mean`` (:func:`foscar.quantize_kv`, :meth:`QuantKVCache.empty`): ``None`` (no centring),
``"prefill"`` (the mean of each sequence's keys in the first write: all of them for ``quantize_kv``, the
first non-empty append's for an empty cache), or a tensor ``[B, Hkv, D]`` (a calibrated mean).
"""
from __future__ import annotations

import torch

from ._checks import check_tensor
from .errors import InvalidArgumentError

KEY_MEANS = (None, "prefill")


def check_key_mean(key_mean, batch: int, heads: int, head_dim: int, device) -> torch.Tensor | str | None:
    """``key_mean`` as given (``None``, ``"prefill"``) or as a float32 ``[B, Hkv, D]`` tensor on ``device``;
    refused by name otherwise (a mean must be finite)."""
    if key_mean is None or (isinstance(key_mean, str) and key_mean == "prefill"):
        return key_mean
    if isinstance(key_mean, str):
        raise InvalidArgumentError("key_mean", "None, 'prefill' or a [B, Hkv, D] tensor", repr(key_mean))
    check_tensor("key_mean", key_mean, shape=(batch, heads, head_dim),
                 dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16), device=device)
    if not bool(torch.isfinite(key_mean).all()):
        raise InvalidArgumentError("key_mean", "finite values", "a non-finite value")
    return key_mean.to(torch.float32)


def sequence_means(k: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The channel mean of each sequence's first ``lengths[b]`` keys of ``k [B, Hkv, T, D]``, float32
    ``[B, Hkv, D]`` (formed in float64; 0 for an empty sequence)."""
    B, H, T, D = k.shape
    n = lengths.to(device=k.device, dtype=torch.long).clamp(min=0, max=T)
    valid = (torch.arange(T, device=k.device)[None, :] < n[:, None]).double()  # [B, T]
    total = torch.einsum("bhtd,bt->bhd", k.double(), valid)
    return (total / n.clamp(min=1).double()[:, None, None]).to(torch.float32)


def centre(k: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
    """``k [B, Hkv, T, D] - mean[:, :, None]`` in float64, rounded once to ``k``'s dtype."""
    if mean is None:
        return k
    return (k.double() - mean.double()[:, :, None, :]).to(k.dtype)


def lse_correction(q: torch.Tensor, mean: torch.Tensor, sm_scale: float,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``sm_scale q mu`` per query head (``[B, Hq]`` in ``dtype``): what centring takes off every score of
    a query, and so off its LSE (natural log). Query head ``h`` reads KV head ``h // (Hq / Hkv)``."""
    B, Hq, D = q.shape
    G = Hq // mean.shape[1]
    mu = mean.to(q.device, dtype).repeat_interleave(G, dim=1)  # [B, Hq, D]
    return sm_scale * (q.to(dtype) * mu).sum(-1)


def add_lse_correction(lse: torch.Tensor, q: torch.Tensor, mean: torch.Tensor, sm_scale: float) -> None:
    """``lse += sm_scale q mu`` in place (``lse [B, Hq]`` float32, :func:`lse_correction`) in four kernels,
    elementwise (no matmul: TF32 would round the product)."""
    B, Hq, D = q.shape
    H = mean.shape[1]
    if not lse.is_contiguous():
        lse.add_(lse_correction(q, mean, sm_scale, lse.dtype))
        return
    prod = (q.reshape(B, H, Hq // H, D).to(lse.dtype) * mean.to(q.device, lse.dtype).view(B, H, 1, D)).sum(-1)
    lse.view(B, H, Hq // H).add_(prod, alpha=sm_scale)


def keys_to_store(cache, k_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(k_new centred, the mean to keep)`` for an append: the cache's mean, or with a mean pending from
    the first append (``key_mean="prefill"`` on an empty cache) each sequence's mean over these tokens
    (kept by :func:`keep_mean` once the append succeeded). A tensor the append will refuse is returned
    as it is."""
    if not (isinstance(k_new, torch.Tensor) and k_new.is_floating_point() and k_new.dim() == 4
            and k_new.shape[1] == cache.num_kv_heads and k_new.shape[3] == cache.head_dim
            and k_new.shape[0] == cache.batch_size):
        return k_new, None
    if cache.k_mean_pending:
        if k_new.shape[2] == 0:
            return k_new, None
        lengths = torch.full((k_new.shape[0],), k_new.shape[2], dtype=torch.long)
        mean = sequence_means(k_new, lengths)
        return centre(k_new, mean), mean
    return centre(k_new, cache.k_mean), None


def keep_mean(cache, mean: torch.Tensor | None) -> None:
    """After a successful append, the mean :func:`keys_to_store` took from it (if any) becomes the cache's."""
    if mean is not None:
        cache.k_mean = mean
        cache.k_mean_pending = False
