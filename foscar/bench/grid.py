"""The decode benchmark's problem and grids: the fixed problem constants, the timed cases, the shape
grids, the command-line shape parsers, and the bytes and device memory a shape needs (all pure).

The head counts are the paper's 32 query heads over 8 KV heads and the head dim is 128 by default; a run
with other heads (``--heads``) or another head dim (``--head-dim``) carries them in its :class:`Case`
objects and passes them to the functions here. The (s, z) groups are :data:`GROUP` channels (token-wise)
or tokens (channel-wise), at most the head dim: :func:`group_for`.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from ..format import KVFormat
from .common import parse_tokens

HQ, HKV, HEAD_DIM, GROUP, PAGE = 32, 8, 128, 128, 64  # the default heads, head dim, group and page size
GQA = HQ // HKV
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)  # that of the default head dim; sm_scale(D) for any
KI = 1024
MIB, GIB = 2 ** 20, 2 ** 30

TOKEN, CHANNEL = "token", "channel"
TOKEN_AXES = ((TOKEN, TOKEN),)
AXIS_COMBOS = ((TOKEN, TOKEN), (TOKEN, CHANNEL), (CHANNEL, TOKEN), (CHANNEL, CHANNEL))
PAPER_SHAPES = tuple([(b, n * KI) for b in (1, 8) for n in (8, 32, 128, 512)]
                     + [(64, n * KI) for n in (8, 16, 32, 64, 128)])
AXES_SHAPES = tuple((b, n * KI) for b in (1, 8) for n in (32, 128))
QUICK_SHAPES = ((1, 8 * KI), (4, 16 * KI))
GRIDS = {"paper": (PAPER_SHAPES, TOKEN_AXES), "axes": (AXES_SHAPES, AXIS_COMBOS), "quick": (QUICK_SHAPES, TOKEN_AXES)}
#: Every length is a multiple of this: whole pages, and whole channel-wise groups (no BF16 tail).
LENGTH_QUANTUM = max(PAGE, GROUP)

BF16_BYTES_PER_TOKEN = 2 * HEAD_DIM * 2  # K and V, per KV head, at the default head dim; bf16_bytes_per_token(D)
FLUSH_BYTES = 512 * MIB
FI_WORKSPACE_BYTES = 256 * MIB


def group_for(head_dim: int = HEAD_DIM) -> int:
    """The grid's group size at head dim ``head_dim``: :data:`GROUP`, or the head dim where that is smaller
    (a token-wise group must divide it): 128 for D = 128 and 256, 64 for D = 64."""
    return min(GROUP, head_dim)


def sm_scale(head_dim: int = HEAD_DIM) -> float:
    """The softmax scale ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)


def bf16_bytes_per_token(head_dim: int = HEAD_DIM) -> int:
    """Bytes of a BF16 cache per token and KV head, K and V together: ``2 * head_dim * 2``."""
    return 2 * head_dim * 2


@dataclass(frozen=True)
class Case:
    """One timed configuration of the quantized kernels (the BF16 kernels depend on B, L, the heads and the
    head dim only)."""

    batch: int
    seq_len: int
    bits: int
    k_axis: str = TOKEN
    v_axis: str = TOKEN
    q_heads: int = HQ
    kv_heads: int = HKV
    head_dim: int = HEAD_DIM

    @property
    def shape(self) -> tuple[int, int]:
        return self.batch, self.seq_len

    @property
    def group_size(self) -> int:
        return group_for(self.head_dim)

    def fmt(self) -> KVFormat:
        return KVFormat(self.bits, self.head_dim, self.group_size, self.k_axis, self.v_axis)


def parse_length(text: str) -> int:
    """``"128K"`` -> 131072, ``"1M"`` -> 1048576, ``"4096"`` -> 4096."""
    value = parse_tokens(text)
    if value <= 0 or value % LENGTH_QUANTUM:
        raise argparse.ArgumentTypeError(f"length {text!r}: expected a positive multiple of {LENGTH_QUANTUM}")
    return value


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"1:8K,64:128K"`` -> ((1, 8192), (64, 131072))."""
    shapes = []
    for item in text.split(","):
        b, sep, n = item.partition(":")
        if not sep or not b.strip().isdigit() or int(b) <= 0:
            raise argparse.ArgumentTypeError(f"shape {item!r}: expected B:L, e.g. 8:128K")
        shapes.append((int(b), parse_length(n)))
    return tuple(shapes)


def build_grid(grid: str, bits: tuple[int, ...], shapes: tuple[tuple[int, int], ...] | None = None,
               heads: tuple[int, int] = (HQ, HKV), head_dim: int = HEAD_DIM) -> list[Case]:
    """The cases of a grid, shape-major (so each shape's BF16 data is built once), with ``heads``
    (query, KV) and ``head_dim``."""
    grid_shapes, axes = GRIDS[grid]
    return [Case(b, n, nb, ka, va, *heads, head_dim)
            for b, n in (shapes or grid_shapes) for nb in bits for ka, va in axes]


def group_by_shape(cases: list[Case]) -> dict[tuple[int, int], list[Case]]:
    groups: dict[tuple[int, int], list[Case]] = {}
    for c in cases:
        groups.setdefault(c.shape, []).append(c)
    return groups


def fmt_len(n: int) -> str:
    return f"{n // KI}K" if n % KI == 0 else str(n)


def kv_bytes_per_token(bits: int, head_dim: int = HEAD_DIM) -> float:
    """HBM bytes per token and KV head, K and V together: ``4 * head_dim`` for BF16 (bits=16; 512 at
    D = 128), else foscar's format with the group of :func:`group_for`."""
    if bits == 16:
        return float(bf16_bytes_per_token(head_dim))
    return KVFormat(bits, head_dim, group_for(head_dim)).bytes_per_token()  # the same for every axis combination


def bytes_read(batch: int, seq_len: int, bits: int, q_heads: int = HQ, kv_heads: int = HKV,
               head_dim: int = HEAD_DIM) -> int:
    """Bytes a decode must move: the KV cache once, plus q read and out written (BF16)."""
    q_and_out = 2 * batch * q_heads * head_dim * 2
    return int(batch * seq_len * kv_heads * kv_bytes_per_token(bits, head_dim)) + q_and_out


def peak_bytes(batch: int, seq_len: int, bits: tuple[int, ...], contiguous_copy: bool = False,
               kv_heads: int = HKV, flush_bytes: int = FLUSH_BYTES, head_dim: int = HEAD_DIM) -> int:
    """Device memory a shape needs at its peak (BF16 stage or quantized stage, never both at once, and the
    L2 flush buffer); ``contiguous_copy``: a kernel of the BF16 stage also holds an unpaged copy of the
    cache (FA4)."""
    tokens = batch * seq_len * kv_heads
    one_head = seq_len * head_dim  # slice references: float64 copies of one (sequence, head)
    bf16_stage = (tokens * bf16_bytes_per_token(head_dim) * (2 if contiguous_copy else 1) + 2 * FI_WORKSPACE_BYTES
                  + 32 * one_head)
    params_tmp = 48 * tokens * (head_dim // group_for(head_dim))  # random (s', z') drawn in FP32, folded in FP64
    quant_stage = max(int(tokens * kv_bytes_per_token(b, head_dim)) for b in bits) + params_tmp + 96 * one_head
    return max(bf16_stage, quant_stage) + flush_bytes


def plan_shapes(shapes: list[tuple[int, int]], bits: tuple[int, ...], budget_bytes: float,
                contiguous_copy: bool = False, kv_heads: int = HKV, flush_bytes: int = FLUSH_BYTES,
                head_dim: int = HEAD_DIM):
    """Split shapes into those that fit the memory budget and skipped ones (with the reason)."""
    run, skipped = [], []
    for b, n in shapes:
        need = peak_bytes(b, n, bits, contiguous_copy, kv_heads, flush_bytes, head_dim)
        if need > budget_bytes:
            reason = f"needs {need / 1e9:.1f} GB > budget {budget_bytes / 1e9:.1f} GB (--max-gb)"
            skipped.append({"B": b, "L": n, "reason": reason})
        else:
            run.append((b, n))
    return run, skipped
