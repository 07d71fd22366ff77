"""Affine folding in the tile step (paper Sec. 4.1, Fig. 4): where each axis puts its ``(s', z')``.

- K, token-wise: the **acc-fold** of the tile's ``S^T`` partial per channel group, centred on the pivot
  like :func:`foscar.decode_folded` (:func:`k_acc_fold`, with the offset term ``sum(Q)`` of
  :func:`q_sums`);
- K, channel-wise: the **operand-fold** ``Q' = bf16(Q s')`` of the tile's token group (E4M3 K operands: two
  E4M3 terms of ``Q'``, :func:`~foscar.cute.fold_terms.fold_q_terms`) and its offset correction per head
  (:func:`k_operand_fold`, :func:`k_operand_fold_scores`);
- V, token-wise: the **operand-fold** ``P' = P s'_V / sigma`` into the B operand, the offset correction
  gathered per element (:func:`v_operand_fold`) and added to the accumulator every
  :data:`~foscar.cute.config.CORRECTION_TILES` tiles (:func:`add_offset_corrections`);
- V, channel-wise: ``P~ = fp16(P)`` as the B operand and the **acc-fold** of the tile's PV partial per
  channel (:func:`v_acc_fold`).

:class:`OutputAccumulator` is the O^T accumulator these act on.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Uint16, Uint32
from cutlass.cute.nvgpu import warpgroup

from ..format import P_UNITS_OFFSET_RATIO
from .config import HEADS, THREADS, TILE
from .fragment import o_block, o_slot, row_half, s_slot, slot_column, slot_elements
from .fold_map import FOLD_CHANNELS, FOLD_PAIRS, fold_chunk, fold_chunks
from .fold_terms import fold_q_terms
from .operands import build_vt_registers
from .operands_e4m3 import sum_q_terms, sum_term_blocks
from .pivot import pivot_corrections, set_sum_a, sum_mma
from .ptx import f16_pair, f16_pair_word, mul_f16_pairs
from .softmax import column_sums
from .wgmma import pv_mma


def power_of_two_reciprocal(x: Float32) -> Float32:
    """``1 / x`` of a power of two ``x = 2^e`` (``|e| <= 126``; ``sigma`` is one), exactly: the exponent
    field ``E`` becomes ``254 - E``, one integer subtraction where an IEEE division takes about ten
    instructions. ``y * power_of_two_reciprocal(x)`` rounds as ``y / x`` does (both are ``y 2^-e``
    rounded once)."""
    return (Int32(0x7F000000) - x.bitcast(Int32)).bitcast(Float32)


class OutputAccumulator:
    """One warpgroup's O^T accumulator ``acc`` (this thread's ``head_dim * cols / 128`` elements, element
    ``e``: m64 half :func:`~foscar.cute.fragment.o_block`, column slot :func:`~foscar.cute.fragment.o_slot`) in
    units of ``sigma``, and the offset corrections gathered per S^T element since the last fold (``corr``).
    Token-wise V has one ``sigma`` (a power of two at least every ``|s'_V|`` so far) and one ``corr`` per
    channel group, each group one m64 half of V^T; channel-wise V keeps ``sigma`` 1. A run-time loop carries
    ``sigma``. V^T by placement (``Sm90Config.v_unit``): the elements are in units of ``sigma * unit``, those of
    channel-row class 1 (``row_half(e)``, ``Sm90Config.v_row_shls``) in ``row_scale`` times those.
    ``pivot`` (``Sm90Config.pivot_mma``): the C fragment of V^T's extra m64 block, whose row 0 sums ``c_h P'`` by
    column (:mod:`foscar.cute.pivot`), scaled as ``acc`` is."""

    def __init__(self, acc: cute.Tensor, sigma: list, corr: list, nb: int = 1, mh: int = 2, unit: float = 1.0,
                 pivot: cute.Tensor | None = None, row_scale: float = 1.0):
        self.acc = acc
        self.sigma = sigma
        self.corr = corr
        self.nb = nb
        self.mh = mh
        self.unit = unit
        self.pivot = pivot
        self.row_scale = row_scale

    def group(self, e: int) -> int:
        """The channel group (its ``sigma`` and ``corr``) of accumulator element ``e``."""
        return o_block(e, self.nb) * len(self.sigma) // self.mh

    def __extract_mlir_values__(self):
        return [s.ir_value() for s in self.sigma]

    def __new_from_mlir_values__(self, values) -> OutputAccumulator:
        return OutputAccumulator(self.acc, [Float32(v) for v in values], self.corr, self.nb, self.mh, self.unit,
                                 self.pivot, self.row_scale)

    def rescale(self, al: list, sigma: list):
        """Rescale the accumulator to new running maxima (``al``, by column slot) and new units ``sigma``."""
        self.scale_to(al, sigma)
        self.sigma = sigma

    def scale_to(self, al: list, sigma: list):
        """The accumulator's elements rescaled (``al``, by column slot) into units ``sigma``, leaving
        :attr:`sigma` as it is (inside a run-time branch, which cannot hand a new attribute out)."""
        ratio = [self.sigma[g] * power_of_two_reciprocal(sigma[g]) for g in range(len(sigma))]
        nb = self.nb
        for e in range(cute.size(self.acc)):
            f = al[o_slot(e, nb)] * ratio[self.group(e)]
            self.acc[e] = self.acc[e] * f
        if self.pivot is not None:  # in the same units as acc (one channel group)
            for e in range(cute.size(self.pivot)):
                self.pivot[e] = self.pivot[e] * (al[o_slot(e, nb)] * ratio[0])


@cute.jit
def q_sums(cfg, sQ: cute.Tensor, sQsum: cute.Tensor, tidx, sQinv=None):
    """``sum(Q)`` of the BF16 operand per head and channel group of a token-wise K (``sQsum[h, c]``): the
    acc-fold's offset term. E4M3 K operands: of the operand the MMA consumes, ``(t_0 + t_1 / 16 + ...) 2^-e``
    from the terms (stacked along the contraction: ``(t_0 + t_1 + ...) 2^-e``; ``sQinv``: each head's
    ``2^-e``), 0 past the heads."""
    D = cfg.head_dim
    if cutlass.const_expr(cfg.q_as_terms):
        from .operands_e4m3 import term_stride
        gp = term_stride(cfg)  # row h's term k: column k gp + h
        width = D // cfg.kc
        if tidx < cfg.cols * cfg.kc:
            h = tidx % cfg.cols
            c = tidx // cfg.cols
            acc_q = Float32(0.0)
            if h < cfg.rows:
                for p in cutlass.range(width, unroll=8):
                    if cutlass.const_expr(cfg.stacked_terms):  # block j: term q_terms - 1 - j, the smallest first
                        x = sQ[h, c * width + p].to(Float32)
                        for j in cutlass.range_constexpr(1, cfg.q_terms):
                            x = x + sQ[h, j * D + c * width + p].to(Float32)
                    else:
                        x = sQ[(cfg.q_terms - 1) * gp + h, c * width + p].to(Float32)
                        for k in cutlass.range_constexpr(cfg.q_terms - 2, -1, -1):
                            x = sQ[k * gp + h, c * width + p].to(Float32) + x * 0.0625
                    acc_q += x
                acc_q = acc_q * sQinv[h]
            if cutlass.const_expr(cfg.kc == 1):
                sQsum[h] = acc_q
            else:
                sQsum[h, c] = acc_q
    elif cutlass.const_expr(cfg.kc == 1):
        if tidx < cfg.cols:
            acc_q = Float32(0.0)
            for d in cutlass.range(D, unroll=8):
                acc_q += Float32(sQ[tidx, d])
            sQsum[tidx] = acc_q
    else:
        width = D // cfg.kc
        if tidx < cfg.cols * cfg.kc:
            h = tidx % cfg.cols
            c = tidx // cfg.cols
            acc_q = Float32(0.0)
            for d in cutlass.range(width, unroll=8):
                acc_q += Float32(sQ[h, c * width + d])
            sQsum[h, c] = acc_q


@cute.jit
def k_acc_fold(cfg, accS: list, par: cute.Tensor, sc, wg, mu=None) -> list:
    """Token-wise K: the scaled scores of a tile's four S^T elements from its partial(s) ``accS`` (one per
    channel group), centred: ``s' (part - c sum Q) + mid sum Q``, times the softmax scale. One group: its
    ``(s', z')`` from ``sc.k``; two: each group-local partial scaled apart (``(s', z')`` from ``par``). FP4
    formats (no offset): ``s' part`` times each query row's ``2^-e`` (``wg.qinv``). With ``mu`` (by column
    slot) the scores less ``mu``: one group forms ``part s' + (sum Q (mid - c s') - mu)``, two FMAs an
    element (the lazy softmax's scores, :mod:`foscar.cute.lazy`). ``cfg.shared_q_scale``: the partials in units of
    ``Q 2^e`` (one ``e`` a KV head), whose ``2^-e`` joins the factor ``s'`` of the partial alone (``sum Q`` is in
    Q's units)."""
    qk_scale = wg.qk_scale
    # multiply s' of token half 0 and 1 (rows + 8): the operand's scale is s' k_factor (E4M3: 2^9); the
    # offset's is not; c0, c1 the halves' pivots
    op_scale = qk_scale
    if cutlass.const_expr(cfg.k_factors[0] != 1.0):
        op_scale = qk_scale * cfg.k_factors[0]
    op_scale1 = op_scale
    if cutlass.const_expr(cfg.k_factors[1] != cfg.k_factors[0]):
        op_scale1 = qk_scale * cfg.k_factors[1]
    shared = cfg.shared_q_scale  # the partials in units of Q 2^e, one e per KV head: its 2^-e joins their factor
    cs = cfg.k_pivots
    n_el = 4 * cfg.nb
    s = []
    if cutlass.const_expr(cfg.kc == 2):
        col0 = wg.thr.col0
        s = [Float32(0.0) for _ in range(n_el)]
        for c in cutlass.range_constexpr(2):
            acc_c = accS[c]
            q = [wg.smem.sQsum[slot_column(k, col0), c] for k in range(2 * cfg.nb)]
            ka = [par[c * 2] * op_scale, par[(2 + c) * 2] * op_scale1]  # rows 0, 1: (s', z') at (r * kc + c) * 2
            ke = [(par[c * 2 + 1] + cfg.k_mid * par[c * 2]) * qk_scale,
                  (par[(2 + c) * 2 + 1] + cfg.k_mid * par[(2 + c) * 2]) * qk_scale]
            if cutlass.const_expr(shared):
                kq = [x * wg.qinv[0] for x in ka]
                kc = [ke[r] - cs[r] * ka[r] for r in range(2)]
                for e in cutlass.range_constexpr(n_el):
                    r, k = row_half(e), s_slot(e)
                    s[e] = s[e] + acc_c[e] * kq[r] + q[k] * kc[r]
            else:
                for e in cutlass.range_constexpr(n_el):
                    r, k = row_half(e), s_slot(e)
                    s[e] = s[e] + (acc_c[e] - cs[r] * q[k]) * ka[r] + q[k] * ke[r]
        if cutlass.const_expr(mu is not None):
            s = less_maxima(s, mu)
    elif cutlass.const_expr(cfg.fp4_block > 0):  # no offset; Q's power of two per row (operands_fp4.load_q_f16)
        ks0, _, ks1, _ = sc.k
        a = [ks0 * op_scale, ks1 * op_scale1]
        f = [[a[r] * wg.qinv[k] for k in range(2 * cfg.nb)] for r in range(2)]
        for e in cutlass.range_constexpr(n_el):
            s.append(accS[0][e] * f[row_half(e)][s_slot(e)])
        if cutlass.const_expr(mu is not None):
            s = less_maxima(s, mu)
    else:
        ks0, kz0, ks1, kz1 = sc.k
        qsum = wg.qsum
        acc = accS[0]
        a = [ks0 * op_scale, ks1 * op_scale1]
        ez = [(kz0 + cfg.k_mid * ks0) * qk_scale, (kz1 + cfg.k_mid * ks1) * qk_scale]
        aq = [x * wg.qinv[0] for x in a] if shared else a  # the partials' factor
        if cutlass.const_expr(mu is None and not shared):
            for e in cutlass.range_constexpr(n_el):
                r, k = row_half(e), s_slot(e)
                s.append((acc[e] - cs[r] * qsum[k]) * a[r] + qsum[k] * ez[r])
        else:  # the pivot's term joins the offset's: one FMA per element for it, one for the score
            ec = [ez[r] - cs[r] * a[r] for r in range(2)]
            for e in cutlass.range_constexpr(n_el):
                r, k = row_half(e), s_slot(e)
                off = qsum[k] * ec[r] if mu is None else qsum[k] * ec[r] - mu[k]
                s.append(acc[e] * aq[r] + off)
    return s


def less_maxima(s: list, mu: list) -> list:
    """Scores ``s`` less ``mu`` by column slot (:func:`~foscar.cute.fragment.s_slot`)."""
    return [s[e] - mu[s_slot(e)] for e in range(len(s))]


@cute.jit
def fold_q(cfg, t, threads: int, sQ: cute.Tensor, sQk: cute.Tensor, sKf: cute.Tensor, buf, param):
    """Channel-wise K's operand-fold of a token group by ``threads`` threads (``t``: this one): ``Q' = bf16(Q s')``
    into buffer ``buf`` of ``sQk`` (the QK product's B operand) and the group's offset correction per query
    row, ``sum_d Q mid - c sum_d Q'`` (centred on the pivot ``c``, from the BF16 ``Q'`` the MMA consumes), into
    ``sKf[buf, row]``. The thread builds :data:`~foscar.cute.fold_map.FOLD_CHANNELS` channels of its rows
    (:func:`~foscar.cute.fold_map.fold_chunk`: the ``D / 8`` builders of a row are lanes of one warp, its
    correction their butterfly sum) in pairs, one 32-bit word of Q and Q' each (:func:`~foscar.cute.fold_map.fold_channel`);
    ``param(i)`` is the ``i``-th float of its channels' ``(s', z')`` (``s'`` of its channel ``i // 2`` at even
    ``i``, ``z'`` at odd: :func:`~foscar.cute.fold_map.fold_param`). No synchronisation: the caller fences the
    writes for the wgmma's proxy and publishes them."""
    D = cfg.head_dim
    lanes = D // FOLD_CHANNELS  # threads of one row: a power of two <= 32
    pivot = cfg.k_pivots[0]  # channel-wise K: BF16 operands, one pivot
    qv = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
    qs = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
    for j in cutlass.range_constexpr(fold_chunks(cfg, threads)):
        h, c = fold_chunk(D, t, j, threads)
        part = Float32(0.0)
        if h < cfg.cols:  # row h's pairs c, c + lanes, ...: each one word of Q, then of Q'
            for p in cutlass.range_constexpr(FOLD_PAIRS):
                cute.autovec_copy(cute.local_tile(sQ[(h, None)], (2,), (c + lanes * p,)), qv)
                for k in cutlass.range_constexpr(2):
                    i = 2 * p + k
                    sc = param(2 * i)  # read where it is used (few live registers)
                    md = param(2 * i + 1) + cfg.k_mid * sc
                    x = Float32(qv[k])
                    y = BFloat16(x * sc)
                    qs[k] = y
                    part = part + x * md - pivot * Float32(y)
                cute.autovec_copy(qs, cute.local_tile(sQk[(h, None, buf)], (2,), (c + lanes * p,)))
        for sh in cutlass.range_constexpr(lanes.bit_length() - 1):  # the row's sum over its lanes
            part = part + cute.arch.shuffle_sync_bfly(part, lanes >> (sh + 1))
        if t % lanes == 0 and h < cfg.cols:
            sKf[buf, h] = part


def kf_layout(cfg):
    """Channel-wise K's offset corrections per ``Q'`` buffer: ``sKf[buf, h]``; E4M3 K operands, then each row's
    ``2^-e`` at ``sKf[buf, cols + h]`` (:func:`~foscar.cute.fold_terms.fold_q_terms`)."""
    return cute.make_layout((2, cfg.cols * (2 if cfg.k_e4m3 else 1)))


def q_fold(cfg):
    """Channel-wise K's operand-fold of ``cfg``'s K operands: :func:`fold_q` (BF16) or
    :func:`~foscar.cute.fold_terms.fold_q_terms` (E4M3),
    whoever folds (a consumer warpgroup, :func:`k_operand_fold`; the producer's warps,
    :func:`foscar.cute.producer_fold.fold_stages`)."""
    return fold_q_terms if cfg.k_e4m3 else fold_q


@cute.jit
def k_operand_fold(cfg, wg, param, buf):
    """Channel-wise K, at a token group's first tile, by the computing warpgroup: :func:`q_fold` (``param``: the
    group's ``(s', z')``, :meth:`foscar.cute.kernel_v1.FoldDecodeSm90WS._fold_source`) into buffer ``buf``, then one
    barrier of the warpgroup (the writes fenced for the wgmma's proxy first): the buffers alternate
    (:func:`~foscar.cute.fold_map.k_fold_buffer`), so no reader of this one is left."""
    thr = wg.thr
    q_fold(cfg)(cfg, thr.tidx, THREADS, wg.smem.sQ, wg.smem.sQk, wg.smem.sKf, buf, param)
    cute.arch.fence_view_async_shared()  # sQk is read by the wgmma (async proxy)
    cute.arch.barrier(barrier_id=thr.bar_id, number_of_threads=THREADS)


def k_operand_fold_scores(cfg, accS: cute.Tensor, wg, buf, summed: bool = False) -> list:
    """Channel-wise K: the scaled scores ``(Q' y + correction) * scale`` of a tile's S^T elements (``buf``: the
    tile's ``Q'`` buffer). E4M3 K operands: ``Q' y`` from the two terms (``(hi + lo / 16) 2^-e``: in the 8
    columns, :func:`~foscar.cute.operands_e4m3.sum_q_terms`, unless ``summed``: two tiles a pass, summed where
    they are joined; in column blocks beyond 4 rows, :func:`~foscar.cute.operands_e4m3.sum_term_blocks`) times the
    operand's factor of the row's token half, summed or not."""
    col0 = wg.thr.col0
    n_el = 4 * cfg.nb
    sKf = wg.smem.sKf
    kc = [sKf[buf, slot_column(k, col0)] for k in range(n_el // 2)]
    qk_scale = wg.qk_scale
    if cutlass.const_expr(cfg.k_e4m3):  # summed or not, the terms' sum is in the E4M3 operand's units
        inv = [sKf[buf, cfg.cols + slot_column(k, col0)] for k in range(n_el // 2)]  # each column slot's 2^-e
        if cutlass.const_expr(cfg.term_blocks):
            sum_term_blocks(accS, cfg.nb, inv)
        elif cutlass.const_expr(not summed):
            sum_q_terms(accS, cfg.gqa, wg.thr.quad, inv[0], inv[1])
        a = [qk_scale * cfg.k_factors[0], qk_scale * cfg.k_factors[1]]
        return [accS[e] * a[row_half(e)] + kc[s_slot(e)] * qk_scale for e in range(n_el)]
    return [(accS[e] + kc[s_slot(e)]) * qk_scale for e in range(n_el)]


#: The largest units (``2^126``: their reciprocal is normal); ``|s'_V|`` above it still keeps ``P'`` within FP16.
SIGMA_CAP_BITS = 253 << 23


@cute.jit
def p_units_bound(s: Float32, z: Float32) -> Float32:
    """What one token row asks of the ``P'`` units: ``max(|s'|, 2^-64 |z'|)``
    (:data:`foscar.format.P_UNITS_OFFSET_RATIO`)."""
    return cute.arch.fmax(cute.arch.fmax(s, -s), cute.arch.fmax(z, -z) * P_UNITS_OFFSET_RATIO)


@cute.jit
def grow_sigma(sigma: Float32, bound: Float32) -> Float32:
    """The larger of ``sigma`` and the least power of two at least ``bound`` (from its bits; 0 for ``bound``
    0, at most ``2^126``, and ``sigma`` for a NaN ``bound``): a power of two >= every ``|s'_V|`` so far
    keeps ``P' = P s'_V / sigma`` within FP16, as ``P <= 1``, whatever the scales' magnitude
    (:func:`p_units_bound`)."""
    bits = bound.bitcast(Int32)
    up = bits & 0x7F800000
    if (bits & 0x7FFFFF) != 0:  # not a power of two (or subnormal): the next one up
        up = up + 0x00800000
    up = cutlass.min(up, Int32(SIGMA_CAP_BITS))
    return cute.arch.fmax(sigma, up.bitcast(Float32))


@cute.jit
def p_scales(cfg, wg, out: OutputAccumulator, tile, tv: Float32) -> list:
    """Token-wise V: the units ``sigma`` of ``P'`` for this tile, per channel group, from the tile's largest
    :func:`p_units_bound` (``tv``; the second group's from slot ``cols + 1`` of the reduction
    :func:`foscar.cute.softmax.tile_maxima` left in shared memory)."""
    sigma = [grow_sigma(out.sigma[0], tv)]
    if cutlass.const_expr(cfg.vc == 2):
        sRed = wg.smem.sRed
        buf = tile & 1  # tile >= 0
        tv2 = sRed[buf, 0, cfg.cols + 1]
        for wi in cutlass.range_constexpr(1, 4):
            tv2 = cute.arch.fmax(tv2, sRed[buf, wi, cfg.cols + 1])
        sigma.append(grow_sigma(out.sigma[1], tv2))
    return sigma


def store_p(cfg, sP: cute.Tensor, thr, q: list, first: int = 0):
    """A tile's P elements of this thread (element e: column slot ``s_slot(e)`` from ``col0``, token
    ``first + prow0 + 8 row_half(e)`` of the pass, :class:`~foscar.cute.warpgroup.WarpgroupThread`) into the B
    operand ``sP`` of the O^T product. Column-major (``cfg.p_column_major``): elements ``e`` and ``e + 1`` (``e``
    even) are a token's adjacent columns, one 32-bit store."""
    col = thr.col0
    row0 = thr.prow0 + first
    if cutlass.const_expr(cfg.p_column_major):
        for e in range(0, len(q), 2):
            pair = cute.make_rmem_tensor(cute.make_layout(2), Float16)
            pair[0] = q[e]
            pair[1] = q[e + 1]
            row = sP[(None, row0 + 8 * row_half(e))]
            cute.autovec_copy(pair, cute.local_tile(row, (2,), (slot_column(s_slot(e), col) // 2,)))
    else:
        for e in range(len(q)):
            sP[slot_column(s_slot(e), col), row0 + 8 * row_half(e)] = q[e]


def p_operands(cfg, v: list, p: list, sigma: list) -> list:
    """Token-wise V: ``P'_g = fp16(P s'_V[g] / sigma_g)`` of this thread's elements ``p``, per channel group
    ``g`` (``v[g]``: the group's ``(s', z')`` of this thread's two rows). With ``cfg.pair_p_scale`` a token's two
    adjacent columns (elements ``e``, ``e + 1``) are converted to FP16 together and multiplied by the row's factor
    in FP16 (:func:`scaled_pairs`): ``fp16(fp16(P) fp16(s'_V / sigma))``, two roundings where one was, two
    instructions a pair where there were three (the corrections take the ``P'`` consumed: the product stays centred)."""
    groups = len(sigma)
    inv = [power_of_two_reciprocal(sigma[g]) for g in range(groups)]
    r = [(v[g][0] * inv[g], v[g][2] * inv[g]) for g in range(groups)]
    f0, f1 = cfg.v_factors  # V^T by placement: each token half's operand scale (a power of two), applied to
    # s' / sigma <= 1 (never to 1 / sigma alone, which a factor could take below FP32's normal range)
    if cutlass.const_expr(f0 != 1.0 or f1 != 1.0):
        r = [(r[g][0] * f0, r[g][1] * f1) for g in range(groups)]
    if cutlass.const_expr(cfg.pair_p_scale):
        return [scaled_pairs(p, [f16_pair(x, x) for x in r[g]]) for g in range(groups)]
    return [[Float16(p[e] * r[g][row_half(e)]) for e in range(len(p))] for g in range(groups)]


def scaled_pairs(p: list, rp: list) -> list:
    """``fp16(fp16(p[e]) rp[h])`` of elements ``e`` and ``e + 1`` (a token's two adjacent columns, token row ``h
    = row_half(e)``; ``rp[h]`` that row's factor as an FP16 pair, None for 1) in one conversion and one
    ``mul.rn.f16x2``: the elements as FP16 values."""
    q = []
    for e in range(0, len(p), 2):
        w = f16_pair(p[e], p[e + 1])
        if rp[row_half(e)] is not None:
            w = mul_f16_pairs(w, rp[row_half(e)])
        q += [(w & Uint32(0xFFFF)).to(Uint16).bitcast(Float16), (w >> 16).to(Uint16).bitcast(Float16)]
    return q


def gather_offset_corrections(cfg, out: OutputAccumulator, v: list, p: list, q: list, sigma: list, al=None):
    """Token-wise V: the offset correction of each element (``P mid - c_h sigma P'``, ``c_h`` the pivot of the
    element's token half, ``q`` the consumed ``P'``; in units of ``sigma``) gathered into ``out.corr[g]``,
    rescaled first by ``al`` (by column slot) unless None."""
    groups = len(sigma)
    mid = [(v[g][1] + cfg.v_mid * v[g][0], v[g][3] + cfg.v_mid * v[g][2]) for g in range(groups)]
    # the pivot of element e's token half (fragment.v_token_half: rows prow0 and prow0 + 8 are halves 0, 1)
    cs = [[cfg.v_pivots[h] * sigma[g] for h in range(2)] if cfg.v_pivots[0] != cfg.v_pivots[1]
          else [cfg.v_pivots[0] * sigma[g]] * 2 for g in range(groups)]
    for g in range(groups):
        c = out.corr[g]
        for k in range(len(p) // 2):  # slot k: elements e and e + 2, its two token rows (halves 0 and 1)
            acc = c[k] if al is None else c[k] * al[k]
            for e in slot_elements(k):
                h = row_half(e)
                acc = acc + p[e] * mid[g][h]
                if cutlass.const_expr(not cfg.pivot_mma):  # else the tensor core sums c_h P' (foscar.cute.pivot)
                    acc = acc - cs[g][h] * Float32(q[g][e])
            c[k] = acc


def store_p_operands(cfg, wg, q: list, first: int = 0):
    """Each channel group's ``P'`` elements of this thread into its B operand (from token ``first`` of its pass),
    then the proxy fence the wgmma reads need (the caller's barrier follows)."""
    for g in range(len(q)):
        store_p(cfg, wg.smem.sP[g], wg.thr, q[g], first)
    cute.arch.fence_view_async_shared()


def v_operand_fold(cfg, wg, out: OutputAccumulator, v: list, p: list, al: tuple, sigma: list):
    """Token-wise V: ``P'_g = P s'_V[g] / sigma_g`` (FP16) per channel group ``g`` into its B operand
    (:func:`p_operands`), the offset corrections gathered into ``out.corr`` (rescaled by ``al``,
    :func:`gather_offset_corrections`); then the fence and barrier the wgmma reads need. ``v[g]`` holds the
    group's ``(s', z')`` of this thread's two rows, ``sigma`` the new units."""
    q = p_operands(cfg, v, p, sigma)
    gather_offset_corrections(cfg, out, v, p, q, sigma, al)
    store_p_operands(cfg, wg, q)
    cute.arch.barrier(barrier_id=wg.thr.bar_id, number_of_threads=THREADS)


def p_tilde(cfg, p: list) -> list:
    """Channel-wise V's ``P~`` of this thread's elements ``p``: ``P v_factors[h]`` in FP16, ``h`` the element's token
    half (V^T by placement: each half's products in the units of the higher half's codes; by injection ``fp16(P)``).
    Column-major ``P`` (a token's two columns one FP16 pair, :func:`store_p`): ``fp16(P) v_factors[h]``, one
    ``mul.rn.f16x2`` a pair, exact but where ``fp16(P)`` is subnormal; else ``fp16(P v_factors[h])``. Either way
    ``P~ / v_factors[h]`` is :func:`foscar.decode_folded`'s ``fp16(P)`` but below FP16's normal range."""
    f = cfg.v_factors
    if cutlass.const_expr(cfg.p_column_major and f != (1.0, 1.0)):
        return scaled_pairs(p, [Uint32(f16_power_word(x)) if x != 1.0 else None for x in f])
    return [Float16(x * f[row_half(e)] if f[row_half(e)] != 1.0 else x) for e, x in enumerate(p)]


def f16_power_word(x: float) -> int:
    """:func:`~foscar.cute.ptx.f16_pair_word` of ``x``, a power of two in FP16's normal range."""
    m, e = math.frexp(x)
    assert m == 0.5 and -13 <= e <= 16, x
    return f16_pair_word(x)


@cute.jit
def publish_p(cfg, wg, p: list, buf):
    """Channel-wise V: a pass's ``P~`` (:func:`p_tilde` of this thread's elements ``p``) into the B operand, and (but
    where V^T's extra m64 block sums them) each warp's column sums of ``P``, as the MMA consumes it (``P~ /
    v_factors[h]``: its 16 token rows of each tile of the pass), into slots ``cols..2 cols - 1`` of ``sRed``'s buffer
    ``buf``, then the proxy fence the wgmma reads need; the caller's barrier publishes both (:func:`p_column_sums`)."""
    thr = wg.thr
    q = p_tilde(cfg, p)
    store_p(cfg, wg.smem.sP[0], thr, q)
    if cutlass.const_expr(cfg.column_sum_mma):  # the tensor core sums them (v_acc_fold_product)
        return cute.arch.fence_view_async_shared()
    slots = len(q) // 2
    inv = [1.0 / f for f in cfg.v_factors]
    ps = [unfactored(q[e], inv[row_half(e)]) + unfactored(q[e2], inv[row_half(e2)])
          for e, e2 in map(slot_elements, range(slots))]
    for sh in cutlass.range_constexpr(3):
        for k in cutlass.range_constexpr(slots):
            ps[k] = ps[k] + cute.arch.shuffle_sync_bfly(ps[k], 4 << sh)
    if cutlass.const_expr(thr.pair):  # two tiles a pass: the same heads of the other tile, two quads over
        for k in cutlass.range_constexpr(slots):
            ps[k] = ps[k] + cute.arch.shuffle_sync_bfly(ps[k], 2)
    sRed = wg.smem.sRed
    lane = thr.lane
    warp = thr.warp
    cols = cfg.cols
    if lane < 4:
        for k in cutlass.range_constexpr(slots):
            sRed[buf, warp, cols + slot_column(k, 2 * lane)] = ps[k]  # two tiles a pass: lanes 2, 3 as 0, 1
    cute.arch.fence_view_async_shared()


def unfactored(x: Float16, inv: float) -> Float32:
    """A ``P~`` element in ``P``'s units (``inv``: its half's ``1 / v_factors[h]``, a power of two)."""
    return Float32(x) * inv if inv != 1.0 else Float32(x)


def p_column_sums(cfg, wg, buf, slots: int) -> list:
    """The column sums of a pass's ``P`` as consumed (the four warps' of :func:`publish_p`, after the barrier), by this
    thread's column slot (two tiles a pass: quads 2 and 3 read the copies lanes 2 and 3 published of their
    heads); None where the tensor core sums them (:attr:`~foscar.cute.config.Sm90Config.column_sum_mma`)."""
    if cutlass.const_expr(cfg.column_sum_mma):
        return None
    sRed = wg.smem.sRed
    col0 = 2 * wg.thr.quad
    psum = [sRed[buf, 0, cfg.cols + slot_column(k, col0)] for k in range(slots)]
    for wi in range(1, 4):
        for k in range(slots):
            psum[k] = psum[k] + sRed[buf, wi, cfg.cols + slot_column(k, col0)]
    return psum


@cute.jit
def v_acc_fold_product(cfg, wg, out: OutputAccumulator, regs, psum: list, al=None, regs_b=None):
    """Channel-wise V: the pass's partial ``V^T P~^T`` (``P~`` in shared memory, :func:`publish_p`; two tiles a pass:
    both tiles' products, ``regs_b`` the second's words, in one partial), centred, scaled per channel (``regs.vpar``:
    the group's ``(s', z')`` of this thread's accumulator channels) and added to the accumulator, rescaled first by
    ``al`` (by column slot) where given: ``s' (part - c sum P) + mid sum P`` (``psum``: :func:`p_column_sums`, or None:
    V^T's extra m64 block sums them beside the product, :mod:`foscar.cute.pivot`; ``c`` the middle code's operand). V^T
    by placement: the partial in the products' units, its scale ``s' v_unit``."""
    accO, tOrV, tOrP = out.acc, wg.frags.tOrV, wg.frags.tOrP[0]
    n_kb = cute.size(tOrV, mode=[2])
    accT = cute.make_rmem_tensor(accO.layout, Float32)
    # the first MMA overwrites them (pv_mma's overwrite) but at 8 columns of the tiled MMA, where zeros moved in take
    # fewer instructions (ptxas zeroes by the first MMA itself) than a second atom's descriptors
    zeroing = wg.descs is not None or cfg.cols > HEADS
    sums = cute.make_rmem_tensor(wg.frags.thr_pv.partition_shape_C((TILE, cfg.cols)), Float32) if cfg.column_sum_mma \
        else None
    if cutlass.const_expr(not zeroing):
        for t in [accT] if sums is None else [accT, sums]:
            t.fill(0.0)
    tiles = [regs] if regs_b is None else [regs, regs_b]
    for i in cutlass.range_constexpr(len(tiles)):
        build_vt_registers(cfg, wg.frags.tOrV_u32, tiles[i].vw)
        if cutlass.const_expr(sums is not None and i == 0):  # the pass's second tile takes them as they are
            set_sum_a(cfg, wg.frags.sum_a)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(n_kb):
            pv_mma(cfg, wg, accT, tOrV, tOrP, kb, i * n_kb, overwrite=zeroing and i == 0 and kb == 0)
            if cutlass.const_expr(sums is not None):  # the column sums beside the product
                sum_mma(cfg, wg, sums, kb, i * n_kb, overwrite=zeroing and i == 0 and kb == 0)
        warpgroup.commit_group()
        warpgroup.wait_group(0)  # V^T's registers are built again for the next tile
    if cutlass.const_expr(sums is not None):  # each thread's row-0 elements: its columns' sums
        psum = [sums[slot_elements(k)[0]] for k in range(2 * cfg.nb)]
    by_channel = channel_terms(cfg, regs.vpar, cute.size(accO))
    for e in cutlass.range_constexpr(cute.size(accO)):
        k = o_slot(e, cfg.nb)
        acc_e = accO[e]
        if cutlass.const_expr(al is not None):
            acc_e = acc_e * al[k]
        part_scale, offset = by_channel[(o_block(e, cfg.nb), row_half(e))]
        accO[e] = accT[e] * part_scale + (psum[k] * offset + acc_e)  # s' part + (z' + (mid - c) s') sum P


def channel_terms(cfg, vpar: cute.Tensor, n: int) -> dict:
    """Channel-wise V: each accumulator channel's ``(s' v_unit, z' + (mid - c) s')`` from ``vpar`` (the ``(s', z')``
    of accumulator element ``e`` at ``2 e``, ``2 e + 1``; ``n`` elements), once per channel: by its m64 block and row
    half (:func:`~foscar.cute.fragment.o_block`, :func:`~foscar.cute.fragment.row_half`), whatever the column."""
    centre = cfg.v_mid - cfg.v_pivots[0] * cfg.v_factors[0]  # mid - c, in the values' units
    terms = {}
    for e in range(n):
        key = (o_block(e, cfg.nb), row_half(e))
        if key not in terms:
            vs = vpar[2 * e]
            terms[key] = (vs * cfg.v_unit if cfg.v_unit != 1.0 else vs, vpar[2 * e + 1] + centre * vs)
    return terms


@cute.jit
def v_acc_fold(cfg, wg, out: OutputAccumulator, regs, p: list, al: tuple, buf):
    """Channel-wise V with the eager rescale: ``P~`` is the B operand (:func:`publish_p`, one barrier), then
    :func:`v_acc_fold_product` with the tile's rescale ``al``."""
    publish_p(cfg, wg, p, buf)
    cute.arch.barrier(barrier_id=wg.thr.bar_id, number_of_threads=THREADS)
    v_acc_fold_product(cfg, wg, out, regs, p_column_sums(cfg, wg, buf, len(p) // 2), al)


@cute.jit
def add_offset_corrections(out: OutputAccumulator, g: cutlass.Constexpr, sSum: cute.Tensor, thr,
                           last: cutlass.Constexpr = False):
    """The offset corrections of channel group ``g`` gathered per element join the accumulator elements of
    the group's channels (in units of its ``sigma``); ``last`` (the split's end), the pivot sums too."""
    if cutlass.const_expr(last and out.pivot is not None):
        pivot_corrections(out, thr)
    cs = column_sums(out.corr[g], sSum, thr)
    accO = out.acc
    nb = out.nb
    inv = power_of_two_reciprocal(out.sigma[g])
    cs = [c * inv for c in cs]  # in units of sigma
    if cutlass.const_expr(out.unit != 1.0):  # the accumulator in units of sigma * unit (a power of two)
        cs = [c * (1.0 / out.unit) for c in cs]
    by_class = [cs, cs if out.row_scale == 1.0 else [c * out.row_scale for c in cs]]  # row class 1: row_scale more
    for e in cutlass.range_constexpr(cute.size(accO)):
        if cutlass.const_expr(out.group(e) == g):
            accO[e] = accO[e] + by_class[row_half(e)][o_slot(e, nb)]
    out.corr[g].fill(0.0)


def fold_corrections(cfg, out: OutputAccumulator, sSum: cute.Tensor, thr, last: bool = False):
    """Every channel group's gathered offset corrections into the accumulator (``last``: the split's end, where
    the pivot sums join them)."""
    for g in range(len(out.sigma)):
        add_offset_corrections(out, g, sSum, thr, last)
