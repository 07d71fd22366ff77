"""One computing warpgroup of the Hopper decode kernels: its state and its work on one 64-token KV tile.

The state is held in small objects built while the kernel is traced (their fields are DSL values):

- :class:`WarpgroupThread`: the thread's coordinates in its warpgroup and the warpgroup's named barrier;
- :class:`WarpgroupSmem`: the shared-memory buffers it reads and writes;
- :class:`Fragments`: the thread slices of the two products' register fragments;
- :class:`TileRegisters`: a tile's packed words and ``(s', z')`` in registers;
- :class:`Warpgroup`: all of the above with the MMA atoms, the softmax scale and the quantized length;
- :class:`RunningState`: what changes from tile to tile (:class:`~foscar.cute.softmax.OnlineSoftmax`,
  :class:`~foscar.cute.folds.OutputAccumulator`, the token group whose ``Q'`` is in shared memory),
  carried by the kernels' run-time tile loops.

:class:`TileKernel`, the base of both kernels, holds the tile step in named steps (:meth:`~TileKernel._qk`,
:meth:`~TileKernel._scores`, the online softmax, :meth:`~TileKernel._pv`) and the epilogue.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.cute.nvgpu import warpgroup

from ..format import P_UNITS_START
from .config import CORRECTION_TILES, TILE, Sm90Config
from .wgmma import pv_mma, qk_mma
from .fragment import o_slot, row_half, s_slot, slot_column
from .ring import split_tiles_each
from .fold_map import k_fold_buffer
from .folds import (
    OutputAccumulator,
    p_units_bound,
    fold_corrections,
    k_acc_fold,
    k_operand_fold,
    k_operand_fold_scores,
    less_maxima,
    p_scales,
    v_acc_fold,
    v_acc_fold_product,
    v_operand_fold,
)
from .operands import build_k_registers, build_vt_registers, sqk_buffer_units
from .operands_e4m3 import build_k_registers_e4m3, scale_stacked_terms, sum_q_terms, sum_term_blocks
from .lazy import EMPTY_PAIR, lazy_softmax, lazy_softmax_acc_fold
from .limits import quantized_length
from .pivot import set_sum_a, sum_a_operand, sum_mma
from .softmax import OnlineSoftmax, column_sums, tile_maxima


class WarpgroupThread:
    """Thread ``tidx`` (0..127) of a warpgroup: its warp and lane, ``quad`` (its S^T columns are ``2 quad``
    and ``2 quad + 1``) and ``row0`` (its token rows of a tile, ``row0`` and ``row0 + 8``); ``bar_id`` is the
    warpgroup's named barrier. The softmax elements it holds: heads ``col0`` and ``col0 + 1`` of the tile
    ``half`` of a pass, rows ``prow0`` and ``prow0 + 8`` of the pass's P' (``pair``, two tiles per pass:
    quads 2 and 3 hold the second tile's heads 0-3, :mod:`foscar.cute.pair`; else ``2 quad``, 0, ``row0``)."""

    def __init__(self, tidx, bar_id: int, pair: bool = False):
        self.tidx = tidx
        self.warp = tidx // 32
        self.lane = tidx % 32
        self.quad = self.lane % 4
        self.row0 = 16 * self.warp + self.lane // 4
        self.bar_id = bar_id
        self.pair = pair

    # properties, not fields: the arithmetic is traced where it is used
    @property
    def col0(self):
        return 2 * (self.quad % 2) if self.pair else 2 * self.quad

    @property
    def half(self):
        return self.quad // 2 if self.pair else 0

    @property
    def prow0(self):
        return self.row0 + TILE * self.half if self.pair else self.row0


class WarpgroupSmem:
    """A warpgroup's shared memory: Q^T (``sQ``) and ``sum(Q)`` (``sQsum``), shared by the CTA's warpgroups;
    its own B operands of O^T (``sP``, one per V channel group: two entries, the same buffer for one group),
    the reduction slots (``sRed``: two tiles' buffers), the column sums (``sSum``), and for channel-wise K
    the buffers of the folded ``Q'`` (``sQk``: the warpgroup's two, or one a stage where the producer folds) with
    their offset corrections (``sKf``, :func:`foscar.cute.folds.fold_q`); for E4M3 K operands ``sQinv`` and ``sQred``
    (:func:`foscar.cute.operands.stage_q`); for MXFP4 the V scale bits ``sMx``."""

    def __init__(self, sQ, sQsum, sP: list, sRed, sSum, sQk, sKf, sQinv=None, sQred=None, sMx=None):
        self.sMx = sMx  # MXFP4: the V scale bits (Int32 words, :func:`foscar.cute.operands_fp4.publish_v_scale_bits`)
        self.sQinv = sQinv  # E4M3 K operands: each column's 2^-e (Q's terms are scaled by 2^e)
        self.sQred = sQred  # E4M3 K operands: the scratch of Q's per-head maxima
        self.sQ = sQ
        self.sQsum = sQsum
        self.sP = sP
        self.sRed = sRed
        self.sSum = sSum
        self.sQk = sQk
        self.sKf = sKf


class Fragments:
    """The thread slices of the S^T product (A: K from registers, ``tSrK`` and its Uint32 view; B: Q^T or
    the ``Q'`` buffers in shared memory; C: ``accS``) and of the O^T product (``thr_pv``; A: V^T from registers; B: the
    P' buffers, one per V channel group)."""

    def __init__(self, cfg: Sm90Config, qk_mma, pv_mma, smem: WarpgroupSmem, tidx):
        D = cfg.head_dim
        thr_qk = qk_mma.get_slice(tidx)
        self.tSrK = thr_qk.make_fragment_A(thr_qk.partition_shape_A((TILE, D)))
        self.tSrK_u32 = cute.recast_tensor(self.tSrK, Uint32)
        self.tSrQ = None if cfg.k_channel else thr_qk.make_fragment_B(thr_qk.partition_B(smem.sQ))
        self.tSrQk = thr_qk.make_fragment_B(thr_qk.partition_B(smem.sQk)) if cfg.k_channel else None
        self.accS = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE, cfg.qk_cols)), Float32)
        self.accS_b = None  # two tiles per pass, or overlapped: the second tile's S^T
        if cfg.tiles_per_pass == 2 or cfg.overlap:
            self.accS_b = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE, cfg.qk_cols)), Float32)
        self.tSrK_b = self.tSrK_b_u32 = None  # overlapped: the second tile's K, built while the first's is in use
        if cfg.overlap:
            self.tSrK_b = thr_qk.make_fragment_A(thr_qk.partition_shape_A((TILE, D)))
            self.tSrK_b_u32 = cute.recast_tensor(self.tSrK_b, Uint32)
        self.thr_pv = pv_mma.get_slice(tidx)
        self.tOrV = self.thr_pv.make_fragment_A(self.thr_pv.partition_shape_A((D, TILE)))
        self.tOrV_u32 = cute.recast_tensor(self.tOrV, Uint32)
        self.tOrP = [self.thr_pv.make_fragment_B(self.thr_pv.partition_B(sP)) for sP in smem.sP]
        self.sum_a = sum_a_operand(cfg)  # V^T's extra m64 block's A (foscar.cute.pivot), or None


class TileRegisters:
    """One tile in this thread's registers: its packed K words (``kw``) and V words (``vw[mh, vb]``), the
    ``(s', z')`` of its two token rows (``par``: K's, row ``r`` group ``c`` at ``(r * kc + c) * 2``, then V's
    from ``4 * kc``; channel-wise K: its channel's at 0 and 1) and, channel-wise V, the token group's
    ``(s', z')`` of its accumulator channels (``vpar``)."""

    def __init__(self, kw: cute.Tensor, vw: cute.Tensor, par: cute.Tensor, vpar: cute.Tensor):
        self.kw = kw
        self.vw = vw
        self.par = par
        self.vpar = vpar


class Warpgroup:
    """A computing warpgroup's fixed context for its tiles: ``qsum`` is ``sum(Q)`` of this thread's columns
    (by column slot; the acc-fold's offset term, first channel group), ``n`` the sequence's quantized length,
    ``qinv`` (E4M3 K operands) the ``2^-e`` of the same columns (by column slot); ``limits`` (a step of several tokens) each
    column's causal limit, the tokens it sees (:func:`~foscar.cute.limits.causal_limits`); ``mask_from`` no later than
    the first token any score is masked at (:func:`~foscar.cute.limits.first_masked`,
    :attr:`~foscar.cute.config.Sm90Config.mask_branch`)."""

    def __init__(self, thr: WarpgroupThread, smem: WarpgroupSmem, frags: Fragments, qk_mma, pv_mma, qsum: list,
                 n, qk_scale: Float32, qinv: tuple | None = None, limits: list | None = None, mask_from=None,
                 qk_mma0=None, descs=None):
        self.descs = descs  #: two-tile passes' own wgmma: the B descriptors of Q and P' (:mod:`foscar.cute.wgmma`)
        self.limits = limits
        self.mask_from = n if mask_from is None else mask_from
        self.qinv = qinv  # E4M3 K operands: the 2^-e of this thread's two head columns
        self.thr = thr
        self.smem = smem
        self.frags = frags
        self.qk_mma = qk_mma
        self.pv_mma = pv_mma
        self.qsum = qsum
        self.n = n
        self.qk_scale = qk_scale
        self.qk_mma0 = qk_mma0  #: an accumulator's first QK MMA's atom, or None (:func:`~.operands.zeroing_qk_mma`)


class TileScales:
    """A tile's ``(s', z')`` for this thread's two token rows: ``k = (s'_0, z'_0, s'_1, z'_1)`` of token-wise
    K's first channel group (channel-wise K: its channel's ``(s', z')`` first), ``v[g]`` the same for V
    channel group ``g``, zero on rows past the sequence (``valid``: whether each row is inside it)."""

    def __init__(self, k: tuple, v: list, valid: tuple):
        self.k = k
        self.v = v
        self.valid = valid

    def v_scales(self) -> list:
        """Per V channel group, this thread's two rows' bounds on the ``P'`` units (:func:`p_units_bound`)."""
        return [(p_units_bound(v[0], v[1]), p_units_bound(v[2], v[3])) for v in self.v]


class RunningState:
    """What one warpgroup carries from tile to tile: the online softmax, the output accumulator and, for
    channel-wise K, the token group ``kgroup`` whose ``Q'`` sits in shared memory (-1: none yet)."""

    def __init__(self, softmax: OnlineSoftmax, out: OutputAccumulator, kgroup: Int32):
        self.softmax = softmax
        self.out = out
        self.kgroup = kgroup

    def __extract_mlir_values__(self):
        return (self.softmax.__extract_mlir_values__() + self.out.__extract_mlir_values__()
                + [self.kgroup.ir_value()])

    def __new_from_mlir_values__(self, values) -> RunningState:
        m = len(self.softmax.__extract_mlir_values__())
        n = len(self.out.sigma)
        return RunningState(self.softmax.__new_from_mlir_values__(values[:m]),
                            self.out.__new_from_mlir_values__(values[m:m + n]), Int32(values[m + n]))


def allocate_registers(cfg: Sm90Config, frags: Fragments, prefetch: bool):
    """A computing warpgroup's register tensors, zeroed where they accumulate: ``(state, regs, regs_next)``,
    the :class:`RunningState` before the first tile, the current tile's :class:`TileRegisters` and, with
    ``prefetch``, a second tile's (v0's software pipeline: the next tile; two tiles a pass: tile B; else
    None). Allocated here, in one fixed order:
    the order of the register tensors is the order of the kernel's loop-carried registers in the PTX."""
    acc = cute.make_rmem_tensor(frags.thr_pv.partition_shape_C((cfg.head_dim, cfg.cols)), Float32)
    acc.fill(0.0)
    kw = cute.make_rmem_tensor(cute.make_layout(cfg.k_words), Int32)
    vw = cute.make_rmem_tensor(cute.make_layout((cfg.mh, cfg.v_blocks)), Int32)
    slots = 2 * cfg.nb  # column slots per thread: the sums and corrections join a slot's two token rows
    sums = cute.make_rmem_tensor(cute.make_layout(slots), Float32)
    corr = [cute.make_rmem_tensor(cute.make_layout(slots), Float32) for _ in range(2)]  # one per V channel group
    sums.fill(0.0)
    for c in corr:
        c.fill(0.0)
    words_next = []
    if prefetch:
        words_next = [cute.make_rmem_tensor(cute.make_layout(cfg.k_words), Int32),
                      cute.make_rmem_tensor(cute.make_layout((cfg.mh, cfg.v_blocks)), Int32)]
    par = [cute.make_rmem_tensor(cute.make_layout(cfg.par_words), Float32) for _ in range(1 + prefetch)]
    vpar = [cute.make_rmem_tensor(cute.make_layout(2 * cfg.acc_elems), Float32) for _ in range(1 + prefetch)]
    # every column empty: its maximum -inf, or with the lazy rescale's relative scores 0 and a threshold of -inf
    m0 = 0.0 if cfg.lazy_rescale else -Float32.inf
    thr = [Float32(-Float32.inf) for _ in range(2 * cfg.nb)] if cfg.lazy_rescale else None
    if cfg.pair_vote:  # the thresholds in P's domain, FP16 pairs
        thr = [Uint32(EMPTY_PAIR) for _ in range(cfg.nb)]
    softmax = OnlineSoftmax([Float32(m0) for _ in range(2 * cfg.nb)], sums, guard=cfg.causal, thr=thr)
    sigma0 = 1.0 if cfg.v_channel else P_UNITS_START  # token-wise V: the tiles' p_units_bound raise it
    pivot = None
    if cfg.pivot_mma:  # the C fragment of V^T's extra m64 block (its row 0: the pivot sums)
        pivot = cute.make_rmem_tensor(frags.thr_pv.partition_shape_C((TILE, cfg.cols)), Float32)
        pivot.fill(0.0)
    out = OutputAccumulator(acc, [Float32(sigma0) for _ in range(cfg.vc)], corr[:cfg.vc], cfg.nb, cfg.mh, cfg.acc_unit,
                            pivot, float(2 ** (cfg.v_row_shls[1] - cfg.v_row_shls[0])))
    regs = TileRegisters(kw, vw, par[0], vpar[0])
    regs_next = TileRegisters(words_next[0], words_next[1], par[1], vpar[1]) if prefetch else None
    return RunningState(softmax, out, Int32(-1)), regs, regs_next


@cute.jit
def tile_scales(cfg: Sm90Config, par: cute.Tensor, t0, row0, n) -> TileScales:
    """The :class:`TileScales` of the tile starting at token ``t0`` from its registers ``par``: rows past
    the length get zero V ``(s', z')``, so whatever the page holds there never reaches P' (``cfg.mask_branch``:
    only in the tiles that reach a limit, :meth:`TileKernel._mask_branch`)."""
    ks0, kz0, ks1, kz1 = par[0], par[1], par[2], par[3]
    vo = cfg.k_par_words  # V's (s', z') after K's: row r, group c at vo + (r * vc + c) * 2
    vs0, vz0, vs1, vz1 = par[vo], par[vo + 1], par[vo + 2 * cfg.vc], par[vo + 2 * cfg.vc + 1]
    valid0 = t0 + row0 < n
    valid1 = t0 + row0 + 8 < n
    if cutlass.const_expr(not cfg.mask_branch):
        vs0, vz0, vs1, vz1 = zero_rows_past(vs0, vz0, vs1, vz1, valid0, valid1)
    v = [(vs0, vz0, vs1, vz1)]
    if cutlass.const_expr(cfg.vc == 2):  # token-wise V, the second channel group's (s', z') of both rows
        ws0, wz0, ws1, wz1 = par[vo + 2], par[vo + 3], par[vo + 6], par[vo + 7]
        if cutlass.const_expr(not cfg.mask_branch):
            ws0, wz0, ws1, wz1 = zero_rows_past(ws0, wz0, ws1, wz1, valid0, valid1)
        v.append((ws0, wz0, ws1, wz1))
    return TileScales((ks0, kz0, ks1, kz1), v, (valid0, valid1))


@cute.jit
def zero_rows_past(s0: Float32, z0: Float32, s1: Float32, z1: Float32, valid0, valid1) -> tuple:
    """A V channel group's ``(s', z')`` of a thread's two token rows, zero on a row past the length."""
    if not valid0:
        s0 = Float32(0.0)
        z0 = Float32(0.0)
    if not valid1:
        s1 = Float32(0.0)
        z1 = Float32(0.0)
    return s0, z0, s1, z1


class TileKernel:
    """The base of both Hopper kernels: the tile step of a computing warpgroup and its epilogue."""

    consumers = 1  #: computing warpgroups, on alternating tiles (v1: :data:`~foscar.cute.config.CONSUMERS`)

    def __init__(self, cfg: Sm90Config):
        self.cfg = cfg

    @cute.jit
    def _split_tiles(self, mSEQ: cute.Tensor, b, split, n_splits, run: int = 1):
        """``(n_quant, t_lo, t_hi)``: the quantized length of sequence ``b`` and the KV tiles of ``split``, each
        split's start a multiple of ``run`` tiles (:attr:`~foscar.cute.config.Sm90Config.tile_run`)."""
        n = quantized_length(self.cfg, mSEQ[b])
        n_tiles = (n + TILE - 1) // TILE
        per = split_tiles_each(n_tiles, n_splits, run)
        t_lo = split * per
        t_hi = cutlass.min(t_lo + per, n_tiles)
        return n, t_lo, t_hi

    @cute.jit
    def _tile_step(self, wg: Warpgroup, regs: TileRegisters, state: RunningState, tile, t0, t_lo, qbuf=None,
                   release=None, scales=None) -> RunningState:
        """One KV tile (starting at token ``t0``; ``tile``: its index in the warpgroup's tile sequence, which
        starts at ``t_lo``) from its words and ``(s', z')`` in registers: S^T = K Q^T with K's fold, the
        online softmax, O^T += V^T P'^T with V's fold (:mod:`foscar.cute.folds`). Channel-wise K: ``qbuf`` the
        tile's ``Q'`` buffer (None: :func:`~foscar.cute.fold_map.k_fold_buffer`'s); ``release``, called once the
        tile's scores are formed (its ``Q'`` read). FP4 formats: ``scales``, the K and V block-scale words of the
        tile's stage (:mod:`foscar.cute.operands_fp4`), and ``release`` called once V^T's registers are built
        (the last read of the stage). Returns the new state."""
        cfg = self.cfg
        if cutlass.const_expr(cfg.k_channel and qbuf is None):
            qbuf = k_fold_buffer(cfg, t0, self.consumers)
        fp4 = cfg.fp4_block > 0
        if cutlass.const_expr(cfg.fp4_mx):  # each row's s' and the V scale bits from the tile's scale bytes
            from .operands_fp4 import mx_row_params, mx_views, publish_v_scale_bits
            mx_row_params(cfg, regs.par, scales[0], scales[1], wg.thr.row0)
            publish_v_scale_bits(cfg, mx_views(wg.smem.sMx)[0], scales[1], scales[1], tile & 1, wg.thr.tidx)
        sc = tile_scales(cfg, regs.par, t0, wg.thr.row0, wg.n)
        accS = self._qk(wg, regs, sc, t0, qbuf=qbuf, scales=scales)
        s = self._scores(wg, regs, sc, accS, t0, qbuf, state.softmax.m if cfg.lazy_rescale else None)
        if cutlass.const_expr(cfg.mask_branch):
            s, sc = self._mask_branch(wg, sc, s, t0, t0)
        if cutlass.const_expr(release is not None and not fp4):
            release()
        softmax = state.softmax
        out = state.out
        if cutlass.const_expr(cfg.lazy_rescale and cfg.v_channel):  # P~ stored under the maxima it has
            softmax, out, psum = lazy_softmax_acc_fold(cfg, wg, state, s, tile)
            v_acc_fold_product(cfg, wg, out, regs, psum)
        elif cutlass.const_expr(cfg.lazy_rescale):  # token-wise V: P' stored under the maxima it has
            softmax, out = lazy_softmax(cfg, wg, state, sc, s, tile)
        else:
            # ---- online softmax; the tile's largest |s'_V| rides in the same reduction -------------------
            tm, tv = tile_maxima(cfg, wg.thr, wg.smem.sRed, tile, s, sc.v_scales())
            al = softmax.advance(tm)
            sigma = p_scales(cfg, wg, out, tile, tv)
            p = softmax.probabilities(s, al)
            # ---- O^T = V^T P'^T -----------------------------------------------------------------------
            if cutlass.const_expr(cfg.v_channel):
                v_acc_fold(cfg, wg, out, regs, p, al, tile & 1)
            else:
                v_operand_fold(cfg, wg, out, sc.v, p, al, sigma)
                out.rescale(al, sigma)  # the accumulator in units of the new sigma
        if cutlass.const_expr(not cfg.v_channel):
            if cutlass.const_expr(cfg.fp4_mx):
                from .operands_fp4 import build_vt_registers_mx, mx_views
                build_vt_registers_mx(cfg, wg.frags.tOrV_u32, regs.vw, mx_views(wg.smem.sMx)[1], wg.thr, tile & 1, 0)
            elif cutlass.const_expr(fp4):
                from .operands_fp4 import build_vt_registers_fp4
                build_vt_registers_fp4(cfg, wg.frags.tOrV_u32, regs.vw, scales[1], wg.thr, wg.n - t0)
            else:
                build_vt_registers(cfg, wg.frags.tOrV_u32, regs.vw)
            if cutlass.const_expr(fp4 and release is not None):  # V^T's registers read the stage's last bytes
                release()
            self._pv(wg, out)
            if (tile - t_lo) & (CORRECTION_TILES - 1) == CORRECTION_TILES - 1:  # a power of two, tile >= t_lo
                fold_corrections(cfg, out, wg.smem.sSum, wg.thr)
        return RunningState(softmax, out, state.kgroup)

    @cute.jit
    def _fold_q(self, wg: Warpgroup, kgroup, t0, param):
        """Channel-wise K, before the tile at token ``t0``: the operand-fold ``Q' = bf16(Q s')`` of its token
        group unless ``Q'`` holds it (``kgroup``, :func:`foscar.cute.folds.k_operand_fold`, ``param`` its
        source of this thread's ``(s', z')``). Returns the token group ``Q'`` holds."""
        cfg = self.cfg
        grp = t0 // cfg.group_size
        if grp != kgroup:
            k_operand_fold(cfg, wg, param, k_fold_buffer(cfg, t0, self.consumers))
            kgroup = grp
        return kgroup

    @cute.jit
    def _qk(self, wg: Warpgroup, regs: TileRegisters, sc: TileScales, t0, accS=None,
            sum_terms: cutlass.Constexpr = True, qbuf=None, scales=None, wait: cutlass.Constexpr = True,
            second: cutlass.Constexpr = False):
        """``S^T = K Q^T`` on ``wgmma.m64n8k16`` (E4M3 K operands: ``m64n8k32``, Q's terms summed after it
        unless ``sum_terms`` is False, or by the tensor core where they are stacked along the contraction, K's A
        registers taken by each term), K built in registers: ``[accS]`` (``frags.accS`` unless given), or
        with two channel groups of a token-wise K one group-local partial each; channel-wise K multiplies
        the tile's ``Q'`` buffer ``qbuf`` (the operand-fold, :meth:`_fold_q`); FP4 formats: FP16 K operands times
        the block scales of ``scales[0]`` (:func:`~foscar.cute.operands_fp4.build_k_registers_fp4`). Returns the
        partials. With ``wait`` False the MMAs are committed and left in flight: returns ``(partials, steps)``
        for :meth:`_qk_finish` after the caller's ``wait_group``. ``second``: K into the fragments' second A registers
        (:attr:`~foscar.cute.config.Sm90Config.overlap`: the first tile's product may still read the first)."""
        cfg = self.cfg
        frags = wg.frags
        tSrK, tSrK_u32 = (frags.tSrK_b, frags.tSrK_b_u32) if second else (frags.tSrK, frags.tSrK_u32)
        if cutlass.const_expr(cfg.fp4_mx):
            from .operands_fp4 import build_k_registers_mx
            build_k_registers_mx(cfg, tSrK_u32, regs.kw, scales[0], wg.thr.row0)
        elif cutlass.const_expr(cfg.fp4_block > 0):
            from .operands_fp4 import build_k_registers_fp4
            build_k_registers_fp4(cfg, tSrK_u32, regs.kw, scales[0], wg.thr.row0)
        elif cutlass.const_expr(cfg.k_e4m3):
            build_k_registers_e4m3(cfg, tSrK_u32, regs.kw)
        else:
            build_k_registers(cfg, tSrK_u32, regs.kw)
        if cutlass.const_expr(accS is None):
            accS = frags.accS
        partials = [accS]
        if cutlass.const_expr(cfg.kc == 2):  # token-wise K, 2 channel groups: the second group's partial
            partials.append(cute.make_rmem_tensor(accS.layout, Float32))
        warpgroup.fence()
        n_kb = cute.size(tSrK, mode=[2])
        # the k-blocks of Q: K's, or (stacked terms) each term's, which take K's A registers again
        n_q = n_kb if cutlass.const_expr(cfg.k_channel) else cute.size(frags.tSrQ, mode=[2])
        steps = []  # FP32 promotion: each FP8 k-step into its own accumulator, summed in FP32 after the MMAs
        if cutlass.const_expr(cfg.qk_promote):
            steps = [accS] + [cute.make_rmem_tensor(accS.layout, Float32) for _ in range(n_kb - 1)]
        zeroing = wg.qk_mma0 is not None
        if cutlass.const_expr(not zeroing):
            for acc in partials + steps[1:]:
                acc.fill(0.0)
        started = []  # the accumulators written so far
        q_units = qbuf * sqk_buffer_units(cfg) if cfg.k_channel and wg.descs is not None else None  # Q''s buffer
        for kb in cutlass.range_constexpr(n_q):
            ka = kb % n_kb
            if cutlass.const_expr(cfg.qk_promote):
                acc = steps[kb]
            elif cutlass.const_expr(cfg.kc == 2 and ka >= n_kb // 2):  # group-local partials: one per group
                acc = partials[1]
            else:
                acc = accS
            q_frag = frags.tSrQk[None, None, kb, qbuf] if cutlass.const_expr(cfg.k_channel) else frags.tSrQ[None, None, kb]
            mma = wg.qk_mma
            if cutlass.const_expr(zeroing and all(a is not acc for a in started)):
                started.append(acc)
                mma = wg.qk_mma0
            qk_mma(wg, mma, acc, tSrK, tSrK_u32, ka, q_frag, kb, q_units)
        warpgroup.commit_group()
        result = (partials, steps)
        if cutlass.const_expr(wait):
            warpgroup.wait_group(0)
            result = self._qk_finish(wg, partials, steps, sum_terms)
        return result

    @cute.jit
    def _qk_finish(self, wg: Warpgroup, partials: list, steps: list, sum_terms: cutlass.Constexpr = True) -> list:
        """The QK partials once their MMAs are done: FP32-promoted k-steps summed into the first partial, Q's
        terms summed (:meth:`_qk`)."""
        cfg = self.cfg
        accS = partials[0]
        if cutlass.const_expr(cfg.qk_promote):
            for i in cutlass.range_constexpr(cute.size(accS)):
                x = steps[0][i]
                for acc in steps[1:]:
                    x = x + acc[i]
                accS[i] = x
        if cutlass.const_expr(cfg.stacked_terms):  # summed by the tensor core: each column's 2^-e (one for
            if cutlass.const_expr(not cfg.shared_q_scale):  # all of them: K's fold takes it, folds.k_acc_fold)
                for part in partials:
                    scale_stacked_terms(part, cfg.nb, wg.qinv)
        elif cutlass.const_expr(cfg.q_as_terms and cfg.term_blocks):  # a row's terms in one thread: its first block
            for part in partials:
                sum_term_blocks(part, cfg.nb, wg.qinv, cfg.q_terms)
        elif cutlass.const_expr(cfg.q_as_terms and sum_terms):  # Q's terms summed: the BF16 kernel's columns
            for part in partials:
                sum_q_terms(part, cfg.gqa, wg.thr.quad, wg.qinv[0], wg.qinv[1])
        return partials

    @cute.jit
    def _scores(self, wg: Warpgroup, regs: TileRegisters, sc: TileScales, partials: list, t0=0, qbuf=None,
                mu=None, summed: cutlass.Constexpr = False) -> list:
        """The tile's scaled scores of this thread (element e: column slot ``s_slot(e)``, row
        ``row0 + 8 row_half(e)``) from K's fold, less ``mu`` (by column slot) where given; ``-inf`` on rows past
        the sequence and, in a step of several tokens, past each column's causal limit (the tile starting at
        token ``t0``; ``cfg.mask_branch``: not masked here, :meth:`_mask_branch` masks them). Channel-wise K with
        E4M3 terms: ``summed``, the partials hold the terms' sum already."""
        cfg = self.cfg
        s = []
        if cutlass.const_expr(cfg.k_channel):  # Q' y + the group's correction, then the softmax scale
            s = k_operand_fold_scores(cfg, partials[0], wg, qbuf, summed)
            if cutlass.const_expr(mu is not None):
                s = less_maxima(s, mu)
        else:
            s = k_acc_fold(cfg, partials, regs.par, sc, wg, mu)
        if cutlass.const_expr(not cfg.mask_branch):
            s = self._masked(wg, sc, s, t0)
        return s

    @cute.jit
    def _mask_branch(self, wg: Warpgroup, sc: TileScales, s: list, t_own, t_last) -> tuple:
        """``(s, sc)`` with the masks in a branch (``cfg.mask_branch``): only a tile, or a pass of two, reaching a
        limit (``t_last``, its last tile's first token, within a tile of :attr:`Warpgroup.mask_from`) masks ``t_own``'s
        scores ``s`` (:meth:`_masked`) and zeroes the V ``(s', z')`` of its rows past the end."""
        n_el = len(s)
        both = list(s) + [x for v in sc.v for x in v]  # the scores, then each V group's (s', z')
        kept = cute.make_rmem_tensor(cute.make_layout(len(both)), Float32)  # what leaves the branch
        for e in cutlass.range_constexpr(len(both)):
            kept[e] = both[e]
        if t_last + TILE > wg.mask_from:
            masked = self._masked(wg, sc, [kept[e] for e in range(n_el)], t_own)
            for g in cutlass.range_constexpr(len(sc.v)):
                o = n_el + 4 * g
                masked += zero_rows_past(kept[o], kept[o + 1], kept[o + 2], kept[o + 3], sc.valid[0], sc.valid[1])
            for e in cutlass.range_constexpr(len(both)):
                kept[e] = masked[e]
        v = [tuple(kept[n_el + 4 * g + i] for i in range(4)) for g in range(len(sc.v))]
        return [kept[e] for e in range(n_el)], TileScales(sc.k, v, sc.valid)

    @cute.jit
    def _masked(self, wg: Warpgroup, sc: TileScales, s: list, t0) -> list:
        """Scores ``s`` with ``-inf`` on rows past the sequence and, in a step, past each column's causal limit."""
        valid = sc.valid
        out = []
        for e in cutlass.range_constexpr(len(s)):
            x = s[e]
            if not valid[row_half(e)]:
                x = -Float32.inf
            if cutlass.const_expr(self.cfg.causal):
                if t0 + wg.thr.row0 + 8 * row_half(e) >= wg.limits[s_slot(e)]:
                    x = -Float32.inf
            out.append(x)
        return out

    @cute.jit
    def _pv(self, wg: Warpgroup, out: OutputAccumulator, kb0: cutlass.Constexpr = 0,
            wait: cutlass.Constexpr = True):
        """``O^T += V^T P'^T`` (the accumulator in units of sigma), V^T in registers, P' from its k-block
        ``kb0`` on (the second tile of a pass: the tile's tokens); with two channel groups of a token-wise V
        each group's m64 blocks of V^T multiply its own P' (one MMA chain each). With ``wait`` False the MMAs are
        committed and left in flight."""
        cfg, frags, accO = self.cfg, wg.frags, out.acc
        tOrV = frags.tOrV
        if cutlass.const_expr(cfg.pivot_mma):
            set_sum_a(cfg, frags.sum_a)
        warpgroup.fence()
        if cutlass.const_expr(cfg.vc == 2):
            per = cfg.mh // 2  # m64 blocks per channel group: contiguous in both fragments
            nb = cfg.nb
            for grp in cutlass.range_constexpr(2):
                acc_h = accO[(None, grp * per, None)]
                acc3 = cute.make_tensor(acc_h.iterator, cute.make_layout(((2, 2, nb), per, 1),
                                                                         stride=((1, 2, 4), 4 * nb, 0)))
                for kb in cutlass.range_constexpr(cute.size(tOrV, mode=[2])):
                    a_h = tOrV[(None, grp * per, kb)]
                    a2 = cute.make_tensor(a_h.iterator, cute.make_layout(((2, 2, 2), per), stride=((1, 2, 4), 8)))
                    b_h = frags.tOrP[grp][(None, None, kb0 + kb)]
                    cute.gemm(wg.pv_mma, acc3, a2, b_h, acc3)
        else:
            tOrP = frags.tOrP[0]
            for kb in cutlass.range_constexpr(cute.size(tOrV, mode=[2])):
                pv_mma(cfg, wg, accO, tOrV, tOrP, kb, kb0)
            if cutlass.const_expr(cfg.pivot_mma):  # the pivot sums: V^T's extra m64 block, c_h in its row 0
                for kb in cutlass.range_constexpr(cute.size(tOrV, mode=[2])):
                    sum_mma(cfg, wg, out.pivot, kb, kb0)
        warpgroup.commit_group()
        if cutlass.const_expr(wait):
            warpgroup.wait_group(0)

    @cute.jit
    def _epilogue(self, wg: Warpgroup, state: RunningState, mOP: cute.Tensor, mLP: cute.Tensor, b, kvh, split,
                  n_kvh=0):
        """The last offset corrections, then the partial output ``acc / sum`` and LSE (base 2) of the
        warpgroup's tiles into partial slot ``split`` (``n_kvh``: the KV heads, for a step's rows)."""
        cfg = self.cfg
        D = cfg.head_dim
        thr = wg.thr
        out = state.out
        fold_corrections(cfg, out, wg.smem.sSum, thr, last=True)
        accO = out.acc
        sums = column_sums(state.softmax.sums, wg.smem.sSum, thr)
        slots = len(sums)
        # ---- the split's partial output and LSE (base 2), by query row (:meth:`query_row`) --------------------
        top = Float32(1.0) if cfg.vc == 2 else out.sigma[0]  # two groups: each element takes its group's below
        inv = []
        for k in cutlass.range_constexpr(slots):
            x = Float32(0.0)
            if sums[k] != 0:  # a NaN sum is not empty: its output and LSE stay NaN, never a dropped partial
                x = top / sums[k]
            inv.append(x)
        thr_c = wg.frags.thr_pv.partition_C(cute.make_identity_tensor((D, cfg.cols)))
        nb = cfg.nb
        for e in cutlass.range_constexpr(cute.size(accO)):
            ch, h = thr_c[e]
            if h < cfg.rows:
                row = self.query_row(h, kvh, n_kvh)
                a = accO[e]
                # V^T by placement: units of sigma * v_unit (channel-row class c's 2^v_row_shls[c] times those), the
                # unit first (sigma * v_unit can pass FP32's range)
                unit = cfg.acc_unit * 2.0 ** -cfg.v_row_shls[row_half(e)]
                if cutlass.const_expr(unit != 1.0):
                    a = a * unit
                if cutlass.const_expr(cfg.vc == 2):
                    mOP[b, row, split, ch] = a * out.sigma[out.group(e)] * inv[o_slot(e, nb)]
                else:
                    mOP[b, row, split, ch] = a * inv[o_slot(e, nb)]
        warp = thr.warp
        lane = thr.lane
        if warp == 0 and lane < 4:
            for k in cutlass.range_constexpr(slots):
                col = slot_column(k, 2 * thr.quad)
                lse = -Float32.inf
                if sums[k] != 0:
                    lse = state.softmax.m[k] + cute.math.log2(sums[k])
                if col < cfg.rows:
                    mLP[b, self.query_row(col, kvh, n_kvh), split] = lse

    def query_row(self, c, kvh, n_kvh):
        """The row of ``q`` (``[B, step * Hq, D]``), of the partials and of their LSE that N column ``c`` of KV
        head ``kvh`` is: head ``kvh * gqa + c % gqa`` of step token ``c // gqa`` (``n_kvh``: the KV heads)."""
        cfg = self.cfg
        if cutlass.const_expr(cfg.step == 1):
            return kvh * cfg.gqa + c
        return (c // cfg.gqa) * (n_kvh * cfg.gqa) + kvh * cfg.gqa + c % cfg.gqa
