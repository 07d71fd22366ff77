"""E4M3 operands of ``S^T = K Q^T`` for the Hopper FP8 wgmma ``m64n8k32`` (A from registers): step 1 of
``docs/hopper-e4m3-plan.md``, a building block beside :mod:`foscar.cute.operands` (BF16), not yet wired
into the decode kernels.

- :func:`qk_mma_e4m3`: the register-A tiled MMA (E4M3 x E4M3, FP32 accumulator, ``(64, 8)``) and the
  swizzled shared-memory layout of Q^T as E4M3 (:func:`sq_layout_e4m3`).
- :func:`build_k_registers_e4m3`: a thread's A registers of one 64-token K tile from its packed words (the
  words at :func:`foscar.cute.fragment.k_word`, the layout of ``docs/layout.md`` unchanged), in the order
  :mod:`foscar.e4m3` documents: register ``e = (8/bits)*(word index) + i`` is ``(w >> bits*i) & mask``,
  so byte ``b`` holds the code at bit ``8b + bits*i`` (the E4M3 value ``q * 2^-9``). One shift and one
  ``and`` per register, four operands each.
- :func:`k_register_source_e4m3` is the index function the builder traces; :func:`tile_register_source_e4m3`
  evaluates it (and ``k_word``) on the host, and :func:`e4m3_fragment_ownership` asks CuTe DSL which
  ``(row, kappa)`` of the A operand each byte of the fragment is, for ``tests/test_cute_e4m3.py`` to check
  both against :func:`foscar.e4m3.tile_fragment_map`.
- :class:`QkProbeE4m3`: a standalone kernel, one CTA (one warpgroup) per tile: packed K words and Q^T
  (E4M3 bytes, stored permuted by :func:`foscar.e4m3.contraction_order`, ``Q[:, order]``) in, the
  ``D/32`` wgmma chain, S^T (FP32, ``[64, 8]``) out. A probe for the GPU test.
- Q as two E4M3 residual terms per head (:func:`foscar.e4m3.split_terms` with a power-of-two scale per
  head) in the spare N columns: ``hi`` of head ``h`` in column ``h``, ``lo`` in column ``gp + h``
  (:func:`term_columns`: ``gp`` the heads padded to 1, 2 or 4), summed in FP32 after the MMA with one
  lane shuffle, so that the scores sit in the BF16 kernel's columns (:func:`load_q_terms`,
  :func:`sum_q_terms`). :class:`QkTermsProbeE4m3` is the QK product of one tile with them, for the GPU
  test; the decode kernels use the same functions (``Sm90Config.k_e4m3``).
"""
from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float8E4M3FN, Float32, Int32, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.memory import SmemAllocator

from ..e4m3 import PLACEMENT_MASK
from .config import HEADS, THREADS, TILE, thread_k_words, tile_words
from .fragment import k_word

K_STEP = 32  #: the contraction depth of one ``m64nNk32`` wgmma
Q_TERMS = 2  #: E4M3 terms of Q per head in the N columns (``hi``, ``lo``; each step x16)
E4M3_TOP = 448.0  #: the largest finite E4M3 value: a head's largest ``|q| 2^e`` stays at or below it


def k_register_source_e4m3(bits: int, e: int) -> tuple[int, int]:
    """``(i, shift)``: E4M3 K register ``e`` of a thread is ``(kw[i] >> shift) & mask`` from its ``i``-th
    word (:func:`~foscar.cute.fragment.k_word`); byte ``b`` of it holds the code at bit ``shift + 8b``."""
    per_word = 8 // bits
    return e // per_word, bits * (e % per_word)


def k_placement_e4m3(bits: int, shift: int, placed: bool) -> tuple[int, int]:
    """``(rotation, field)``: the register whose codes are at bit ``shift`` of each byte of its word
    (:func:`k_register_source_e4m3`) is ``(kw[i] >> rotation) & (mask << field)``, ``rotation + field =
    shift``. ``placed`` (INT2): a byte's bits 0-3 read as E4M3 are the integer ``n 2^-9``, so the codes at
    bits 2-3 stay there (``4 q 2^-9``) and two registers share each rotation: the odd registers (rows + 8
    of the fragment: token half 1, ``Sm90Config.k_factors``) carry 4 times the operand."""
    if placed and bits == 2:
        return 4 * (shift // 4), shift % 4
    return shift, 0


def k_registers_e4m3(head_dim: int) -> int:
    """E4M3 A registers (4 bytes each) of a thread for one 64-token K tile: ``head_dim / 8``."""
    return TILE * head_dim // 4 // THREADS


def tile_register_source_e4m3(bits: int, head_dim: int):
    """``(word, shift)``, each int64 ``[128, head_dim/8, 4]``: the word of a 64-token K tile (index into its
    ``64 * head_dim * bits / 32`` words) and the bit holding the code of byte ``b`` of register ``e`` of
    thread ``t``, evaluated with the builder's index functions (:func:`~foscar.cute.fragment.k_word`,
    :func:`k_register_source_e4m3`)."""
    import torch

    regs = k_registers_e4m3(head_dim)
    word = torch.empty((THREADS, regs, 4), dtype=torch.int64)
    shift = torch.empty((THREADS, regs, 4), dtype=torch.int64)
    for t in range(THREADS):
        for e in range(regs):
            i, sh = k_register_source_e4m3(bits, e)
            word[t, e] = k_word(bits, head_dim, 0, t // 32, t % 32, i)
            for b in range(4):
                shift[t, e, b] = sh + 8 * b
    return word, shift


# --------------------------------------------------------------------------------------------
# The tiled MMA and the layouts
# --------------------------------------------------------------------------------------------
def qk_mma_e4m3(n: int = HEADS):
    """The register-A tiled MMA of ``S^T = K Q^T`` with E4M3 operands: ``wgmma.m64nNk32.f32.e4m3.e4m3``,
    one warpgroup, both operands K-major (A: tokens x channels from registers, B: Q^T in shared memory)."""
    return sm90.make_trivial_tiled_mma(Float8E4M3FN, Float8E4M3FN, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                       (1, 1, 1), (TILE, n), warpgroup.OperandSource.RMEM)


def sq_layout_e4m3(head_dim: int, n: int = HEADS, buffers: int | None = None):
    """The swizzled shared-memory layout of Q^T (``n`` heads x ``head_dim`` channels, E4M3, K-major): 128-byte
    swizzle where a row is 128 bytes or more, else 64-byte (head dim 64); with a mode of ``buffers`` when given
    (channel-wise K's ``Q'`` terms)."""
    kind = warpgroup.SmemLayoutAtomKind.K_SW128 if head_dim % 128 == 0 else warpgroup.SmemLayoutAtomKind.K_SW64
    atom = warpgroup.make_smem_layout_atom(kind, Float8E4M3FN)
    if buffers is None:
        return cute.tile_to_shape(atom, (n, head_dim), (0, 1))
    return cute.tile_to_shape(atom, (n, head_dim, buffers), (0, 1, 2))


@cute.jit
def build_k_registers_e4m3(cfg, regs: cute.Tensor, kw: cute.Tensor):
    """K's E4M3 A registers (``regs``: the Uint32 view of the S^T product's A fragment, ``head_dim/8`` of
    them) from this thread's words of the tile (``kw``, loaded at :func:`~foscar.cute.fragment.k_word`):
    register ``e`` is ``(kw[i] >> shift) & mask`` at :func:`k_register_source_e4m3`. ``cfg`` needs
    ``bits`` (an :class:`~foscar.cute.config.Sm90Config` or :class:`E4m3Tile`); a config whose
    ``k_factors`` differ by token half takes :func:`k_placement_e4m3`'s shared rotations."""
    placed = len(set(getattr(cfg, "k_factors", (1.0,)))) > 1
    for e in cutlass.range_constexpr(cute.size(regs)):
        i, shift = k_register_source_e4m3(cfg.bits, e)
        rot, field = k_placement_e4m3(cfg.bits, shift, placed)
        w = Uint32(kw[i])
        x = w >> rot if rot else w
        regs[e] = x & Uint32(PLACEMENT_MASK[cfg.bits] << field)


# --------------------------------------------------------------------------------------------
# CuTe's side of the contract, traced on the host
# --------------------------------------------------------------------------------------------
@functools.cache
def e4m3_fragment_ownership(m: int, k: int, n: int = HEADS):
    """``own[t, e, v] = (row, kappa)``: the element of the ``m x k`` A operand held by thread ``t`` in byte
    ``v`` of 32-bit register ``e`` of the E4M3 tiled MMA (:func:`qk_mma_e4m3`). Traced by CuTe DSL on the
    host (no GPU; cached)."""
    from .fragment import trace_a_ownership
    return trace_a_ownership(lambda: qk_mma_e4m3(n), m, k, 4)


# --------------------------------------------------------------------------------------------
# The probe kernel
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class E4m3Tile:
    """What the probe depends on: the bit width and the head dim."""

    bits: int
    head_dim: int

    @property
    def k_words(self) -> int:
        """Packed K words per thread per tile."""
        return thread_k_words(self.bits, self.head_dim)

    @property
    def tile_words(self) -> int:
        """Packed words of one 64-token K tile."""
        return tile_words(self.bits, self.head_dim)


@cute.jit
def probe_tile_qk(cfg, tiled_mma: cute.TiledMma, mW: cute.Tensor, sQ: cute.Tensor, tile, tidx) -> cute.Tensor:
    """The probes' S^T of one tile: this thread's packed words of ``mW[tile]`` (at
    :func:`~foscar.cute.fragment.k_word`), its E4M3 A registers, and the ``D/32`` wgmma chain against Q^T in
    ``sQ``; returns the accumulator."""
    D = cfg.head_dim
    kw = cute.make_rmem_tensor(cute.make_layout(cfg.k_words), Int32)
    for i in cutlass.range_constexpr(cfg.k_words):
        kw[i] = mW[tile, k_word(cfg.bits, D, 0, tidx // 32, tidx % 32, i)]
    thr = tiled_mma.get_slice(tidx)
    tCrA = thr.make_fragment_A(thr.partition_shape_A((TILE, D)))
    build_k_registers_e4m3(cfg, cute.recast_tensor(tCrA, Uint32), kw)
    tCrB = thr.make_fragment_B(thr.partition_B(sQ))
    acc = cute.make_rmem_tensor(thr.partition_shape_C((TILE, HEADS)), Float32)
    acc.fill(0.0)
    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.fence()
    for kb in cutlass.range_constexpr(D // K_STEP):
        cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
    return acc


class _TileProbe:
    """The launch both probes share: the E4M3 QK tiled MMA and Q^T's shared-memory layout, one CTA (one
    warpgroup) per tile of ``mS``; a subclass's ``kernel`` takes them with the tensors."""

    @cute.jit
    def __call__(self, mW: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        tiled_mma = qk_mma_e4m3()
        sQ_layout = sq_layout_e4m3(self.cfg.head_dim)
        self.kernel(tiled_mma, sQ_layout, mW, mQ, mS).launch(grid=(cute.size(mS, mode=[0]), 1, 1),
                                                             block=(THREADS, 1, 1))


class QkProbeE4m3(_TileProbe):
    """``S^T[t] = K_t Q^T`` for tiles ``t``: one CTA (one warpgroup) per tile.

    Arguments: ``mW`` int32 ``[T, tile_words]`` (each tile's packed K words, pack blocks in token order),
    ``mQ`` uint8 ``[8, head_dim]`` (the E4M3 bytes of Q, channels permuted: ``Q[:, contraction_order]``),
    ``mS`` float32 ``[T, 64, 8]`` (S^T: rows are tokens, columns heads)."""

    def __init__(self, cfg: E4m3Tile):
        self.cfg = cfg

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, sQ_layout: cute.ComposedLayout, mW: cute.Tensor, mQ: cute.Tensor,
               mS: cute.Tensor):
        cfg = self.cfg
        D = cfg.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        tile, _, _ = cute.arch.block_idx()

        # ---- Q^T (E4M3, already permuted) into shared memory ----------------------------------------
        smem = SmemAllocator()
        sQ = smem.allocate_tensor(Float8E4M3FN, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        mQf = cute.make_tensor(cute.recast_ptr(mQ.iterator, dtype=Float8E4M3FN), mQ.layout)
        for h in cutlass.range_constexpr(HEADS):
            for d0 in cutlass.range_constexpr(max(1, D // THREADS)):
                d = d0 * THREADS + tidx
                if d < D:
                    sQ[h, d] = mQf[h, d]
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

        acc = probe_tile_qk(cfg, tiled_mma, mW, sQ, tile, tidx)
        tCgS = tiled_mma.get_slice(tidx).partition_C(mS[tile, None, None])
        for j in cutlass.range_constexpr(cute.size(acc)):
            tCgS[j] = acc[j]


def compile_probe(cfg: E4m3Tile, mW, mQ, mS, *, keep_ptx: bool = False):
    """Compile :class:`QkProbeE4m3` for the given tensors (``cute.runtime.from_dlpack`` of torch tensors;
    CPU tensors compile with ``CUTE_DSL_ARCH=sm_90a``). ``keep_ptx``: the PTX is the compiled function's
    ``__ptx__``, written to a temporary folder and removed."""
    from cutlass.base_dsl.compiler import DumpDir

    probe = QkProbeE4m3(cfg)
    if not keep_ptx:
        return cute.compile(probe, mW, mQ, mS)
    with tempfile.TemporaryDirectory(prefix="foscar-cute-ptx-") as dump_dir:
        return cute.compile[(cute.KeepPTX, DumpDir(dump_dir))](probe, mW, mQ, mS)


# --------------------------------------------------------------------------------------------
# Q as E4M3 residual terms in the N columns
# --------------------------------------------------------------------------------------------
@cute.jit
def scale_exponent(top: Float32) -> Int32:
    """The largest ``e`` with ``top 2^e <= 448`` (:func:`foscar.e4m3.scale_exponent`), from the bits of a
    positive normal ``top``, clamped to ``[-126, 126]`` so that ``2^e`` and ``2^-e`` are normal floats
    (0 for ``top`` 0)."""
    bits = top.bitcast(Int32)
    biased = (bits >> 23) & 0xFF
    e = Int32(134) - biased
    if (bits & 0x7FFFFF) <= 0x600000:  # the significand at most 1.75: 448 = 1.75 x 2^8
        e = e + 1
    e = cutlass.max(cutlass.min(e, Int32(126)), Int32(-126))
    if top == 0:
        e = Int32(0)
    return e


@cute.jit
def power_of_two(e: Int32) -> Float32:
    """``2^e`` for ``-126 <= e <= 127``, built from the exponent field."""
    return ((e + 127) << 23).bitcast(Float32)


def term_columns(gqa: int) -> int:
    """``gp``: the N columns of one term (``hi`` in ``0..gp-1``, ``lo`` in ``gp..2gp-1``), the heads padded
    to 1, 2 or 4 so that a head's ``lo`` sits in the same lane (``gp`` 1) or the lane ``gp / 2`` quads
    over (a butterfly shuffle)."""
    if not 1 <= gqa <= HEADS // Q_TERMS:
        raise ValueError(f"gqa: expected 1 to {HEADS // Q_TERMS} heads (two terms each in N = {HEADS}), got {gqa}")
    return 1 if gqa == 1 else 2 if gqa == 2 else 4


def term_stride(cfg) -> int:
    """The column offset between a query row's Q terms in a QK product of ``cfg``
    (:class:`~foscar.cute.config.Sm90Config`): the rows' columns with :attr:`~foscar.cute.config.Sm90Config.term_blocks`
    (term ``k`` of row ``h`` in column ``k cols + h``), else :func:`term_columns`."""
    return cfg.cols if cfg.term_blocks else term_columns(cfg.gqa)


def contraction_position(bits: int, p):
    """The channel held at contraction index ``p`` of the E4M3 fragment (:func:`foscar.e4m3.contraction_order`,
    as arithmetic on a run-time ``p``)."""
    blk = p // 32
    h = (p % 32) // 16
    a = (p % 16) // 4
    v = p % 4
    if cutlass.const_expr(bits == 4):
        return 32 * blk + 16 * h + 8 * (v % 2) + 2 * a + v // 2
    return 32 * blk + 16 * (v % 2) + 8 * h + 2 * a + v // 2


def contraction_index(bits: int, d):
    """The contraction index of the E4M3 fragment that holds channel ``d`` (the inverse of
    :func:`contraction_position`; ints or a run-time ``d``)."""
    if bits == 4:  # d = 32 blk + 16 h + 8 (v % 2) + 2 a + v // 2
        h, v_lo = (d % 32) // 16, (d % 16) // 8
    else:  # d = 32 blk + 16 (v % 2) + 8 h + 2 a + v // 2
        h, v_lo = (d % 16) // 8, (d % 32) // 16
    return 32 * (d // 32) + 16 * h + 4 * ((d % 8) // 2) + 2 * (d % 2) + v_lo


@cute.jit
def store_q_terms(sQ: cute.Tensor, col_hi, col_lo, p, q: Float32, scale: Float32):
    """One channel of Q as two E4M3 terms at contraction index ``p`` of columns ``col_hi``
    (``hi = e4m3(q 2^e)``) and ``col_lo`` (``lo = e4m3((q 2^e - hi) 16)``) of ``sQ``, as
    :func:`foscar.e4m3.split_terms` forms them (``cvt.rn.satfinite``; the remainder is exact in FP32)."""
    store_q_term_list(sQ, [col_hi, col_lo], p, q, scale)


def store_q_term_list(sQ: cute.Tensor, cols: list, p, q: Float32, scale: Float32, grow: float = 16.0,
                      digits: bool = False):
    """One channel of Q as ``len(cols)`` E4M3 terms at contraction index ``p`` of columns ``cols`` (or at
    ``(column, index)`` pairs, ``p`` then unused): ``r_0 = q 2^e``, term ``k`` is ``t_k = e4m3(r_k)``,
    ``r_{k+1} = (r_k - t_k) grow`` (each remainder exact in FP32), as :func:`foscar.e4m3.split_terms` forms them
    (``grow`` 1: each term rounded where it sits, ``in_place``); ``digits``: ``t_k`` is ``r_k`` rounded to an
    integer, half away from zero, as :func:`foscar.e4m3.split_digits` forms them (``scale`` from
    :func:`row_scales` with ``digits``)."""
    r = q * scale
    for k in range(len(cols)):
        t = (cute.math.round(r) if digits else r).to(Float8E4M3FN)
        if isinstance(cols[k], tuple):
            sQ[cols[k]] = t
        else:
            sQ[cols[k], p] = t
        if k + 1 < len(cols):
            r = r - t.to(Float32)
            if grow != 1.0:
                r = r * grow


@cute.jit
def row_scales(head_dim: cutlass.Constexpr, rows: cutlass.Constexpr, cols: cutlass.Constexpr, mQ: cute.Tensor, b,
               query_row, sQred: cute.Tensor, sQinv: cute.Tensor, tidx, bar_id: cutlass.Constexpr,
               shared: cutlass.Constexpr = False, digits: cutlass.Constexpr = False):
    """Each query row's power-of-two scale for its E4M3 terms, by one warpgroup (named barrier ``bar_id``):
    from the row's largest ``|q|`` (``mQ[b, query_row(h), :]``, :func:`scale_exponent`), ``2^e`` into
    ``sQred[0, h]`` and ``2^-e`` into ``sQinv[h]`` for the ``cols`` columns (``e`` 0 past the ``rows``);
    ``sQred`` ``[4, cols]`` floats, the warps' maxima first. Both written before the last barrier. ``shared``: one
    scale for every row, from the largest ``|q|`` of all of them (every column's entries the same). ``digits``: the
    scale of integer digits, ``2^-5`` of that (the row's largest ``|q 2^e|`` at most 14,
    :data:`foscar.e4m3.DIGIT_TOP`)."""
    D = head_dim
    warp = tidx // 32
    lane = tidx % 32
    for h in cutlass.range_constexpr(rows):
        top = Float32(0.0)
        for d0 in cutlass.range_constexpr(max(1, D // THREADS)):
            d = d0 * THREADS + tidx
            if d < D:
                q = Float32(mQ[b, query_row(h), d])
                top = cute.arch.fmax(top, cute.arch.fmax(q, -q))
        for sh in cutlass.range_constexpr(5):
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, 16 >> sh))
        if lane == 0:
            sQred[warp, h] = top
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)
    e = Int32(0)
    if tidx < cols:  # a thread writes its own column only (and, unless shared, reads only its own)
        if cutlass.const_expr(shared):
            top = sQred[0, 0]
            for h in cutlass.range_constexpr(rows):
                for wi in cutlass.range_constexpr(THREADS // 32):
                    top = cute.arch.fmax(top, sQred[wi, h])
            e = scale_exponent(top)
        elif tidx < rows:
            top = sQred[0, tidx]
            for wi in cutlass.range_constexpr(1, THREADS // 32):
                top = cute.arch.fmax(top, sQred[wi, tidx])
            e = scale_exponent(top)
        if cutlass.const_expr(digits):  # clamped as scale_exponent's (a largest |q| below 2^128 stays within 4)
            e = cutlass.max(e - 5, Int32(-126))
    if cutlass.const_expr(shared):  # every column's thread read every column's maxima: all read before any write
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)
    if tidx < cols:
        sQred[0, tidx] = power_of_two(e)
        sQinv[tidx] = power_of_two(-e)
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)


@cute.jit
def load_q_terms(bits: cutlass.Constexpr, head_dim: cutlass.Constexpr, gqa: cutlass.Constexpr, mQ: cute.Tensor, b,
                 head0, sQ: cute.Tensor, sQinv: cute.Tensor, sQred: cute.Tensor, tidx, bar_id: cutlass.Constexpr):
    """Q^T of ``gqa`` heads (``mQ[b, head0 + h, d]``: head ``h``'s channel ``d``) into ``sQ`` as E4M3 terms at the
    :func:`term_columns`, channels at their contraction index, other columns zero; ``sQinv[c]`` the
    ``2^-e`` of column ``c``'s head (1 past the heads). By one warpgroup (``tidx`` 0..127, named barrier
    ``bar_id``); ``sQred`` ``[4, HEADS]`` floats of scratch. Each head's scale ``2^e`` is from its
    largest ``|q|`` (:func:`scale_exponent`)."""
    D = head_dim
    G = gqa
    gp = term_columns(G)
    row_scales(D, G, HEADS, mQ, b, lambda h: head0 + h, sQred, sQinv, tidx, bar_id)
    for p0 in cutlass.range_constexpr(max(1, D // THREADS)):
        p = p0 * THREADS + tidx
        if p < D:
            d = contraction_position(bits, p)
            for h in cutlass.range_constexpr(G):
                store_q_terms(sQ, h, gp + h, p, Float32(mQ[b, head0 + h, d]), sQred[0, h])
            for c in cutlass.range_constexpr(HEADS):
                if cutlass.const_expr(not (c < G or gp <= c < gp + G)):
                    sQ[c, p] = Float32(0.0).to(Float8E4M3FN)


@cute.jit
def sum_q_terms(acc: cute.Tensor, gqa: cutlass.Constexpr, quad, inv0: Float32, inv1: Float32):
    """The scores of a thread's accumulator elements (element ``e``: column ``2 quad + e % 2``) from the
    two terms, in place: ``(hi + lo / 16) 2^-e`` in a head's column (``inv0``, ``inv1``: the ``2^-e`` of
    this thread's two columns), 0 in the other columns. A head's ``lo`` is element ``e + 1`` of the same
    thread (one head) or element ``e`` of the lane ``gp / 2`` quads over (a butterfly shuffle; every lane
    takes part)."""
    gp = term_columns(gqa)
    for e in cutlass.range_constexpr(0, cute.size(acc), 2):
        if cutlass.const_expr(gp == 1):
            s = (acc[e] + acc[e + 1] * 0.0625) * inv0
            acc[e] = Float32(0.0)
            if quad == 0:
                acc[e] = s
            acc[e + 1] = Float32(0.0)
        else:
            lo0 = cute.arch.shuffle_sync_bfly(acc[e], gp // 2)
            lo1 = cute.arch.shuffle_sync_bfly(acc[e + 1], gp // 2)
            s0 = (acc[e] + lo0 * 0.0625) * inv0
            s1 = (acc[e + 1] + lo1 * 0.0625) * inv1
            acc[e] = Float32(0.0)
            acc[e + 1] = Float32(0.0)
            if 2 * quad < gqa:
                acc[e] = s0
            if 2 * quad + 1 < gqa:
                acc[e + 1] = s1


@cute.jit
def load_q_term_blocks(cfg, mQ: cute.Tensor, b, query_row, sQ: cute.Tensor, sQinv: cute.Tensor, sQred: cute.Tensor,
                       tidx, bar_id: cutlass.Constexpr):
    """Q^T of the ``cfg.rows`` query rows (column ``c``: row ``query_row(c)`` of ``mQ[b]``) into ``sQ`` as
    ``cfg.q_terms`` E4M3 terms in separate column blocks (``Sm90Config.term_blocks``): term ``k`` in column
    ``k cols + c`` (``Sm90Config.stacked_terms``: in column ``c`` at channel block ``q_terms - 1 - k``, the
    smallest first, each term rounded where it sits), channels at their contraction index, the padded columns
    zero; ``sQinv[c]`` the ``2^-e`` of
    row ``c`` (1 past the rows). By one warpgroup (named barrier ``bar_id``); ``sQred`` ``[4, cols]`` floats of
    scratch. Each row's scale ``2^e`` is from its largest ``|q|`` (:func:`scale_exponent`)."""
    D = cfg.head_dim
    R = cfg.rows
    C = cfg.cols
    T = cfg.q_terms
    row_scales(D, R, C, mQ, b, query_row, sQred, sQinv, tidx, bar_id, cfg.shared_q_scale, cfg.q_digits)
    for p0 in cutlass.range_constexpr(max(1, D // THREADS)):
        p = p0 * THREADS + tidx
        if p < D:
            d = contraction_position(cfg.bits, p)
            for h in cutlass.range_constexpr(C):
                # term k of row h: column k C + h, or (stacked) channel block T - 1 - k of column h
                at = [k * C + h for k in range(T)]
                if cutlass.const_expr(cfg.stacked_terms):
                    at = [(h, (T - 1 - k) * D + p) for k in range(T)]
                if cutlass.const_expr(h < R):
                    store_q_term_list(sQ, at, p, Float32(mQ[b, query_row(h), d]), sQred[0, h],
                                      1.0 if cfg.stacked_terms else 16.0, cfg.q_digits)
                else:
                    for k in cutlass.range_constexpr(T):
                        if cutlass.const_expr(cfg.stacked_terms):
                            sQ[at[k]] = Float32(0.0).to(Float8E4M3FN)
                        else:
                            sQ[at[k], p] = Float32(0.0).to(Float8E4M3FN)


@cute.jit
def sum_term_blocks(acc: cute.Tensor, nb: cutlass.Constexpr, qinv: list, terms: cutlass.Constexpr = 2):
    """The scores of a QK accumulator with Q's ``terms`` in separate column blocks (``Sm90Config.term_blocks``):
    element ``e`` of the first ``4 nb`` (the rows' columns) becomes ``(t_0 + (t_1 + t_2 / 16) / 16) 2^-e``,
    term ``k`` its element ``e + 4 k nb`` of the same thread (``qinv``: the ``2^-e`` by column slot), the
    smallest terms added first."""
    for e in cutlass.range_constexpr(4 * nb):
        x = acc[e + 4 * (terms - 1) * nb]
        for k in cutlass.range_constexpr(terms - 2, -1, -1):
            x = acc[e + 4 * k * nb] + x * 0.0625
        acc[e] = x * qinv[2 * (e // 4) + e % 2]


@cute.jit
def scale_stacked_terms(acc: cute.Tensor, nb: cutlass.Constexpr, qinv: list):
    """The scores of a QK accumulator with Q's terms stacked along the contraction (``Sm90Config.stacked_terms``:
    the tensor core summed them): element ``e`` times its column's ``2^-e`` (``qinv``, by column slot)."""
    for e in cutlass.range_constexpr(4 * nb):
        acc[e] = acc[e] * qinv[2 * (e // 4) + e % 2]


class QkTermsProbeE4m3(_TileProbe):
    """``S^T[t] = K_t Q^T`` for tiles ``t`` with Q in FP32 split into E4M3 terms in the kernel
    (:func:`load_q_terms`, :func:`sum_q_terms`, as the decode kernels do): one CTA (one warpgroup) per tile.

    Arguments: ``mW`` int32 ``[T, tile_words]``; ``mQ`` float32 ``[1, G, head_dim]`` (G <= 4 heads, channels
    in their natural order); ``mS`` float32 ``[T, 64, G]``."""

    def __init__(self, cfg: E4m3Tile, gqa: int):
        term_columns(gqa)  # refuses more heads than the columns hold
        self.cfg, self.gqa = cfg, gqa

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, sQ_layout: cute.ComposedLayout, mW: cute.Tensor, mQ: cute.Tensor,
               mS: cute.Tensor):
        cfg = self.cfg
        G = self.gqa
        D = cfg.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        tile, _, _ = cute.arch.block_idx()
        quad = tidx % 4  # lane % 4
        smem = SmemAllocator()
        sQ = smem.allocate_tensor(Float8E4M3FN, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sQred = smem.allocate_tensor(Float32, cute.make_layout((THREADS // 32, HEADS)), byte_alignment=16)
        sQinv = smem.allocate_tensor(Float32, cute.make_layout(HEADS), byte_alignment=16)
        load_q_terms(cfg.bits, D, G, mQ, 0, 0, sQ, sQinv, sQred, tidx, 1)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

        acc = probe_tile_qk(cfg, tiled_mma, mW, sQ, tile, tidx)
        sum_q_terms(acc, G, quad, sQinv[2 * quad], sQinv[2 * quad + 1])

        tCcS = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((TILE, HEADS)))
        for j in cutlass.range_constexpr(cute.size(acc)):
            row, col = tCcS[j]
            if col < G:
                mS[tile, row, col] = acc[j]


def compile_terms_probe(cfg: E4m3Tile, gqa: int, mW, mQ, mS):
    """Compile :class:`QkTermsProbeE4m3` for the given tensors (as :func:`compile_probe`)."""
    return cute.compile(QkTermsProbeE4m3(cfg, gqa), mW, mQ, mS)
