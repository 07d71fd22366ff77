"""The register A fragment of Hopper ``wgmma.m64nNk16`` (RS) and where each thread of the CuTe kernel
finds its codes in the packed cache.

Two sides of one contract:

- :func:`rs_fragment_ownership` asks CuTe DSL (at trace time; no GPU) which ``(row, k)`` element of
  an ``M x K`` BF16 A operand each thread holds in each half of each 32-bit register of its fragment,
  for the one-warpgroup ``(64, N)`` tiled MMA the kernel uses.
- :func:`tile_register_source` says, from :mod:`foscar.format` alone, which word of a 64-token tile
  of packed codes, and which bit, feeds each of those registers: the indexing the kernel compiles in.
  A register is then ``((word >> shift) & mask) | pattern``, one shift and one ``lop3``.

``tests/test_cute_fragment.py`` checks that the two agree for K (``S^T = K Q^T``: rows = tokens,
k = channels) and V (``O^T = V^T P^T``: rows = channels, k = tokens), at every bit width and head dim:
the cache layout of ``docs/layout.md`` is the fragment CuTe builds, so the Triton and CuTe kernels
read one cache.
"""
from __future__ import annotations

import functools
import warnings

import torch

from ..format import K_BLOCK_TOKENS, v_block_tokens, words_per_block

TILE_TOKENS = 64  #: tokens per KV tile: the wgmma M of S^T = K Q^T
THREADS = 128  #: one warpgroup


def _tiled_mma(n: int):
    import cutlass
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
    return sm90.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K,
                                       cutlass.Float32, (1, 1, 1), (64, n), warpgroup.OperandSource.RMEM)


@functools.lru_cache(maxsize=None)
def rs_fragment_ownership(m: int, k: int, n: int = 8) -> torch.Tensor:
    """``own[t, r, h] = (row, k)``: the element of the ``m x k`` A operand held by thread ``t`` in half
    ``h`` (0 = low 16 bits) of 32-bit register ``r`` of its fragment (the Int32 view of
    ``make_fragment_A``), for the ``(64, n)`` RS tiled MMA of one warpgroup. Traced by CuTe DSL on the
    host (seconds; cached)."""
    import cutlass
    import cutlass.cute as cute

    regs = m * k // 2 // THREADS
    own = torch.full((THREADS, regs, 2, 2), -1, dtype=torch.int64)

    @cute.jit
    def probe():
        tiled_mma = _tiled_mma(n)
        ident = cute.make_identity_tensor((m, k))
        for t in cutlass.range_constexpr(THREADS):
            thr = tiled_mma.get_slice(t)
            coords = thr.partition_A(ident)
            frag = thr.make_fragment_A(thr.partition_shape_A((m, k)))
            for i in cutlass.range_constexpr(cute.size(coords)):
                row, col = coords[i]
                off = cute.crd2idx(i, frag.layout)  # BF16 element offset in the register fragment
                own[t, off // 2, off % 2, 0] = row
                own[t, off // 2, off % 2, 1] = col

    with warnings.catch_warnings():  # the probe's long static loops are intended (host-side tracing only)
        warnings.simplefilter("ignore")
        cute.compile(probe)
    return own


@functools.lru_cache(maxsize=None)
def rs_accumulator_ownership(m: int, n: int = 8) -> torch.Tensor:
    """``own[t, e] = (row, col)``: the element of the ``m x n`` accumulator (C) held by thread ``t`` in its
    ``e``-th fp32 register, for the ``(64, n)`` tiled MMA of one warpgroup (traced on the host)."""
    import cutlass
    import cutlass.cute as cute

    own = torch.full((THREADS, m * n // THREADS, 2), -1, dtype=torch.int64)

    @cute.jit
    def probe():
        tiled_mma = _tiled_mma(n)
        ident = cute.make_identity_tensor((m, n))
        for t in cutlass.range_constexpr(THREADS):
            coords = tiled_mma.get_slice(t).partition_C(ident)
            for e in cutlass.range_constexpr(cute.size(coords)):
                row, col = coords[e]
                own[t, e, 0] = row
                own[t, e, 1] = col

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cute.compile(probe)
    return own


def tile_register_source(bits: int, head_dim: int, tensor: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(word, shift)``, each ``[128, regs, 2]``: the word of a 64-token tile's packed codes (index into
    the tile's ``64 * head_dim * bits / 32`` words, pack blocks in token order) and the bit holding the
    code of half ``h`` of register ``r`` of thread ``t``, for the fragment of :func:`rs_fragment_ownership`
    (K: ``m = 64`` tokens, ``k = head_dim``; V: ``m = head_dim``, ``k = 64`` tokens).

    K: warp ``w`` reads pack block ``w`` (16 tokens); lane ``l`` its ``head_dim*bits/64`` contiguous words,
    register ``r`` in word ``r // (16/bits)``. V: an m64 half ``mh`` of the channels and a k16 block
    ``kb`` of the tokens; pack block ``kb // (4/bits)`` (``64/bits`` tokens), thread ``t``'s word ``mh``
    of it, registers ``4 * (kb % (4/bits)) + j``.
    """
    per_word = 16 // bits
    t = torch.arange(THREADS)[:, None, None]
    h = torch.arange(2)[None, None, :]
    if tensor == "k":
        regs = TILE_TOKENS * head_dim // 2 // THREADS
        r = torch.arange(regs)[None, :, None]
        wpl = head_dim * bits // 64  # words per lane per K block
        block = t // 32
        word = block * words_per_block(bits, head_dim, "k") + (t % 32) * wpl + r // per_word
        shift = bits * (r % per_word) + 16 * h
    elif tensor == "v":
        kblocks = TILE_TOKENS // 16
        mhalves = head_dim // 64
        regs = 4 * mhalves * kblocks
        r = torch.arange(regs)[None, :, None]
        # fragment order of make_fragment_A((head_dim, 64)): ((2,2,2), m-tiles, k-blocks) -> r = 4*(mh + mhalves*kb) + j
        j, mk = r % 4, r // 4
        mh, kb = mk % mhalves, mk // mhalves
        nib = 4 // bits  # k16 blocks per V pack block
        block = kb // nib
        word = block * words_per_block(bits, head_dim, "v") + t * mhalves + mh
        shift = bits * (4 * (kb % nib) + j) + 16 * h
    else:
        raise ValueError(f"tensor {tensor!r}: expected 'k' or 'v'")
    return word.expand(THREADS, regs, 2).contiguous(), shift.expand(THREADS, regs, 2).contiguous()


def tile_words(bits: int, head_dim: int, tensor: str) -> int:
    """Words of one 64-token tile of packed codes."""
    block = K_BLOCK_TOKENS if tensor == "k" else v_block_tokens(bits)
    return TILE_TOKENS // block * words_per_block(bits, head_dim, tensor)
