"""Two 64-token KV tiles per pass of the online softmax (``Sm90Config.tiles_per_pass == 2``, v1).

With at most four query heads per KV head, half of the S^T accumulator's N columns are padding (BF16 K) or
hold Q's ``lo`` term, summed away before the softmax (E4M3 K): quads 2 and 3 of every lane group hold no
score of their own, yet every warp instruction of the softmax runs on all lanes. A pass takes two tiles,
``A`` and ``B``: both QK products, then one butterfly shuffle per element moves B's heads 0-3 into quads 2
and 3 (:func:`join_tiles`), and the scores' fold, the column maxima, the exponentials and the P' build run
once for both tiles. Each thread then holds the elements of one tile: heads ``col0``, ``col0 + 1`` of tile
``half`` (:class:`~foscar.cute.warpgroup.WarpgroupThread`), with that tile's ``(s', z')`` of its rows; the
column reductions add one shuffle to join a head's two tiles (:mod:`foscar.cute.softmax`). The pass's P'
holds both tiles' tokens (B's from row 64), and O^T takes the two PV products, one per tile's V^T.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import warpgroup

from .config import CORRECTION_TILES, TILE
from .folds import fold_corrections, v_acc_fold_product
from .lazy import lazy_softmax, lazy_softmax_acc_fold
from .operands import build_vt_registers
from .operands_e4m3 import sum_q_terms, term_columns
from .ring import StageRing, ring_phase, ring_slot
from .warpgroup import RunningState, TileRegisters, Warpgroup, tile_scales


@cute.jit
def join_tiles(cfg, acc_a: cute.Tensor, acc_b: cute.Tensor, wg: Warpgroup, qinv: list) -> cute.Tensor:
    """The pass's S^T elements of this thread, in ``acc_a``: tile A's in quads 0 and 1, tile B's heads in
    quads 2 and 3 (element ``e``: head ``col0 + e % 2``). E4M3 K operands with the ``lo`` terms two quads
    over (``gp`` 4): the shuffle that moves B also brings each head's other term, and the terms are summed
    here (``(hi + lo / 16) 2^-e``, ``qinv``: the ``2^-e`` of this thread's two columns); else each tile's terms
    are summed first (:func:`sum_q_terms`)."""
    thr = wg.thr
    half = thr.half
    if cutlass.const_expr(cfg.k_e4m3 and term_columns(cfg.gqa) == 4):
        for e in cutlass.range_constexpr(cute.size(acc_a)):
            mine = acc_a[e]
            send = acc_b[e]
            if half == 1:  # quads 2, 3 hold the lo terms of both tiles: keep B's, send A's
                mine = acc_b[e]
                send = acc_a[e]
            other = cute.arch.shuffle_sync_bfly(send, 2)
            hi = mine
            lo = other
            if half == 1:
                hi = other
                lo = mine
            s = (hi + lo * 0.0625) * qinv[e % 2]
            if cutlass.const_expr(cfg.gqa < 4):
                if thr.col0 + e % 2 >= cfg.gqa:  # a padded head
                    s = Float32(0.0)
            acc_a[e] = s
    else:
        if cutlass.const_expr(cfg.k_e4m3):  # each tile's scores in its quads 0 and 1 (2^-e by quad)
            sum_q_terms(acc_a, cfg.gqa, thr.quad, qinv[0], qinv[1])
            sum_q_terms(acc_b, cfg.gqa, thr.quad, qinv[0], qinv[1])
        for e in cutlass.range_constexpr(cute.size(acc_a)):
            moved = cute.arch.shuffle_sync_bfly(acc_b[e], 2)
            if half == 1:
                acc_a[e] = moved
    return acc_a


@cute.jit
def pair_step(kern, wg: Warpgroup, regs: TileRegisters, regs_b: TileRegisters, state: RunningState, step, t0,
              t0_b, scales=None, release=None, qbuf=None) -> RunningState:
    """One pass over tiles A (words in ``regs``, starting at token ``t0``) and B (``regs_b``, ``t0_b``; the
    sequence's length or more when the warpgroup has no second tile: its rows are masked). ``regs.par``
    holds the ``(s', z')`` of this thread's rows in its own tile (``half``). ``step``: the pass's index in
    the warpgroup's sequence. The same folds as :meth:`~foscar.cute.warpgroup.TileKernel._tile_step`, with
    the online softmax's rescale made lazy (:func:`~foscar.cute.lazy.lazy_softmax`). FP4 formats: ``scales``, the
    block-scale words of tiles A and B (:mod:`foscar.cute.operands_fp4`; MXFP4: a third, those of this thread's
    tile), and ``release`` called once V^T's registers of both are built. Channel-wise K (both tiles in one token
    group): ``qbuf``, the group's ``Q'`` buffer, its terms' ``2^-e`` and offset corrections
    (:func:`~foscar.cute.fold_terms.fold_q_terms`), and ``release`` (the producer's ``Q'``) called once the scores
    are formed."""
    cfg = kern.cfg
    thr = wg.thr
    frags = wg.frags
    t_own = t0
    if thr.half == 1:
        t_own = t0_b
    fp4 = cfg.fp4_block > 0
    if cutlass.const_expr(cfg.fp4_mx):  # own rows' s' (scales[2]: its tile's stage) and both tiles' V scale bits
        from .operands_fp4 import mx_row_params, mx_views, publish_v_scale_bits
        mx_row_params(cfg, regs.par, scales[2][0], scales[2][1], thr.row0)
        publish_v_scale_bits(cfg, mx_views(wg.smem.sMx)[0], scales[0][1], scales[1][1], step & 1, thr.tidx)
    sc = tile_scales(cfg, regs.par, t_own, thr.row0, wg.n)
    if cutlass.const_expr(cfg.qk_promote):  # each tile's k-steps in FP32 registers: one tile in flight at a time
        parts_a = kern._qk(wg, regs, sc, t0, None, False, scales=scales[0] if fp4 else None)
        parts_b = kern._qk(wg, regs_b, sc, t0_b, frags.accS_b, False, scales=scales[1] if fp4 else None)
    else:  # both tiles' QK products in flight together, one wait for both
        parts_a, steps_a = kern._qk(wg, regs, sc, t0, None, False, qbuf, scales[0] if fp4 else None, wait=False)
        parts_b, steps_b = kern._qk(wg, regs_b, sc, t0_b, frags.accS_b, False, qbuf,
                                    scales[1] if fp4 else None, wait=False)
        warpgroup.wait_group(0)
        parts_a = kern._qk_finish(wg, parts_a, steps_a, False)
        parts_b = kern._qk_finish(wg, parts_b, steps_b, False)
    qinv = wg.qinv
    if cutlass.const_expr(cfg.k_channel):  # the group's 2^-e of this thread's two columns
        qinv = [wg.smem.sKf[qbuf, cfg.cols + thr.col0 + j] for j in range(2)]
    parts = [join_tiles(cfg, parts_a[i], parts_b[i], wg, qinv) for i in range(len(parts_a))]
    s = kern._scores(wg, regs, sc, parts, qbuf=qbuf, mu=state.softmax.m, summed=True)  # less the maxima (lazy)
    if cutlass.const_expr(cfg.mask_branch):  # the pass that reaches the end (tile B at the length where none)
        s, sc = kern._mask_branch(wg, sc, s, t_own, t0_b)
    if cutlass.const_expr(release is not None and not fp4):  # the stage's Q' read: the producer may refill it
        release()
    if cutlass.const_expr(cfg.v_channel):  # P~ of both tiles, one acc-fold of both tiles' products
        softmax, out, psum = lazy_softmax_acc_fold(cfg, wg, state, s, step)
        v_acc_fold_product(cfg, wg, out, regs, psum, regs_b=regs_b)
        return RunningState(softmax, out, state.kgroup)
    softmax, out = lazy_softmax(cfg, wg, state, sc, s, step)
    if cutlass.const_expr(cfg.fp4_mx):
        from .operands_fp4 import build_vt_registers_mx, mx_views
        bits32 = mx_views(wg.smem.sMx)[1]
        build_vt_registers_mx(cfg, frags.tOrV_u32, regs.vw, bits32, thr, step & 1, 0)
        kern._pv(wg, out, 0)
        build_vt_registers_mx(cfg, frags.tOrV_u32, regs_b.vw, bits32, thr, step & 1, TILE)
        release()
    elif cutlass.const_expr(fp4):
        from .operands_fp4 import build_vt_registers_fp4
        build_vt_registers_fp4(cfg, frags.tOrV_u32, regs.vw, scales[0][1], thr, wg.n - t0)
        kern._pv(wg, out, 0)
        build_vt_registers_fp4(cfg, frags.tOrV_u32, regs_b.vw, scales[1][1], thr, wg.n - t0_b)
        release()
    else:
        build_vt_registers(cfg, frags.tOrV_u32, regs.vw)
        kern._pv(wg, out, 0)
        build_vt_registers(cfg, frags.tOrV_u32, regs_b.vw)
    kern._pv(wg, out, cute.size(frags.tOrV, mode=[2]))
    passes = CORRECTION_TILES // 2
    if step & (passes - 1) == passes - 1:  # step % passes (passes a power of two, step >= 0)
        fold_corrections(cfg, out, wg.smem.sSum, thr)
    return RunningState(softmax, out, state.kgroup)


@cute.jit
def second_tile_start(tile_b, t_hi, n):
    """Token of tile B's start, or ``n`` (every row masked) when the warpgroup has no tile B."""
    t0_b = tile_b * TILE
    if tile_b >= t_hi:
        t0_b = n
    return t0_b


@cute.jit
def wait_pass(ring: StageRing, c, k, has_b, stages: int):
    """``(slot, slot_b)``: the stages of consumer ``c``'s pass of two tiles, its ``k``-th (``k`` even) and, where
    ``has_b``, its next (``k + 1``: the next slot, in the same phase), once the producer has filled them; without a
    tile B, ``slot_b`` is tile A's (its words read again, its rows masked)."""
    slot = ring_slot(c, k, stages)
    slot_b = slot
    if has_b:
        slot_b = slot + 1
    cute.arch.mbarrier_wait(ring.full + slot, ring_phase(k, stages))
    if has_b:
        cute.arch.mbarrier_wait(ring.full + slot_b, ring_phase(k, stages))
    return slot, slot_b
