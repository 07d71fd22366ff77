"""v0 of the Hopper decode stage 1: one warpgroup per CTA (batch entry, KV head, KV split), four CTAs per
SM, loading the next tile's words and ``(s', z')`` from global memory into registers while it computes
one (a software pipeline), then the tile step of :class:`~foscar.cute.warpgroup.TileKernel`. It takes
one query token per sequence and at most 8 query heads per KV head (``Sm90Config.cols`` 8; its registers
hold no more): :data:`foscar.cute.config.V0_LIMITS`."""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass.cute.nvgpu import warpgroup
from cutlass.memory import SmemAllocator

from ..format import K_BLOCK_TOKENS, v_block_tokens
from .config import HEADS, THREADS, TILE, V0_LIMITS
from .fold_map import FOLD_CHANNELS, fold_channel, fold_chunk
from .folds import q_sums
from .fragment import k_word, v_word
from .operands import mmas_and_layouts, q_element_type, sqk_layout, stage_q
from .softmax import reduction_layout
from .warpgroup import (
    Fragments,
    TileKernel,
    TileRegisters,
    Warpgroup,
    WarpgroupSmem,
    WarpgroupThread,
    allocate_registers,
)


class FoldDecodeSm90(TileKernel):
    """v0: one warpgroup per CTA, register prefetch of the next tile."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKC: cute.Tensor, mVC: cute.Tensor, mKP: cute.Tensor, mVP: cute.Tensor,
                 mBT: cute.Tensor, mSEQ: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, mRot: cute.Tensor,
                 mTS: cute.Tensor, qk_scale: Float32, num_splits: Int32, stream: cuda.CUstream):
        """Stage 1 over ``num_splits`` KV splits, launched on ``stream`` (torch's current stream: CUDA
        graphs capture it); ``mOP``/``mLP`` may hold more partials (the BF16 windows', written by another
        kernel)."""
        assert self.cfg.cols == HEADS and self.cfg.step == 1 and not self.cfg.fp4_block, V0_LIMITS
        qk_mma, pv_mma, sQ_layout, sP_layout = mmas_and_layouts(self.cfg)
        batch = cute.size(mQ, mode=[0])
        kv_heads = cute.size(mKC, mode=[1])
        self.kernel(qk_mma, pv_mma, sQ_layout, sP_layout, mQ, mKC, mVC, mKP, mVP, mBT, mSEQ, mOP, mLP, mRot,
                    qk_scale).launch(grid=(kv_heads, batch, num_splits), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, sQ_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, mQ: cute.Tensor, mKC: cute.Tensor, mVC: cute.Tensor,
               mKP: cute.Tensor, mVP: cute.Tensor, mBT: cute.Tensor, mSEQ: cute.Tensor, mOP: cute.Tensor,
               mLP: cute.Tensor, mRot: cute.Tensor, qk_scale: Float32):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        kvh, b, split = cute.arch.block_idx()
        n_splits = cute.arch.grid_dim()[2]
        thr = WarpgroupThread(tidx, 1)
        smem = self._shared_memory(sQ_layout, sP_layout)

        # ---- Q^T (heads padded with zeros) and sum(Q) of the BF16 operand --------------------------
        stage_q(cfg, mQ, smem, b, kvh, tidx, mRot, smem.sQrot, lambda c: self.query_row(c, kvh, 0))
        cute.arch.sync_threads()
        q_sums(cfg, smem.sQ, smem.sQsum, tidx, smem.sQinv)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        qsum = [smem.sQsum[2 * thr.quad], smem.sQsum[2 * thr.quad + 1]]

        # ---- the split's tiles ------------------------------------------------------------------------
        n, t_lo, t_hi = self._split_tiles(mSEQ, b, split, n_splits)
        frags = Fragments(cfg, qk_mma, pv_mma, smem, tidx)
        qinv = (smem.sQinv[2 * thr.quad], smem.sQinv[2 * thr.quad + 1]) if cutlass.const_expr(cfg.q_as_terms) else None
        wg = Warpgroup(thr, smem, frags, qk_mma, pv_mma, qsum, n, qk_scale, qinv)
        # software pipeline: tile i+1's words and parameters are loaded (into regs_next) before tile i is
        # computed, so their latency hides behind its math
        state, regs, regs_next = allocate_registers(cfg, frags, prefetch=True)
        thr_c = frags.thr_pv.partition_C(cute.make_identity_tensor((cfg.head_dim, HEADS)))
        if t_lo < t_hi:
            self._load_tile(mKC, mVC, mKP, mVP, mBT, b, kvh, t_lo, regs_next, thr_c, thr)
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        for tile in cutlass.range(t_lo, t_hi, unroll=1):
            t0 = tile * TILE
            self._take_next(regs, regs_next)
            if tile + 1 < t_hi:
                self._load_tile(mKC, mVC, mKP, mVP, mBT, b, kvh, tile + 1, regs_next, thr_c, thr)
            if cutlass.const_expr(cfg.k_channel):  # Q' from the group's (s', z') of this thread's channels
                state.kgroup = self._fold_q(wg, state.kgroup, t0, lambda i: regs.par[i])
            state = self._tile_step(wg, regs, state, tile, t0, t_lo)

        self._epilogue(wg, state, mOP, mLP, b, kvh, split)

    def _shared_memory(self, sQ_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout) -> WarpgroupSmem:
        """The CTA's shared memory (one warpgroup's)."""
        cfg = self.cfg
        alloc = SmemAllocator()
        sQ = alloc.allocate_tensor(q_element_type(cfg), sQ_layout.outer, byte_alignment=1024,
                                   swizzle=sQ_layout.inner)
        sP = alloc.allocate_tensor(Float16, sP_layout.outer, byte_alignment=1024, swizzle=sP_layout.inner)
        sP2 = sP  # token-wise V with two channel groups: the second group's P' (its own buffer then)
        if cfg.vc == 2:
            sP2 = alloc.allocate_tensor(Float16, sP_layout.outer, byte_alignment=1024, swizzle=sP_layout.inner)
        sRed = alloc.allocate_tensor(Float32, reduction_layout(cfg), byte_alignment=16)
        sSum = alloc.allocate_tensor(Float32, cute.make_layout((4, HEADS)), byte_alignment=16)
        sQsum = alloc.allocate_tensor(Float32, cute.make_layout((HEADS, cfg.kc)), byte_alignment=16)
        sQk = None  # channel-wise K's two buffers of Q s' (BF16 K operands)
        if cutlass.const_expr(cfg.k_channel):
            qk_layout = sqk_layout(cfg, 2)
            sQk = alloc.allocate_tensor(BFloat16, qk_layout.outer, byte_alignment=1024, swizzle=qk_layout.inner)
        sKf = alloc.allocate_tensor(Float32, cute.make_layout((2, HEADS)), byte_alignment=16)
        sQinv = sQred = None
        if cutlass.const_expr(cfg.q_as_terms):
            sQinv = alloc.allocate_tensor(Float32, cute.make_layout(HEADS), byte_alignment=16)
            sQred = alloc.allocate_tensor(Float32, cute.make_layout((4, HEADS)), byte_alignment=16)
        smem = WarpgroupSmem(sQ, sQsum, [sP, sP2], sRed, sSum, sQk, sKf, sQinv, sQred)
        smem.sQrot = None  # a rotated cache: Q rotated in FP32 here before it is staged
        if cutlass.const_expr(cfg.rotation):
            smem.sQrot = alloc.allocate_tensor(Float32, cute.make_layout((1, HEADS, cfg.head_dim),
                                                                         stride=(0, cfg.head_dim, 1)), byte_alignment=16)
        return smem

    @cute.jit
    def _take_next(self, regs: TileRegisters, regs_next: TileRegisters):
        """The prefetched tile's registers become the current tile's."""
        cfg = self.cfg
        for i in cutlass.range_constexpr(cfg.k_words):
            regs.kw[i] = regs_next.kw[i]
        for vb in cutlass.range_constexpr(cfg.v_blocks):
            for mh in cutlass.range_constexpr(cfg.mh):
                regs.vw[mh, vb] = regs_next.vw[mh, vb]
        for i in cutlass.range_constexpr(cfg.par_words):
            regs.par[i] = regs_next.par[i]
        if cutlass.const_expr(cfg.v_channel):
            for i in cutlass.range_constexpr(2 * cfg.acc_elems):
                regs.vpar[i] = regs_next.vpar[i]

    @cute.jit
    def _load_tile(self, mKC: cute.Tensor, mVC: cute.Tensor, mKP: cute.Tensor, mVP: cute.Tensor, mBT: cute.Tensor,
                   b, kvh, tile, regs: TileRegisters, thr_c: cute.Tensor, thr: WarpgroupThread):
        """This thread's packed words of KV tile ``tile`` (at :func:`~foscar.cute.fragment.k_word` and
        :func:`~foscar.cute.fragment.v_word` of its page) and the ``(s', z')`` of its two token rows, into
        ``regs``."""
        cfg = self.cfg
        D = cfg.head_dim
        t0 = tile * TILE
        page = mBT[b, t0 // cfg.page]
        off = t0 % cfg.page
        warp = thr.warp
        lane = thr.lane
        tidx = thr.tidx
        row0 = thr.row0
        kw = regs.kw
        vw = regs.vw
        par = regs.par
        vpar = regs.vpar
        for i in cutlass.range_constexpr(cfg.k_words):
            kw[i] = mKC[page, kvh, k_word(cfg.bits, D, off // K_BLOCK_TOKENS, warp, lane, i)]
        for vb in cutlass.range_constexpr(cfg.v_blocks):
            for mh in cutlass.range_constexpr(cfg.mh):
                vw[mh, vb] = mVC[page, kvh, v_word(cfg.bits, D, off // v_block_tokens(cfg.bits), tidx, vb, mh)]
        if cutlass.const_expr(cfg.k_channel):  # the group's (s', z') of the channels it folds into Q'
            row = off // cfg.group_size if cfg.page >= cfg.group_size else 0
            _, fc = fold_chunk(D, tidx, 0)
            for i in cutlass.range_constexpr(2 * FOLD_CHANNELS):
                par[i] = mKP[page, kvh, row, fold_channel(D, fc, i // 2), i % 2]
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(2):
                if cutlass.const_expr(not cfg.k_channel):
                    for c in cutlass.range_constexpr(cfg.kc):
                        par[(r * cfg.kc + c) * 2 + j] = mKP[page, kvh, off + row0 + 8 * r, c, j]
                for c in cutlass.range_constexpr(cfg.vc):
                    if cutlass.const_expr(cfg.v_channel):
                        par[cfg.k_par_words + (r * cfg.vc + c) * 2 + j] = Float32(0.0)  # no per-token V scale
                    else:
                        par[cfg.k_par_words + (r * cfg.vc + c) * 2 + j] = mVP[page, kvh, off + row0 + 8 * r, c, j]
        if cutlass.const_expr(cfg.v_channel):  # the group's (s', z') of this thread's accumulator channels
            vrow = off // cfg.group_size if cfg.page >= cfg.group_size else 0
            for e in cutlass.range_constexpr(cfg.acc_elems):
                ch, _ = thr_c[e]
                for j in cutlass.range_constexpr(2):
                    vpar[2 * e + j] = mVP[page, kvh, vrow, ch, j]
