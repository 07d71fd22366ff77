"""Where each thread of the CuTe kernels finds the codes of its wgmma A registers, and the register
fragment CuTe DSL assigns (Hopper ``wgmma.m64nNk16``, A from registers).

The index functions are the kernels' own: the kernels call them while they are traced (the arguments
are then DSL values: thread, warp, lane, page offsets) and :func:`tile_register_source` calls them on the
host with Python integers. They use only ``+ * // %``, so both evaluate the same expressions.

- :func:`k_word` and :func:`v_word`: the word of a 64-token tile's packed codes (a page's, or one TMA
  stage's) that a thread loads into its word registers;
- :func:`k_register_source` and :func:`v_register_source`: which of those word registers, and which
  bit, A register ``r`` is built from (``((word >> field) & mask) | pattern``: one shift, one ``lop3``;
  the odd k of the register is 16 bits above the even one).

The other side of the contract is CuTe's: :func:`rs_fragment_ownership` asks CuTe DSL (at trace time;
no GPU) which ``(row, k)`` element of the A operand each thread holds in each half of each 32-bit register,
for the one-warpgroup ``(64, N)`` tiled MMA the kernels use. ``tests/test_cute_fragment.py`` checks that
the two agree for K (``S^T = K Q^T``: rows = tokens, k = channels) and V (``O^T = V^T P^T``: rows =
channels, k = tokens), at every bit width and head dim, against :func:`foscar.format.pack_codes`: the
cache layout of ``docs/layout.md`` is the fragment CuTe builds.

The accumulators (C fragments) by column slot: :func:`slot_column`, :func:`s_slot`, :func:`row_half`,
:func:`o_slot`, :func:`o_block` say which query column, token row and head-dim block each element of a thread's
``S^T`` and ``O^T`` accumulators is, and :func:`column_token` which step token a column is.
"""
from __future__ import annotations

import functools
import warnings

import torch

from ..format import K_BLOCK_TOKENS, v_block_tokens, words_per_block
from .config import HEADS

TILE_TOKENS = 64  #: tokens per KV tile: the wgmma M of S^T = K Q^T
THREADS = 128  #: one warpgroup


def k_word(bits: int, head_dim: int, first, warp, lane, i: int):
    """The ``i``-th word lane ``lane`` of warp ``warp`` reads for a 64-token tile whose first K pack block
    is ``first`` (counted in pack blocks from the start of the words indexed): warp ``w`` reads the tile's
    K block ``w`` (its 16 token rows of the m64 tile), each lane ``head_dim * bits / 64`` contiguous words."""
    return (first + warp) * words_per_block(bits, head_dim, "k") + lane * (head_dim * bits // 64) + i


def k_register_source(bits: int, r: int) -> tuple[int, int]:
    """``(i, field)``: K register ``r`` of a thread is built from its ``i``-th word (:func:`k_word`), the
    codes of the register's two k at bits ``field`` and ``field + 16``."""
    per_word = 16 // bits
    return r // per_word, bits * (r % per_word)


def v_word(bits: int, head_dim: int, first, thread, vb: int, mh: int):
    """The word thread ``thread`` reads for m64 half ``mh`` of the channels from the ``vb``-th V pack block
    of a 64-token tile whose first V pack block is ``first``: each thread's ``head_dim / 64`` words of a
    block are contiguous."""
    wpb = words_per_block(bits, head_dim, "v")
    return first * wpb + thread * (head_dim // 64) + vb * wpb + mh


def v_register_source(bits: int, head_dim: int, r: int) -> tuple[int, int, int]:
    """``(vb, mh, field)``: V^T register ``r`` of a thread is built from its word of V block ``vb`` and m64
    half ``mh`` (:func:`v_word`), the codes of the register's two k (tokens) at bits ``field`` and
    ``field + 16``. The fragment order of ``make_fragment_A((head_dim, 64))`` is ``((2, 2, 2), m64 halves,
    k16 blocks)``: ``r = 4 * (mh + halves * kb) + j``; a word spans ``4 / bits`` k16 blocks."""
    halves = head_dim // 64
    j, mk = r % 4, r // 4
    mh, kb = mk % halves, mk // halves
    nib = 4 // bits  # k16 blocks per V pack block
    return kb // nib, mh, bits * (4 * (kb % nib) + j)


def v_token_half(r: int) -> int:
    """1 when V^T register ``r``'s two k (tokens) are the upper 8 of their k16 block (fragment order
    ``((2, 2, 2), ...)``: the row's +8 in bit 0 of ``r``, the k's +8 in bit 1). A thread's P element ``e`` of a
    tile (token ``row0 + 8 (e // 2)``, ``row0 % 16 < 8``) is in half ``e // 2``."""
    return (r % 4) // 2


def v_row_class(r: int) -> int:
    """1 when V^T register ``r``'s channel row is the +8 of its 16 (bit 0 of ``r``, fragment order ``((2, 2, 2),
    ...)``); the O^T accumulator element ``e`` of that row has ``row_half(e)`` 1."""
    return r % 2


def v_rotations(bits: int, head_dim: int, shls: tuple[int, int], row_shls: tuple[int, int] = (0, 0)) -> frozenset[int]:
    """The right rotations of a V word its registers are built from when the codes of token half ``h`` and
    channel-row class ``c`` go to bit ``shls[h] + row_shls[c]`` of each 16-bit half (``v_register_source``,
    ``v_token_half``, ``v_row_class``): one funnel shift each but for rotation 0."""
    regs = 4 * (head_dim // 64) * (TILE_TOKENS // 16)
    return frozenset((v_register_source(bits, head_dim, r)[2] - shls[v_token_half(r)] - row_shls[v_row_class(r)]) % 32
                     for r in range(regs))


@functools.lru_cache(maxsize=None)
def v_token_half_shls(bits: int, head_dim: int, min_shl: int = 4) -> tuple[int, int]:
    """The bit ``(shl_0, shl_1)`` of a 16-bit half that token half 0 and 1's codes are placed at in V^T's FP16
    operands: the fewest rotations per word (:func:`v_rotations`), then the highest bits, at bits
    ``min_shl`` to ``10 - bits`` (the mantissa). By mantissa injection the operand is ``q + 2^(10 - shl)``:
    the accumulator carries that offset times the sum of P' until the correction cancels it, and the tensor
    core's FP32 sum loses its low bits to it (offsets of 256 raised the kernels' error measurably,
    ``docs/results-h200.md``; 64 is the largest taken); by placement (token-wise V) it is
    ``q 2^(shl - 24)``, no offset. INT2: (4, 8), 4 rotations a word where one bit for every register takes 7;
    INT4: (4, 6), 3 where one bit takes 4. From bit 0 (placement): INT2 (2, 6), 3; INT4 (0, 4), 2."""
    top = 10 - bits
    cands = [(s0, s1) for s0 in range(min_shl, top + 1, 2) for s1 in range(min_shl, top + 1, 2)]
    return min(cands, key=lambda s: (len(v_rotations(bits, head_dim, s) - {0}), -min(s), -sum(s)))


@functools.lru_cache(maxsize=None)
def v_class_shls(bits: int, head_dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """By placement, the codes' bits per token half and per channel-row class, ``((a_0, a_1), (0, b_1))``: a
    register of half ``h`` and class ``c`` places its codes at bit ``a_h + b_c`` (at most ``10 - bits``). The
    halves' difference rides on P' (:attr:`~foscar.cute.config.Sm90Config.v_factors`), the classes' on the
    accumulator's rows (taken off as the offset corrections join them and at the end). The fewest rotations a word,
    then the least difference between the halves (P''s FP16 range): INT2 ((0, 4), (0, 2)) and INT4 ((0, 0), (0, 4)),
    one rotation a word."""
    top = 10 - bits
    even = range(0, top + 1, 2)
    cands = [((a0, a1), (0, b1)) for a0 in even for a1 in even for b1 in even if max(a0, a1) + b1 <= top]
    return min(cands, key=lambda c: (len(v_rotations(bits, head_dim, *c) - {0}), abs(c[0][0] - c[0][1]),
                                     -min(c[0]), -c[1][1]))


def tile_register_source(bits: int, head_dim: int, tensor: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(word, shift)``, each ``[128, regs, 2]``: the word of a 64-token tile's packed codes (index into
    the tile's ``64 * head_dim * bits / 32`` words, pack blocks in token order) and the bit holding the
    code of half ``h`` of register ``r`` of thread ``t``, evaluated with the kernels' index functions
    (K: :func:`k_word` and :func:`k_register_source`; V: :func:`v_word` and :func:`v_register_source`)."""
    if tensor == "k":
        regs = TILE_TOKENS * head_dim // 2 // THREADS
    elif tensor == "v":
        regs = 4 * (head_dim // 64) * (TILE_TOKENS // 16)
    else:
        raise ValueError(f"tensor {tensor!r}: expected 'k' or 'v'")
    word = torch.empty((THREADS, regs, 2), dtype=torch.int64)
    shift = torch.empty((THREADS, regs, 2), dtype=torch.int64)
    for t in range(THREADS):
        for r in range(regs):
            if tensor == "k":
                i, field = k_register_source(bits, r)
                w = k_word(bits, head_dim, 0, t // 32, t % 32, i)
            else:
                vb, mh, field = v_register_source(bits, head_dim, r)
                w = v_word(bits, head_dim, 0, t, vb, mh)
            word[t, r] = w
            shift[t, r, 0] = field
            shift[t, r, 1] = field + 16
    return word, shift


def tile_words(bits: int, head_dim: int, tensor: str) -> int:
    """Words of one 64-token tile of packed codes."""
    block = K_BLOCK_TOKENS if tensor == "k" else v_block_tokens(bits)
    return TILE_TOKENS // block * words_per_block(bits, head_dim, tensor)


def _tiled_mma(n: int):
    import cutlass
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
    return sm90.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K,
                                       cutlass.Float32, (1, 1, 1), (64, n), warpgroup.OperandSource.RMEM)


def trace_a_ownership(make_mma, m: int, k: int, per_register: int) -> torch.Tensor:
    """``own[t, r, e] = (row, k)``: the element of the ``m x k`` A operand held by thread ``t`` in element
    ``e`` of 32-bit register ``r`` of its fragment (``per_register`` elements a register: 2 for 16-bit
    operands, 4 for 8-bit), for the tiled MMA ``make_mma()`` of one warpgroup. Traced by CuTe DSL on the
    host (seconds)."""
    import cutlass
    import cutlass.cute as cute

    regs = m * k // per_register // THREADS
    own = torch.full((THREADS, regs, per_register, 2), -1, dtype=torch.int64)

    @cute.jit
    def probe():
        tiled_mma = make_mma()
        ident = cute.make_identity_tensor((m, k))
        for t in cutlass.range_constexpr(THREADS):
            thr = tiled_mma.get_slice(t)
            coords = thr.partition_A(ident)
            frag = thr.make_fragment_A(thr.partition_shape_A((m, k)))
            for i in cutlass.range_constexpr(cute.size(coords)):
                row, col = coords[i]
                off = cute.crd2idx(i, frag.layout)  # element offset in the register fragment
                own[t, off // per_register, off % per_register, 0] = row
                own[t, off // per_register, off % per_register, 1] = col

    with warnings.catch_warnings():  # the probe's long static loops are intended (host-side tracing only)
        warnings.simplefilter("ignore")
        cute.compile(probe)
    return own


@functools.lru_cache(maxsize=None)
def rs_fragment_ownership(m: int, k: int, n: int = 8) -> torch.Tensor:
    """``own[t, r, h] = (row, k)``: the element of the ``m x k`` A operand held by thread ``t`` in half
    ``h`` (0 = low 16 bits) of 32-bit register ``r``, for the ``(64, n)`` BF16 RS tiled MMA (cached)."""
    return trace_a_ownership(lambda: _tiled_mma(n), m, k, 2)


@functools.lru_cache(maxsize=None)
def rs_accumulator_ownership(m: int, n: int = 8, make_mma=None) -> torch.Tensor:
    """``own[t, e] = (row, col)``: the element of the ``m x n`` accumulator (C) held by thread ``t`` in its
    ``e``-th fp32 register, for the ``(64, n)`` tiled MMA of one warpgroup (the BF16 one, or
    ``make_mma()``; traced on the host)."""
    import cutlass
    import cutlass.cute as cute

    own = torch.full((THREADS, m * n // THREADS, 2), -1, dtype=torch.int64)

    @cute.jit
    def probe():
        tiled_mma = _tiled_mma(n) if make_mma is None else make_mma()
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


def slot_column(k: int, col0):
    """The N column of a thread's column slot ``k`` (``col0``: its first column, ``2 quad``): slots ``2j``
    and ``2j + 1`` are the thread's two columns of 8-column block ``j``."""
    return HEADS * (k // 2) + col0 + k % 2


def s_slot(e: int) -> int:
    """The column slot of ``S^T`` accumulator element ``e`` (CuTe's ``m64nN`` C fragment, element
    ``e = c + 2 r + 4 j``: column ``8 j + 2 quad + c``, row ``row0 + 8 r``)."""
    return 2 * (e // 4) + e % 2


def slot_elements(k: int) -> tuple[int, int]:
    """The two ``S^T`` accumulator elements of column slot ``k`` (:func:`s_slot`'s inverse): its token rows
    ``row0`` and ``row0 + 8``."""
    e = 4 * (k // 2) + k % 2
    return e, e + 2


def row_half(e: int) -> int:
    """The token row of accumulator element ``e``: 0 for ``row0``, 1 for ``row0 + 8``."""
    return (e // 2) % 2


def o_slot(e: int, nb: int) -> int:
    """The column slot of O^T accumulator element ``e`` (``e = c + 2 r + 4 j + 4 nb m``, ``m`` the m64 block
    of the head dim)."""
    return 2 * ((e // 4) % nb) + e % 2


def o_block(e: int, nb: int) -> int:
    """The m64 block of the head dim (V^T's rows) of O^T accumulator element ``e``."""
    return e // (4 * nb)


def column_token(c, gqa: int, step: int):
    """The step token of N column ``c`` (the padding columns: the last token's)."""
    return cutlass_min(c // gqa, step - 1)


def cutlass_min(a, b):
    """``min`` of a traced value and a Python int (``cutlass.min``), or of two Python ints."""
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    import cutlass
    return cutlass.min(a, b)
