"""What the timed kernels read, and the float64 references their outputs are held to.

- :class:`Bf16Inputs`: a random BF16 paged KV cache (FlashInfer's NHD pages) with its block table;
- :class:`QuantInputs`: a query and a packed foscar cache (:func:`make_random_cache`);
- :class:`SliceRef`: float64 attention of one (sequence, KV head) slice of a timed shape, and the error
  BF16 attention makes on it, the scale a kernel's error is judged on (:mod:`foscar.bench.measure`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import QuantKVCache
from ..reference import attend
from .common import one_head_cache, random_cache, rel_l2
from .grid import HKV, PAGE, Case


@dataclass
class Bf16Inputs:
    q: torch.Tensor  # [B, Hq, D] bf16
    k_cache: torch.Tensor  # [pages, page, Hkv, D] bf16 (FlashInfer NHD)
    v_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [B, pages per sequence]
    seq_lens: torch.Tensor  # int32 [B]


@dataclass
class QuantInputs:
    q: torch.Tensor  # [B, Hq, D] bf16
    cache: QuantKVCache


def make_bf16_inputs(q: torch.Tensor, block_table: torch.Tensor, seq_len: int, kv_heads: int = HKV) -> Bf16Inputs:
    B, pages = block_table.shape
    shape = (B * pages, PAGE, kv_heads, q.shape[2])
    k = torch.randn(shape, dtype=torch.bfloat16, device=q.device)
    v = torch.randn(shape, dtype=torch.bfloat16, device=q.device)
    return Bf16Inputs(q, k, v, block_table, torch.full((B,), seq_len, dtype=torch.int32, device=q.device))


def make_random_cache(case: Case, block_table: torch.Tensor) -> QuantKVCache:
    """A full foscar cache of the case's shape and KV heads, random packed codes and ``(s', z')``
    (:func:`foscar.bench.random_cache`)."""
    return random_cache(case.fmt(), block_table, case.seq_len, kv_heads=case.kv_heads, page=PAGE)


@dataclass
class SliceRef:
    """Float64 attention of query heads ``h*gqa..(h+1)*gqa`` of sequence ``b`` (one KV head), and the
    error BF16 attention makes on it: the scale a kernel's error is judged on."""

    b: int
    h: int
    gqa: int
    exact: torch.Tensor  # [gqa, D] float64 ([q_len, gqa, D] for a step)
    bf16_err: float


def slice_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int, h: int, gqa: int) -> SliceRef:
    """``k, v [n, D]``: the tokens of sequence ``b``, KV head ``h`` (any order, any float dtype). A step ``q [B,
    q_len, Hq, D]``: its tokens appended last, token ``j`` sees the first ``n - (q_len - 1 - j)`` (the causal
    mask, :mod:`foscar.multitoken`); ``exact [q_len, gqa, D]``."""
    sm_scale = q.shape[-1] ** -0.5
    steps = q[b][None] if q.dim() == 3 else q[b]
    T = steps.shape[0]
    exact, bf16 = [], []
    for j in range(T):
        rows = steps[j, h * gqa: (h + 1) * gqa][None]
        kj, vj = k[:k.shape[0] - (T - 1 - j)][None], v[:v.shape[0] - (T - 1 - j)][None]
        exact.append(attend(rows.double(), kj.double(), vj.double(), sm_scale)[0][0])
        bf16.append(attend(rows.float(), kj, vj, sm_scale, operand_dtype=torch.bfloat16)[0][0])
    exact, bf16 = torch.stack(exact), torch.stack(bf16)
    if q.dim() == 3:
        exact, bf16 = exact[0], bf16[0]
    return SliceRef(b, h, gqa, exact, rel_l2(bf16, exact))


def bf16_slice_reference(inp: Bf16Inputs) -> SliceRef:
    """The last sequence and KV head (offset bugs show there) of the BF16 paged cache."""
    kv_heads = inp.k_cache.shape[2]
    b, h = inp.q.shape[0] - 1, kv_heads - 1
    pages = inp.block_table[b].long()
    k, v = (c[pages, :, h].reshape(-1, inp.q.shape[2]) for c in (inp.k_cache, inp.v_cache))
    return slice_reference(inp.q, k, v, b, h, inp.q.shape[1] // kv_heads)


def quant_slice_reference(inp: QuantInputs) -> SliceRef:
    """The last sequence and KV head of the packed cache, dequantized in float64."""
    kv_heads = inp.cache.num_kv_heads
    b, h = inp.q.shape[0] - 1, kv_heads - 1
    k, v = one_head_cache(inp.cache, b, h).dequantize(torch.float64)
    n = int(inp.cache.seq_lens[b])
    return slice_reference(inp.q, k[0, 0, :n], v[0, 0, :n], b, h, inp.q.shape[-2] // kv_heads)
