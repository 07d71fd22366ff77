"""The paper's synthetic stress input (Sec. 6.2, Fig. 11).

"Our synthetic input amplifies eight K channels, ramps K's per-token scale along the sequence, and
rescales K so that pre-softmax attention logits have unit standard deviation." :func:`stress_inputs`
builds exactly that from i.i.d. standard normals:

1. ``q``, ``k``, ``v`` ~ N(0, 1), drawn (in float64, on the CPU) from a ``torch.Generator`` seeded
   with ``seed``, so the input depends on the seed alone (not on the global RNG, device or dtype);
2. ``amplified_channels`` channels of K, picked at random (the same channels in every batch entry,
   head and token, like the outlier channels of a real model's keys), are multiplied by
   ``amplification`` (default 2);
3. token ``t`` of K is multiplied by ``ramp[0] + (ramp[1] - ramp[0]) * t / (L - 1)``: a linear ramp
   of the per-token scale along the sequence (default 0.5 to 2.0, a 4x spread);
4. K is multiplied by one scalar so that the logits ``q . k / sqrt(D)`` (GQA: query head ``h``
   reads KV head ``h // (Hq / Hkv)``) over every batch entry, query head and token have standard
   deviation 1 (population std, ``correction=0``), computed in float64 on the values returned
   (after ``q`` is rounded to ``dtype``). With ``dtype=torch.float64`` the std is 1 to rounding;
   with float32 to about 1e-7; with 16-bit dtypes only to the rounding of ``k``.

V is left standard normal.

The paper does not give its amplification. With 2 (and the 0.5-2 ramp), at 4K tokens, 32/8 heads,
D = 128, g = 128, token-wise K and V (``foscar demo``, seed 0), the output error against exact
attention is 0.17 for INT4 min-max and 0.56 for INT2 with the ``"mse"`` clipped quantizer, inside the
paper's Fig. 11 ranges (0.16-0.22, 0.52-0.61), and 1.6 for INT2 min-max (paper: 0.86-1.03; no setting
tried matched all three: amplification 10 gives 0.52 / 1.07 / 7.0). ``docs/results.md`` has the
commands.
"""
from __future__ import annotations

import math

import torch

from ._checks import check_int
from .errors import InvalidArgumentError

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _check_positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(name, "a finite number > 0", repr(value))
    return float(value)


def stress_inputs(batch: int, num_qo_heads: int, num_kv_heads: int, seq_len: int, head_dim: int, *, seed: int = 0,
                  amplified_channels: int = 8, amplification: float = 2.0, ramp: tuple[float, float] = (0.5, 2.0),
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The synthetic decode input of paper Sec. 6.2: ``(q [B, Hq, D], k [B, Hkv, L, D], v [B, Hkv, L, D])``.

    See the module docstring for the construction. ``num_qo_heads`` must be a positive multiple of
    ``num_kv_heads``; ``seq_len`` at least 2 (so that the logits have a spread to normalise);
    ``amplified_channels`` in ``[0, head_dim]``; ``amplification`` and both ``ramp`` ends finite and
    ``> 0``. Tensors are returned in ``dtype`` on ``device``; the same ``seed`` gives the same values
    on every device.
    """
    check_int("batch", batch, minimum=1)
    check_int("num_kv_heads", num_kv_heads, minimum=1)
    check_int("num_qo_heads", num_qo_heads)
    if num_qo_heads < 1 or num_qo_heads % num_kv_heads:
        raise InvalidArgumentError("num_qo_heads", f"a positive multiple of num_kv_heads={num_kv_heads}", num_qo_heads)
    check_int("seq_len", seq_len, minimum=2)
    check_int("head_dim", head_dim, minimum=1)
    check_int("seed", seed)
    check_int("amplified_channels", amplified_channels, minimum=0)
    if amplified_channels > head_dim:
        raise InvalidArgumentError("amplified_channels", f"at most head_dim={head_dim}", amplified_channels)
    amplification = _check_positive_float("amplification", amplification)
    if not isinstance(ramp, (tuple, list)) or len(ramp) != 2:
        raise InvalidArgumentError("ramp", "a pair (start, end) of per-token scales", repr(ramp))
    r0, r1 = (_check_positive_float("ramp", r) for r in ramp)
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError("dtype", "torch.float64, float32, bfloat16 or float16", dtype)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError("device", "a torch.device or device string", repr(device)) from e

    gen = torch.Generator(device="cpu").manual_seed(seed)
    f64 = dict(dtype=torch.float64, generator=gen)
    B, Hq, Hkv, L, D = batch, num_qo_heads, num_kv_heads, seq_len, head_dim
    q = torch.randn(B, Hq, D, **f64).to(dtype).double()  # rounded to dtype: the std is that of what we return
    k = torch.randn(B, Hkv, L, D, **f64)
    v = torch.randn(B, Hkv, L, D, **f64)
    channels = torch.randperm(D, generator=gen)[:amplified_channels]
    k[..., channels] *= amplification
    k *= torch.linspace(r0, r1, L, dtype=torch.float64)[:, None]

    # std of s[b, h, t] = q[b, h] . k[b, h // G, t] / sqrt(D), without materialising s:
    # sum(s) from the token sum of K, sum(s^2) from the Gram matrix K^T K of each (batch, KV head).
    qg = q.reshape(B, Hkv, Hq // Hkv, D)
    n = B * Hq * L
    s_sum = torch.einsum("bhgd,bhd->", qg, k.sum(2)) / math.sqrt(D)
    s_sq = torch.einsum("bhgd,bhde,bhge->", qg, k.transpose(2, 3) @ k, qg) / D
    std = math.sqrt(max(float(s_sq) / n - (float(s_sum) / n) ** 2, 0.0))
    if std == 0.0:  # only for degenerate (all-zero) draws; measure zero
        raise InvalidArgumentError("seed", "a draw whose attention logits are not all equal", seed)
    k /= std
    return q.to(dtype=dtype, device=device), k.to(dtype=dtype, device=device), v.to(dtype=dtype, device=device)
