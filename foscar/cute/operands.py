"""The operands of the two products, ``S^T = K Q^T`` (BF16) and ``O^T = V^T P^T`` (FP16): the register-A
tiled MMAs, the swizzled shared-memory layouts of the B operands (Q^T, P^T), Q^T in shared memory, and the
A registers built from packed words (:func:`build_k_registers`, :func:`build_vt_registers`), each register
one funnel shift and one ``lop3`` (``((w >> field) & mask) | pattern``) at the positions
:mod:`foscar.cute.fragment` gives.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import BFloat16, Float16, Float32, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from .config import THREADS, TILE, Sm90Config
from .fragment import k_register_source, v_register_source, v_row_class, v_token_half

LOP_AND_OR = 0xEA  #: lop3 LUT: (a & b) | c
#: The P^T operand's shared-memory atom by N columns, column-major (:attr:`Sm90Config.p_column_major`; else
#: row-major, 128-byte swizzle): a token's columns in one swizzle row
P_ATOMS = {8: warpgroup.SmemLayoutAtomKind.MN_INTER, 16: warpgroup.SmemLayoutAtomKind.MN_SW32,
           32: warpgroup.SmemLayoutAtomKind.MN_SW64}


def mmas_and_layouts(cfg: Sm90Config):
    """Host side, both kernels: the register-A tiled MMAs of ``S^T = K Q^T`` (BF16, or E4M3 with
    ``cfg.k_e4m3``) and ``O^T = V^T P^T`` (FP16), and the swizzled shared-memory layouts of Q^T and P^T."""
    # P^T column-major (MN): a thread's two columns of a token are one 32-bit store (folds.store_p)
    p_major = OperandMajorMode.MN if cfg.p_column_major else OperandMajorMode.K
    pv_mma = sm90.make_trivial_tiled_mma(Float16, Float16, OperandMajorMode.K, p_major, Float32,
                                         (1, 1, 1), (TILE, cfg.cols), warpgroup.OperandSource.RMEM)
    if cutlass.const_expr(cfg.k_e4m3):
        from .operands_e4m3 import qk_mma_e4m3
        qk_mma = qk_mma_e4m3(cfg.qk_cols)
    elif cutlass.const_expr(cfg.fp4_block > 0):  # FP16 K operands by placement (foscar.cute.operands_fp4)
        qk_mma = sm90.make_trivial_tiled_mma(Float16, Float16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                             (1, 1, 1), (TILE, cfg.cols), warpgroup.OperandSource.RMEM)
    else:
        qk_mma = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                             (1, 1, 1), (TILE, cfg.cols), warpgroup.OperandSource.RMEM)
    if cutlass.const_expr(cfg.q_as_terms):
        from .operands_e4m3 import sq_layout_e4m3
        sQ_layout = sq_layout_e4m3(cfg.qk_depth, cfg.qk_cols)
    else:  # BF16 (FP4 formats: FP16) Q^T: the QK product's B operand, or channel-wise K's source of Q'
        q_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, q_element_type(cfg))
        sQ_layout = cute.tile_to_shape(q_atom, (cfg.cols, cfg.head_dim), (0, 1))
    p_kind = P_ATOMS[cfg.cols] if cfg.p_column_major else warpgroup.SmemLayoutAtomKind.K_SW128
    p_atom = warpgroup.make_smem_layout_atom(p_kind, Float16)
    sP_layout = cute.tile_to_shape(p_atom, (cfg.cols, TILE * cfg.p_tiles), (0, 1))  # a pass's tokens
    return qk_mma, pv_mma, sQ_layout, sP_layout


def zeroing_mma(cfg: Sm90Config, product: int):
    """Device side, in a consumer's traced region: tiled MMA ``product`` of :func:`mmas_and_layouts` (0: S^T, 1: O^T)
    with ``ACCUMULATE`` off, for an accumulator's first MMA, which overwrites it (no zeros moved in first)."""
    mma = mmas_and_layouts(cfg)[product]
    mma.set(warpgroup.Field.ACCUMULATE, False)
    return mma


def zeroing_qk_mma(cfg: Sm90Config):
    """:func:`zeroing_mma` of the S^T product where :attr:`Sm90Config.qk_zeroing` or :attr:`Sm90Config.overlap`
    (zeros moved in would make ptxas wait for another product in flight); ``None`` where neither applies."""
    if cutlass.const_expr(not (cfg.overlap or cfg.qk_zeroing)):
        return None
    return zeroing_mma(cfg, 0)


def sqk_layout(cfg: Sm90Config, buffers: int):
    """Channel-wise K: ``buffers`` buffers of ``Q'`` (the S^T product's B operand, :func:`foscar.cute.folds.fold_q`:
    a consumer's two, or one per stage), Q^T's swizzled layout with a buffer mode: BF16, or E4M3 terms
    (:func:`foscar.cute.fold_terms.fold_q_terms`; 64-byte swizzle at head dim 64)."""
    if cutlass.const_expr(cfg.k_e4m3):
        from .operands_e4m3 import sq_layout_e4m3
        return sq_layout_e4m3(cfg.head_dim, cfg.qk_cols, buffers)
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
    return cute.tile_to_shape(atom, (cfg.cols, cfg.head_dim, buffers), (0, 1, 2))


def sqk_buffer_units(cfg: Sm90Config) -> int:
    """The stride of :func:`sqk_layout`'s buffers in 16-byte units: the own wgmma's descriptor offset from ``Q'``'s
    first buffer to the next."""
    return cute.cosize(sqk_layout(cfg, 1)) * qk_element_type(cfg).width // 128


def qk_element_type(cfg: Sm90Config):
    """The element type of channel-wise K's ``Q'`` buffers: BF16, or E4M3 (its two terms)."""
    from cutlass import Float8E4M3FN
    return Float8E4M3FN if cfg.k_e4m3 else BFloat16


#: the named barrier of the warpgroup that stages Q as E4M3 terms (1-3: the consumers', 4: all of theirs)
Q_LOAD_BARRIER = 5
#: The CTA (or consumers') barriers the prologues pass after ``sum(Q)``'s stores (:func:`~foscar.cute.folds.q_sums`),
#: each after a fence: one orders the stores before the consumers' loads (``bar.sync``), but compute-sanitizer's
#: racecheck reports the pair across one in a few CTAs of every run and across two in none (``docs/results-h200.md``).
Q_SUMS_BARRIERS = 2


def q_element_type(cfg: Sm90Config):
    """The element type of Q^T in shared memory: BF16, E4M3 (its two terms) or, for the FP4 formats, FP16."""
    from cutlass import Float8E4M3FN
    if cfg.fp4_block:
        return Float16
    return Float8E4M3FN if cfg.q_as_terms else BFloat16


@cute.jit
def stage_q(cfg: Sm90Config, mQ: cute.Tensor, smem, b, kvh, tidx, mRot: cute.Tensor, sQrot, query_row):
    """Q^T of KV head ``kvh``'s query rows into ``smem.sQ`` by one warpgroup (``query_row(c)``: the row of
    ``mQ`` that N column ``c`` is, :meth:`foscar.cute.warpgroup.TileKernel.query_row`): BF16 (:func:`load_q`),
    or two E4M3 terms per head with each head's ``2^-e`` in ``smem.sQinv``
    (:func:`foscar.cute.operands_e4m3.load_q_terms`), or FP16 with each row's power of two for the FP4 formats
    (:func:`foscar.cute.operands_fp4.load_q_f16`). A rotated cache (``cfg.rotation``): Q rotated into
    its space first, in FP32 into ``sQrot`` (:func:`foscar.cute.rotation.rotate_q`), and staged from there."""
    src, b_src, row_src = mQ, b, query_row
    if cutlass.const_expr(cfg.rotation):
        from .rotation import rotate_q
        rotate_q(cfg, mQ, mRot, sQrot, b, query_row, tidx, Q_LOAD_BARRIER)
        src, b_src, row_src = sQrot, 0, (lambda c: c)
    if cutlass.const_expr(cfg.fp4_block > 0):
        from .operands_fp4 import load_q_f16
        load_q_f16(cfg, src, b_src, row_src, smem.sQ, smem.sQinv, smem.sQred, tidx, Q_LOAD_BARRIER)
    elif cutlass.const_expr(cfg.q_as_terms and cfg.term_blocks):
        from .operands_e4m3 import load_q_term_blocks
        load_q_term_blocks(cfg, src, b_src, row_src, smem.sQ, smem.sQinv, smem.sQred, tidx, Q_LOAD_BARRIER)
    elif cutlass.const_expr(cfg.q_as_terms):  # up to 4 rows of one token (config_for): rows kvh * gqa + h
        from .operands_e4m3 import load_q_terms
        load_q_terms(cfg.bits, cfg.head_dim, cfg.gqa, src, b_src, row_src(0), smem.sQ, smem.sQinv, smem.sQred,
                     tidx, Q_LOAD_BARRIER)
    else:
        load_q(cfg, src, smem.sQ, b_src, row_src, tidx)


@cute.jit
def load_q(cfg: Sm90Config, mQ: cute.Tensor, sQ: cute.Tensor, b, query_row, tidx):
    """Q^T of the query rows (column ``c``: row ``query_row(c)`` of ``mQ``) into shared memory (padded columns
    zero), by one warpgroup."""
    D = cfg.head_dim
    for h in cutlass.range_constexpr(cfg.cols):
        for d0 in cutlass.range_constexpr(D // THREADS if D >= THREADS else 1):
            d = d0 * THREADS + tidx
            if d < D:
                val = BFloat16(0.0)
                if cutlass.const_expr(h < cfg.rows):
                    val = mQ[b, query_row(h), d].to(BFloat16)  # BF16, or the rotated FP32
                sQ[h, d] = val


def inject_rotated(w: Uint32, rot: int) -> Uint32:
    """``w`` rotated right by ``rot`` bits (one funnel shift; none for 0)."""
    return cute.arch.shf(w, w, rot, "r") if rot else w


def place(x: Uint32, shl: int, bits: int, pattern: int) -> Uint32:
    """Two operands ``pattern | q << shl`` from the codes at bits ``shl`` and ``shl + 16`` of ``x`` (one ``lop3``)."""
    mask = (((1 << bits) - 1) << shl) * 0x00010001
    return cute.arch.lop3(x, Uint32(mask), Uint32(pattern * 0x00010001), LOP_AND_OR)


def inject(w: Uint32, field: int, shl: int, bits: int, pattern: int) -> Uint32:
    """Two operands ``pattern | q << shl`` from the codes at bits ``field`` and ``field + 16`` of ``w``."""
    return place(inject_rotated(w, (field - shl) % 32), shl, bits, pattern)


@cute.jit
def build_k_registers(cfg: Sm90Config, regs: cute.Tensor, kw: cute.Tensor):
    """K's A registers (``regs``: the Uint32 view of the S^T product's A fragment) from this thread's words
    of the tile (``kw``, loaded at :func:`foscar.cute.fragment.k_word`): BF16 ``q + beta_K``."""
    for r in cutlass.range_constexpr(cute.size(regs)):
        i, field = k_register_source(cfg.bits, r)
        w = Uint32(kw[i])
        regs[r] = inject(w, field, cfg.k_shl, cfg.bits, cfg.k_pattern)


@cute.jit
def build_vt_registers(cfg: Sm90Config, regs: cute.Tensor, vw: cute.Tensor):
    """V^T's A registers (``regs``: the Uint32 view of the O^T product's A fragment) from this thread's
    words of the tile (``vw[mh, vb]``, loaded at :func:`foscar.cute.fragment.v_word`): FP16 ``q + beta_V[h]``
    (injection) or ``q 2^(shl_h - 24)`` (placement, pattern 0: :mod:`foscar.cute.v_operands`) for the tokens of half
    ``h`` (:func:`foscar.cute.fragment.v_token_half`; by placement also by channel-row class, ``v_row_shls``); the
    registers of one word that take the same rotation share it."""
    values = vt_register_values(cfg, vw, cute.size(regs))
    for r in cutlass.range_constexpr(cute.size(regs)):
        regs[r] = values[r]


def vt_register_values(cfg: Sm90Config, vw: cute.Tensor, nregs: int) -> list:
    """The values of :func:`build_vt_registers` (plain Python at trace time: one rotation per word and
    rotation amount)."""
    rotated, values = {}, []
    for r in range(nregs):
        vb, mh, field = v_register_source(cfg.bits, cfg.head_dim, r)
        h = v_token_half(r)
        shl = cfg.v_shls[h] + cfg.v_row_shls[v_row_class(r)]
        key = (mh, vb, (field - shl) % 32)
        if key not in rotated:
            rotated[key] = inject_rotated(Uint32(vw[mh, vb]), key[2])
        values.append(place(rotated[key], shl, cfg.bits, cfg.v_patterns[h]))
    return values
