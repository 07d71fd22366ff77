"""v1 of the Hopper decode stage 1: warp-specialized.

Warpgroup 0 is the producer: one thread walks the split's KV tiles through the page table and issues TMA
copies (``cp.async.bulk.tensor``) of each tile's packed K and V words and its ``(s', z')`` into a
``cfg.stages``-deep shared-memory ring per consumer, each stage guarded by a full and an empty mbarrier
(exact transaction bytes). Warpgroups 1 and 2 (and 3 where :attr:`~foscar.cute.config.Sm90Config.wide`, at one
CTA an SM) are the consumers, on alternating tiles (alternating runs of two tiles of one token group where
channel-wise K's fold or a pass of two tiles over a channel-wise axis takes them, :func:`~foscar.cute.ring.ring_tile`): each waits for its
stage, copies its words and parameters into registers, frees the stage and runs the tile step of
:class:`~foscar.cute.warpgroup.TileKernel` with its own online-softmax state and accumulators. Each consumer
writes its own partial (``split * consumers + c``); the LSE combine merges them with the other splits', or, where
a (sequence, KV head)'s splits are one cluster (``cfg.cluster``), the CTAs merge them from each other's shared
memory (:mod:`foscar.cute.cluster`), or (``cfg.fused_merge``) the last of its CTAs merges them from memory
(:mod:`foscar.cute.tail_merge`).
``setmaxnreg`` moves registers from the producer to the consumers (:data:`~foscar.cute.config.WS_REGISTERS`). Q is
staged by the producer before any copy, or by the first consumer while the producer copies (``cfg.prologue``).
Channel-wise K: each consumer folds ``Q'`` at each token group it reaches (two tiles of one group a pass: once a
pass), or (``cfg.producer_fold``) a warp of the producer's a consumer folds it into a ``Q'`` per stage (two tiles a
pass: per pass; :mod:`foscar.cute.producer_fold`).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from . import cluster, operands, tail_merge
from .config import THREADS, TILE, Sm90Config, as_run, consumer_code_paths, consumers_for, ws_registers
from .fold_map import fold_chunk, fold_param, k_fold_buffer
from .fold_terms import fold_terms_padding
from .folds import k_operand_fold, kf_layout, q_sums
from .fragment import k_word, slot_column, v_word
from .limits import causal_last, causal_limits, first_masked
from .operands import mmas_and_layouts, q_element_type, qk_element_type, sqk_layout, stage_q, zeroing_qk_mma
from .overlap import consume_overlapped
from .pair import pair_step, second_tile_start, wait_pass
from .producer_fold import fold_buffers, fold_stages
from .ring import (StageRing, fold_buffer, pass_tiles, ring_phase, ring_slot, ring_tile, run_bound, run_tile,
                   split_tiles_each)
from .softmax import reduction_layout
from .tma_ring import tma_atoms, tma_views
from .warpgroup import (
    Fragments,
    TileKernel,
    TileRegisters,
    Warpgroup,
    WarpgroupSmem,
    WarpgroupThread,
    allocate_registers,
)
from .wgmma import pass_descriptors


#: the named barrier of every consumer warpgroup (0: the CTA's; 1-3: each consumer's; 5: Q's staging warpgroup)
CONSUMERS_BARRIER = 4


def consumer_buffer(spec: tuple, c):
    """Consumer ``c``'s buffer (``c`` a run-time value) of a kind allocated for every consumer at a fixed stride
    (``spec``: ``(base, stride, align, dtype, layout, swizzle)``, :meth:`FoldDecodeSm90WS._shared_memory`): its
    pointer keeps the kind's alignment (the stride is a multiple of it, and of a swizzle's period), so that its
    stores stay as wide as a static buffer's."""
    base, stride, align, dtype, layout, swizzle = spec
    ptr = cute.make_ptr(dtype, base.toint() + c * stride, cute.AddressSpace.smem, assumed_align=align,
                        swizzle_=swizzle)
    return cute.make_tensor(ptr, layout)


class FoldDecodeSm90WS(TileKernel):
    """v1: a TMA producer warpgroup and two (or three, :func:`~foscar.cute.config.consumers_for`) consumer
    warpgroups, ``ctas_per_sm`` CTAs resident per SM."""

    def __init__(self, cfg: Sm90Config, ctas_per_sm: int = 1):
        super().__init__(as_run(cfg, ctas_per_sm))
        self.ctas_per_sm = ctas_per_sm
        self.consumers = consumers_for(cfg, ctas_per_sm)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKC: cute.Tensor, mVC: cute.Tensor, mKP: cute.Tensor, mVP: cute.Tensor,
                 mBT: cute.Tensor, mSEQ: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, mRot: cute.Tensor,
                 mTS: cute.Tensor, qk_scale: Float32, num_splits: Int32, stream: cuda.CUstream):
        self._launch(mQ, mKC, mVC, mKP, mVP, mBT, mSEQ, mOP, mLP, mRot, mTS, (mOP, mLP, mSEQ), qk_scale, num_splits,
                     stream)

    @cute.jit
    def _launch(self, mQ: cute.Tensor, mKC: cute.Tensor, mVC: cute.Tensor, mKP: cute.Tensor, mVP: cute.Tensor,
                mBT: cute.Tensor, mSEQ: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, mRot: cute.Tensor,
                mTS: cute.Tensor, merge_to: tuple, qk_scale: Float32, num_splits: Int32, stream: cuda.CUstream):
        """The launch; ``merge_to``: the output, LSE and counters of ``cfg.fused_merge`` (else placeholders)."""
        cfg = self.cfg
        qk_mma, pv_mma, sQ_layout, sP_layout = mmas_and_layouts(cfg)
        atoms = tma_atoms(cfg, mKC, mVC, mKP, mVP)
        batch = cute.size(mQ, mode=[0])
        kv_heads = cute.size(mKC, mode=[1])
        self.ws_kernel(qk_mma, pv_mma, sQ_layout, sP_layout, atoms[0][0], atoms[0][1], atoms[1][0], atoms[1][1],
                       atoms[2][0], atoms[2][1], atoms[3][0], atoms[3][1], mQ, mBT, mSEQ, mOP, mLP, mRot,
                       mTS, *merge_to, qk_scale).launch(grid=(kv_heads, batch, num_splits),
                                             block=(THREADS * (1 + self.consumers), 1, 1),
                                             cluster=[1, 1, cfg.cluster] if cfg.cluster else None,
                                             stream=stream, min_blocks_per_mp=self.ctas_per_sm,
                                             preferred_smem_carveout=100)  # all of the SM's shared memory

    @cute.kernel
    def ws_kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, sQ_layout: cute.ComposedLayout,
                  sP_layout: cute.ComposedLayout, atom_kc: cute.CopyAtom, tma_kc: cute.Tensor, atom_vc: cute.CopyAtom,
                  tma_vc: cute.Tensor, atom_kp: cute.CopyAtom, tma_kp: cute.Tensor, atom_vp: cute.CopyAtom,
                  tma_vp: cute.Tensor, mQ: cute.Tensor, mBT: cute.Tensor, mSEQ: cute.Tensor, mOP: cute.Tensor,
                  mLP: cute.Tensor, mRot: cute.Tensor, mTS: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                  mSEM: cute.Tensor, qk_scale: Float32):
        cfg = self.cfg
        slots = cfg.stages * self.consumers
        tidx, _, _ = cute.arch.thread_idx()
        kvh, b, split = cute.arch.block_idx()
        n_kvh, _, n_splits = cute.arch.grid_dim()
        role = cute.arch.make_warp_uniform(tidx // THREADS)  # the warpgroup: 0 producer, 1 + c consumer c
        if cutlass.const_expr(cfg.trigger_dependents):  # the combine may launch (and wait) once every CTA is here
            cute.arch.griddepcontrol_launch_dependents()
        qk_mma.set(warpgroup.Field.ACCUMULATE, True)  # set once, before any branch (the tile step zeroes accS)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)

        ring, smem_for, merged = self._shared_memory(sQ_layout, sP_layout)
        dest = merged[:2] if cfg.cluster else (mOP, mLP)  # where the consumers' partials go (cfg.cluster: shared)
        full = ring.full
        empty = ring.empty
        smem0 = smem_for(0)
        sQ = smem0.sQ
        sQsum = smem0.sQsum

        if tidx == 0:
            if cutlass.const_expr(cfg.start_prefetch):
                self._start_prefetch((atom_kc, atom_vc, atom_kp, atom_vp), mSEQ, mBT, b, split, n_splits)
            for i in cutlass.range_constexpr(slots):
                # the TMA issuer's arrival, and its consumer's fold warp's where the producer folds the slot's Q'
                cute.arch.mbarrier_init(full + i, 2 if self._folded_slot(i) else 1)
                cute.arch.mbarrier_init(empty + i, THREADS)
                if cutlass.const_expr(cfg.producer_fold):
                    cute.arch.mbarrier_init(ring.kpar + i, 1)
            if cutlass.const_expr(cfg.cluster):
                cluster.init(cfg, merged[2])
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(cfg.cluster):
            cluster.announce()
        if cutlass.const_expr(not cfg.start_prefetch):
            n, t_lo, t_hi = self._split_tiles(mSEQ, b, split, n_splits, cfg.tile_run)
        tma = ((atom_kc, tma_kc), (atom_vc, tma_vc), (atom_kp, tma_kp), (atom_vp, tma_vp))
        if cutlass.const_expr(cfg.prologue == "consumer_q"):
            cute.arch.sync_threads()  # the ring's barriers are initialised for every thread; Q: the first consumer
        else:  # ---- Q^T (heads padded with zeros) and sum(Q), by the producer warpgroup ---------------------
            if role == 0:
                # a rotated cache: Q rotated in FP32 in the first K stage's words, which no TMA writes before
                # the barriers below (the fence after them orders these writes before the ring's)
                assert cfg.cols * cfg.head_dim <= cfg.stages * self.consumers * cfg.tile_words  # the rotated Q fits
                sQrot = cute.make_tensor(cute.recast_ptr(ring.sK.iterator, dtype=Float32),
                                         cute.make_layout((1, cfg.cols, cfg.head_dim), stride=(0, cfg.head_dim, 1)))
                stage_q(cfg, mQ, smem0, b, kvh, tidx, mRot, sQrot, lambda c: self.query_row(c, kvh, n_kvh))
            cute.arch.sync_threads()
            q_sums(cfg, sQ, sQsum, tidx, smem0.sQinv)
            for _ in cutlass.range_constexpr(operands.Q_SUMS_BARRIERS):
                cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()
        # START_PREFETCH: the length read past the prologue's barriers (its line prefetched); with Q staged by the
        # first consumer, past each role's own: the producer's at once, the consumers' once Q is staged
        split_tiles = None
        if cutlass.const_expr(cfg.start_prefetch):
            split_tiles = lambda: self._split_tiles(mSEQ, b, split, n_splits, cfg.tile_run)  # noqa: E731
            if cutlass.const_expr(cfg.prologue != "consumer_q"):
                n, t_lo, t_hi = split_tiles()
                split_tiles = None
            else:
                n = t_lo = t_hi = None

        copies = consumer_code_paths(cfg, self.ctas_per_sm)
        if cutlass.const_expr(self._q_ahead_of_copies()):
            if role > 0:
                self._stage_q_early(role - 1, mQ, smem0, b, kvh, n_kvh, mRot)
        if role == 0:  # ---- producer ------------------------------------------------------------------------
            cute.arch.setmaxregister_decrease(ws_registers(cfg, self.ctas_per_sm)[0])
            if cutlass.const_expr(split_tiles is None):
                self._produce(tma, ring, mBT, sQ, b, kvh, t_lo, t_hi)
            else:
                _, p_lo, p_hi = split_tiles()
                self._produce(tma, ring, mBT, sQ, b, kvh, p_lo, p_hi)
        if cutlass.const_expr(copies > 1):  # ---- consumers: a path each (the split merges in stage 1 refused) -----
            for c in cutlass.range_constexpr(self.consumers):
                if role == c + 1:
                    self._consumer(c, qk_mma, pv_mma, ring, smem0, smem_for(c), mQ, *dest, b, kvh, split, t_lo,
                                   t_hi, n, qk_scale, n_kvh, mRot, mTS, mSEQ, split_tiles)
                    self._merge_splits(merged, mOP, mLP, (mO, mLSE, mSEM))
        else:  # ---- consumers: one code path, the consumer's index a run-time (warp-uniform) value ---------------
            if role > 0:
                self._consumer(role - 1, qk_mma, pv_mma, ring, smem0, smem_for(role - 1), mQ, *dest, b, kvh, split,
                               t_lo, t_hi, n, qk_scale, n_kvh, mRot, mTS, mSEQ, split_tiles)
                self._merge_splits(merged, mOP, mLP, (mO, mLSE, mSEM))

    @cute.jit
    def _merge_splits(self, merged, mOP: cute.Tensor, mLP: cute.Tensor, merge_to: tuple):
        """By each consumer thread past its partial: the split merge where stage 1 runs it, in the cluster
        (``cfg.cluster``, ``merged`` its partials and barriers) or by the last CTA (``cfg.fused_merge``, ``merge_to`` the
        output, LSE and counters)."""
        if cutlass.const_expr(self.cfg.cluster):
            cluster.merge(self.cfg, self.consumers, *merged, mOP, mLP, self.query_row, CONSUMERS_BARRIER)
        if cutlass.const_expr(self.cfg.fused_merge):
            tail_merge.merge(self.cfg, self.consumers, ws_registers(self.cfg, self.ctas_per_sm)[1], mOP, mLP, merge_to,
                             self.query_row, CONSUMERS_BARRIER)

    @cute.jit
    def _produce(self, tma: tuple, ring: StageRing, mBT: cute.Tensor, sQ: cute.Tensor, b, kvh, t_lo, t_hi):
        """The producer warpgroup over tiles ``[t_lo, t_hi)``: its first thread's TMA copies, and where it folds
        channel-wise K's ``Q'`` (``producer_fold``), a warp a consumer's folds (:mod:`foscar.cute.producer_fold`)."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            views = tma_views(self.cfg, tma, ring)
            for tile in cutlass.range(t_lo, t_hi, unroll=1):
                self._issue_tile(tma, views, ring, mBT, b, kvh, t_lo, tile)
        if cutlass.const_expr(self.cfg.producer_fold):
            if tidx >= 32 and tidx < 32 * (1 + self.consumers):
                fold_stages(self.cfg, ring, sQ, tidx // 32 - 1, tidx % 32, t_lo, t_hi,
                            lambda slot, t: self._fold_source(ring, slot, t))

    @cute.jit
    def _consumer(self, c, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, ring: StageRing, smem0: WarpgroupSmem,
                  smem: WarpgroupSmem, mQ: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, b, kvh, split, t_lo,
                  t_hi, n, qk_scale: Float32, n_kvh, mRot: cute.Tensor, mTS: cute.Tensor, mSEQ: cute.Tensor,
                  split_tiles=None):
        """Consumer warpgroup ``c`` (an int: a code path of its own; or the run-time index: one path for every
        consumer, :func:`~foscar.cute.config.consumer_code_paths`): its registers, Q where it stages it (unless
        staged ahead of the copies of the code, :meth:`_q_ahead_of_copies`), its tiles (:meth:`_consume`);
        ``split_tiles``: where given, ``(n, t_lo, t_hi)`` read from it once Q is staged."""
        cfg = self.cfg
        cute.arch.setmaxregister_increase(ws_registers(cfg, self.ctas_per_sm)[1])
        if cutlass.const_expr(cfg.prologue == "consumer_q" and not self._q_ahead_of_copies()):
            self._stage_q_early(c, mQ, smem0, b, kvh, n_kvh, mRot)
        if cutlass.const_expr(split_tiles is not None):
            n, t_lo, t_hi = split_tiles()
        self._consume(c, qk_mma, pv_mma, ring, smem, mOP, mLP, b, kvh, split, t_lo, t_hi, n, qk_scale, n_kvh, mTS,
                      mSEQ)

    def _ring(self, alloc: SmemAllocator) -> StageRing:
        """The stage ring (:class:`StageRing`), the first of the CTA's shared memory: each slot's packed K and V
        words, their ``(s', z')`` and its two mbarriers; with ``producer_fold`` each slot's ``Q'`` too."""
        cfg = self.cfg
        chunk = cfg.tile_words
        ci, co = cfg.tma_box
        slots = cfg.stages * self.consumers
        sK = alloc.allocate_tensor(Int32, cute.make_layout(((ci, co), slots), stride=((1, ci), chunk)),
                                   byte_alignment=128)
        sV = alloc.allocate_tensor(Int32, cute.make_layout(((ci, co), slots), stride=((1, ci), chunk)),
                                   byte_alignment=128)
        sKP = alloc.allocate_tensor(Float32, cute.make_layout((cfg.k_param_words, slots)), byte_alignment=128)
        sVP = alloc.allocate_tensor(Float32, cute.make_layout((cfg.v_param_words, slots)), byte_alignment=128)
        full = alloc.allocate_array(Int64, slots)
        empty = alloc.allocate_array(Int64, slots)
        kpar = sQk_ring = sKf_ring = None  # producer_fold: each stage's Q', its corrections, its K (s', z') barrier
        if cutlass.const_expr(cfg.producer_fold):
            kpar = alloc.allocate_array(Int64, slots)
            bufs = fold_buffers(cfg, self.consumers)  # one a slot, or a pass
            qk_layout = sqk_layout(cfg, bufs)
            sQk_ring = alloc.allocate_tensor(qk_element_type(cfg), qk_layout.outer, byte_alignment=1024,
                                             swizzle=qk_layout.inner)
            kf = cute.size(kf_layout(cfg), mode=[1])  # a buffer's corrections (and E4M3 terms' 2^-e)
            sKf_ring = alloc.allocate_tensor(Float32, cute.make_layout((bufs, kf), stride=(kf, 1)), byte_alignment=16)
        return StageRing(sK, sV, sKP, sVP, full, empty, kpar, sQk_ring, sKf_ring)

    def _shared_memory(self, sQ_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout):
        """The CTA's shared memory: the stage ring, Q^T and sum(Q), then each consumer's buffers, allocated
        buffer kind by buffer kind, the consumers' buffers of a kind one after another at a fixed stride (so
        that one code path serves every consumer, its index a run-time value). Returns ``(ring, smem_for, merged)``,
        ``smem_for(c)`` consumer ``c``'s :class:`WarpgroupSmem`, ``merged`` the partials a cluster merges, or None."""
        cfg = self.cfg
        alloc = SmemAllocator()
        ring = self._ring(alloc)
        sQ = alloc.allocate_tensor(q_element_type(cfg), sQ_layout.outer, byte_alignment=1024,
                                   swizzle=sQ_layout.inner)
        sQsum = alloc.allocate_tensor(Float32, cute.make_layout((cfg.cols, cfg.kc)), byte_alignment=16)
        n = self.consumers

        def each(dtype, layout, align: int = 16, swizzle=None):
            """``n`` buffers of ``layout`` at a stride of whole ``align`` bytes: ``(base, stride, align, dtype,
            layout, swizzle)``, viewed by :func:`consumer_buffer`."""
            size = cute.cosize(layout) * dtype.width // 8
            stride = (size + align - 1) // align * align
            return alloc.allocate(n * stride, align), stride, align, dtype, layout, swizzle

        sP = each(Float16, sP_layout.outer, 1024, sP_layout.inner)
        sP2 = each(Float16, sP_layout.outer, 1024, sP_layout.inner) if cfg.vc == 2 else sP  # the second group's
        sRed = each(Float32, reduction_layout(cfg))
        sSum = each(Float32, cute.make_layout((4, cfg.cols)))
        # channel-wise K's Q s' (BF16 K operands): each consumer's two buffers, or the stages' (producer_fold)
        sQk = sKf = None
        if cutlass.const_expr(cfg.k_channel and not cfg.producer_fold):
            qk_layout = sqk_layout(cfg, 2)
            sQk = each(qk_element_type(cfg), qk_layout.outer, 1024, qk_layout.inner)
            sKf = each(Float32, kf_layout(cfg))
        sMx = None  # MXFP4: each consumer's V scale bits (operands_fp4.publish_v_scale_bits)
        if cutlass.const_expr(cfg.fp4_mx):
            sMx = each(Int32, cute.make_layout(cfg.fp4_blocks * TILE * cfg.tiles_per_pass))
        sQinv = sQred = None
        if cutlass.const_expr(cfg.q_scaled):
            sQinv = alloc.allocate_tensor(Float32, cute.make_layout(cfg.cols), byte_alignment=16)
            sQred = alloc.allocate_tensor(Float32, cute.make_layout((4, cfg.cols)), byte_alignment=16)

        def smem_for(c) -> WarpgroupSmem:
            qk = (ring.sQk, ring.sKf) if sQk is None else (consumer_buffer(sQk, c), consumer_buffer(sKf, c))
            return WarpgroupSmem(sQ, sQsum, [consumer_buffer(sP, c), consumer_buffer(sP2, c)],
                                 consumer_buffer(sRed, c), consumer_buffer(sSum, c), qk[0], qk[1], sQinv, sQred,
                                 None if sMx is None else consumer_buffer(sMx, c))

        merged = cluster.allocate(alloc, cfg, n) if cfg.cluster else None
        return ring, smem_for, merged

    @cute.jit
    def _stage_q_early(self, c, mQ: cute.Tensor, smem: WarpgroupSmem, b, kvh, n_kvh, mRot: cute.Tensor):
        """Q^T and sum(Q) by the first consumer while the producer copies (``cfg.prologue``), between barriers of
        every consumer (:data:`CONSUMERS_BARRIER`): Q staged, then its sums, the fence that orders the writes before
        the MMAs read them and :data:`~foscar.cute.operands.Q_SUMS_BARRIERS` barriers, as the producer's prologue."""
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        ctid = tidx - THREADS  # the first consumer's threads 0..127 (the second's past the sums' threads)
        if c == 0:
            stage_q(cfg, mQ, smem, b, kvh, ctid, mRot, None, lambda col: self.query_row(col, kvh, n_kvh))
        cute.arch.barrier(barrier_id=CONSUMERS_BARRIER, number_of_threads=self.consumers * THREADS)
        q_sums(cfg, smem.sQ, smem.sQsum, ctid, smem.sQinv)
        for _ in cutlass.range_constexpr(operands.Q_SUMS_BARRIERS):
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=CONSUMERS_BARRIER, number_of_threads=self.consumers * THREADS)

    @cute.jit
    def _start_prefetch(self, atoms: tuple, mSEQ: cute.Tensor, mBT: cute.Tensor, b, split, n_splits):
        """As the CTA starts (:attr:`~foscar.cute.config.Sm90Config.start_prefetch`): the line of the sequence's
        length, the TMA descriptors, and the page-table line of the split's first page as it would be for a sequence
        filling the table (:meth:`_split_tiles` with its capacity for the length). The length is then read past the
        prologue's barriers (ptxas hoists the arithmetic on a value loaded before them to the load, stalling the
        ring's initialisation and Q's staging behind it), and the first copies wait neither for a descriptor nor,
        where the guess holds (a line spans 32 pages), for the table."""
        cfg = self.cfg
        cute.arch.prefetch((mSEQ.iterator + b).llvm_ptr)
        for atom in atoms:
            cpasync.prefetch_descriptor(atom)
        pages = cute.size(mBT, mode=[1])
        per = split_tiles_each(pages * (cfg.page // TILE), n_splits, cfg.tile_run)
        first = cutlass.max(cutlass.min(split * per * TILE // cfg.page, pages - 1), 0)  # an entry of the row
        row = mBT[b, None]
        cute.arch.prefetch((row.iterator + first).llvm_ptr)

    @cute.jit
    def _issue_tile(self, tma: tuple, views: tuple, ring: StageRing, mBT: cute.Tensor, b, kvh, t_lo, tile):
        """The producer's work for one KV tile (its page read from the page table ``mBT``): once the stage of
        consumer ``(tile - t_lo) % consumers`` that it goes to is empty, its four TMA copies (K words, V words,
        K and V ``(s', z')``) with the stage's exact transaction bytes on its full barrier (``producer_fold``: K's
        ``(s', z')`` only into a stage whose ``Q'`` is folded, on the folders' barrier ``kpar``). One thread calls it
        (a TMA copy is issued by one lane elected with ``elect.sync`` over the whole warp: the warp's other lanes
        have left the producer's code by then; lanes still working elsewhere in the loop would never join it)."""
        cfg = self.cfg
        chunk = cfg.tile_words
        (atom_kc, _), (atom_vc, _), (atom_kp, _), (atom_vp, _) = tma
        tKs, tKg, tVs, tVg, tKPs, tKPg, tVPs, tVPg = views
        full = ring.full
        empty = ring.empty
        c, k = ring_tile(tile - t_lo, cfg.tile_run, self.consumers)
        slot = ring_slot(c, k, cfg.stages)
        t0 = tile * TILE
        page = mBT[b, t0 // cfg.page]  # read before the wait: its latency hides behind a full ring's
        cute.arch.mbarrier_wait(empty + slot, ring_phase(k, cfg.stages) ^ 1)  # a fresh stage passes
        k_bytes = 0 if cfg.producer_fold else cfg.k_param_words * 4  # the K (s', z'): the stage's, or the folders'
        cute.arch.mbarrier_arrive_and_expect_tx(full + slot, (2 * chunk + cfg.v_param_words) * 4 + k_bytes)
        tip = (t0 % cfg.page) // TILE
        grow = (t0 % cfg.page) // cfg.group_size if cfg.page >= cfg.group_size else 0
        krow = grow if cfg.k_channel else tip  # the tile's (s', z') row: channel-wise, its group's
        vrow = grow if cfg.v_channel else tip
        cute.copy(atom_kc, tKg[(None, tip, kvh, page)], tKs[(None, slot)], tma_bar_ptr=full + slot)
        cute.copy(atom_vc, tVg[(None, tip, kvh, page)], tVs[(None, slot)], tma_bar_ptr=full + slot)
        if cutlass.const_expr(cfg.producer_fold):
            # only a folded stage's: the consumers never read channel-wise K's (s', z'), and a copy that no thread
            # waits for could land after the stage's next arrive_and_expect_tx, or after the CTA has exited
            if self._folded_slot(slot):
                cute.arch.mbarrier_arrive_and_expect_tx(ring.kpar + slot, cfg.k_param_words * 4)
                cute.copy(atom_kp, tKPg[(None, krow, kvh, page)], tKPs[(None, slot)], tma_bar_ptr=ring.kpar + slot)
        else:
            cute.copy(atom_kp, tKPg[(None, krow, kvh, page)], tKPs[(None, slot)], tma_bar_ptr=full + slot)
        cute.copy(atom_vp, tVPg[(None, vrow, kvh, page)], tVPs[(None, slot)], tma_bar_ptr=full + slot)

    def _q_ahead_of_copies(self) -> bool:
        """Whether the consumers stage Q (``consumer_q``) ahead of their copies of the tile loop (one a consumer,
        :func:`~foscar.cute.config.consumer_code_paths`), at the registers a launch gives and before the producer's
        branch (after it, ptxas gives the copies the producer's registers): so that the prologue's barriers of every
        consumer are one aligned instruction (``bar.sync``: every thread it counts executes the same one)."""
        return self.cfg.prologue == "consumer_q" and consumer_code_paths(self.cfg, self.ctas_per_sm) > 1

    def _folded_slot(self, i) -> bool:
        """``producer_fold``: whether the producer folds ring slot ``i``'s ``Q'`` (an int, or a run-time slot): every
        slot's, or with two tiles a pass tile A's (an even ``k``: an even slot, the stages a power of two), which
        tile B's pass shares."""
        return self.cfg.producer_fold and (self.cfg.tiles_per_pass == 1 or (i & 1) == 0)

    @cute.jit
    def _consume(self, c, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, ring: StageRing,
                 smem: WarpgroupSmem, mOP: cute.Tensor, mLP: cute.Tensor, b, kvh, split, t_lo, t_hi, n,
                 qk_scale: Float32, n_kvh, mTS: cute.Tensor, mSEQ: cute.Tensor):
        """Consumer warpgroup ``c``: tiles ``t_lo + c, t_lo + c + consumers, ...`` from its stage ring, or its runs
        of :attr:`~foscar.cute.config.Sm90Config.tile_run` tiles (:func:`~foscar.cute.ring.ring_tile`)."""
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        pair = cfg.tiles_per_pass == 2
        thr = WarpgroupThread(tidx - THREADS * (c + 1), 1 + c, pair)
        qsum = [smem.sQsum[slot_column(k, thr.col0)] for k in range(2 * cfg.nb)]
        frags = Fragments(cfg, qk_mma, pv_mma, smem, thr.tidx)
        qinv = None
        if cutlass.const_expr(cfg.q_scaled):
            qinv = [smem.sQinv[slot_column(k, thr.col0)] for k in range(2 * cfg.nb)]
        limits = None
        last = n
        if cutlass.const_expr(cfg.causal):
            last = causal_last(cfg, mSEQ, b, n)
            limits = causal_limits(cfg, thr.col0, last)
        mask_from = first_masked(cfg, n, last) if cfg.mask_branch else None
        wg = Warpgroup(thr, smem, frags, qk_mma, pv_mma, qsum, n, qk_scale, qinv, limits, mask_from,
                       qk_mma0=zeroing_qk_mma(cfg), descs=pass_descriptors(cfg, smem))
        state, regs, regs_b = allocate_registers(cfg, frags, prefetch=pair or cfg.overlap)
        if cutlass.const_expr(cfg.k_channel and cfg.k_e4m3 and not cfg.producer_fold):  # Q' buffers' fixed parts
            fold_terms_padding(cfg, thr.tidx, THREADS, smem.sQk, smem.sKf)
        if cutlass.const_expr(cfg.fp4_block > 0 and not cfg.fp4_mx):  # every row's s': T 2^14, no offset
            from .config_fp4 import FP4_UNIT_SHIFT
            for t in cutlass.range_constexpr(2):
                f = mTS[t] * Float32(2.0 ** FP4_UNIT_SHIFT)
                o = 0 if t == 0 else cfg.k_par_words
                for r in cutlass.range_constexpr(2):
                    regs.par[o + 2 * r] = f
                    regs.par[o + 2 * r + 1] = Float32(0.0)
        thr_c = frags.thr_pv.partition_C(cute.make_identity_tensor((cfg.head_dim, cfg.cols)))
        if cutlass.const_expr(pair):  # two tiles a pass: this consumer's k-th and (k+1)-th, k even
            run = cfg.tile_run  # tiles A and B: 1, the split's c + 2nj and c + 2nj + n (n consumers); 2, its 2c + 4j
            for tile in cutlass.range(t_lo + run * c, t_hi, 2 * self.consumers, unroll=1):  # and 2c + 4j + 1
                k, i_b = pass_tiles(tile - t_lo, run, self.consumers)
                tile_b = t_lo + i_b
                has_b = tile_b < t_hi
                slot, slot_b = wait_pass(ring, c, k, has_b, cfg.stages)
                qbuf = None
                if cutlass.const_expr(cfg.producer_fold):  # the Q' of tile A's stage
                    qbuf = fold_buffer(slot, 2)
                elif cutlass.const_expr(cfg.k_channel):  # both tiles in one token group: Q' from tile A's stage
                    # (before the words are in registers: fewer live across the fold); groups of two tiles: every pass
                    qbuf = k_fold_buffer(cfg, tile * TILE, self.consumers)
                    if cutlass.const_expr(cfg.group_size == 2 * TILE):
                        k_operand_fold(cfg, wg, self._fold_source(ring, slot, thr.tidx), qbuf)
                    else:
                        state.kgroup = self._fold_q(wg, state.kgroup, tile * TILE,
                                                    self._fold_source(ring, slot, thr.tidx))
                self._read_words(ring, slot, regs, thr)
                self._read_words(ring, slot_b, regs_b, thr)
                t0_b = second_tile_start(tile_b, t_hi, n)
                slot_own = slot  # the stage of this thread's tile (half): its rows' (s', z')
                if thr.half == 1:
                    slot_own = slot_b
                if cutlass.const_expr(cfg.fp4_block > 0):  # the block scales read from both stages: freed after V^T's
                    state = pair_step(self, wg, regs, regs_b, state, k >> 1, tile * TILE, t0_b,
                                      (self._fp4_scales(ring, slot), self._fp4_scales(ring, slot_b),
                                       self._fp4_scales(ring, slot_own)),
                                      lambda: self._release_pair(ring, slot, slot_b, has_b))
                elif cutlass.const_expr(cfg.producer_fold):  # tile A's stage (its Q') freed after the pass's scores
                    self._read_params(ring, slot_own, regs, thr_c, thr)
                    if has_b:
                        cute.arch.mbarrier_arrive(ring.empty + slot_b)
                    state = pair_step(self, wg, regs, regs_b, state, k >> 1, tile * TILE, t0_b,
                                      release=lambda: cute.arch.mbarrier_arrive(ring.empty + slot), qbuf=qbuf)
                else:
                    self._read_params(ring, slot_own, regs, thr_c, thr)
                    self._release_pair(ring, slot, slot_b, has_b)
                    state = pair_step(self, wg, regs, regs_b, state, k >> 1, tile * TILE, t0_b, qbuf=qbuf)
        elif cutlass.const_expr(cfg.overlap):  # two of this consumer's tiles a pass, overlapped
            for tile in cutlass.range(t_lo + c, t_hi, 2 * self.consumers, unroll=1):
                k, i_b = pass_tiles(tile - t_lo, 1, self.consumers)
                state = consume_overlapped(self, wg, ring, regs, regs_b, state, thr_c, thr, c, k, tile, t_lo + i_b,
                                           t_hi, n)
        elif cutlass.const_expr(cfg.tile_run == 1 and self.consumers == 3):  # every third tile
            for k in cutlass.range(0, (t_hi - t_lo - c + 2) // 3, unroll=1):
                state = self._consume_tile(wg, ring, regs, state, thr_c, thr, c, k, t_lo + c + 3 * k)
        elif cutlass.const_expr(cfg.tile_run == 1):  # alternate tiles
            for tile in cutlass.range(t_lo + c, t_hi, 2, unroll=1):
                state = self._consume_tile(wg, ring, regs, state, thr_c, thr, c, (tile - t_lo) >> 1, tile)
        else:  # runs of two tiles (channel-wise K: one Q' fold for both)
            for k in cutlass.range(0, run_bound(t_hi - t_lo), unroll=1):
                tile = t_lo + run_tile(c, k, 2)
                if tile < t_hi:
                    state = self._consume_tile(wg, ring, regs, state, thr_c, thr, c, k, tile)
        if cutlass.const_expr(cfg.cluster):  # this CTA's shared memory, column h at row h (1 KV head: query_row)
            self._epilogue(wg, state, mOP, mLP, 0, 0, c, 1)
        else:
            self._epilogue(wg, state, mOP, mLP, b, kvh, split * self.consumers + c, n_kvh)

    @cute.jit
    def _consume_tile(self, wg: Warpgroup, ring: StageRing, regs: TileRegisters, state, thr_c: cute.Tensor,
                      thr: WarpgroupThread, c, k, tile):
        """Consumer ``c``'s ``k``-th tile (the split's tile ``tile``), one tile a pass: its stage into registers
        (channel-wise K: ``Q'`` folded from the stage's ``(s', z')`` at a new token group), the stage freed, the
        tile step. Returns the new state."""
        cfg = self.cfg
        slot = ring_slot(c, k, cfg.stages)
        cute.arch.mbarrier_wait(ring.full + slot, ring_phase(k, cfg.stages))
        self._read_words(ring, slot, regs, thr)
        if cutlass.const_expr(cfg.fp4_block == 0):
            self._read_params(ring, slot, regs, thr_c, thr)
        t0 = tile * TILE
        if cutlass.const_expr(cfg.fp4_block > 0):  # the block scales read from the stage: freed after V^T's registers
            state = self._tile_step(wg, regs, state, k, t0, 0, None,
                                    lambda: cute.arch.mbarrier_arrive(ring.empty + slot), self._fp4_scales(ring, slot))
        elif cutlass.const_expr(cfg.producer_fold):  # the stage's Q': freed after the tile's scores
            state = self._tile_step(wg, regs, state, k, t0, 0, fold_buffer(slot, 1),
                                    lambda: cute.arch.mbarrier_arrive(ring.empty + slot))
        else:
            if cutlass.const_expr(cfg.k_channel):  # Q' from the group's (s', z') in the stage
                state.kgroup = self._fold_q(wg, state.kgroup, t0, self._fold_source(ring, slot, thr.tidx))
            cute.arch.mbarrier_arrive(ring.empty + slot)  # the stage is in registers: the producer may refill it
            state = self._tile_step(wg, regs, state, k, t0, 0)
        return state


    def _fold_source(self, ring: StageRing, slot, t):
        """Channel-wise K: where thread ``t`` of a fold (:func:`foscar.cute.folds.q_fold`) reads the token group's
        ``(s', z')`` in stage ``slot``: the stage's row (E4M3 terms, :func:`foscar.cute.fold_terms.fold_q_terms`), or
        its ``i``-th float of them (:func:`foscar.cute.folds.fold_q`; a builder's place in its row, which
        :func:`~foscar.cute.fold_map.fold_chunk` gives alike for any count of threads)."""
        if cutlass.const_expr(self.cfg.k_e4m3):
            return ring.sKP[(None, slot)]
        _, fc = fold_chunk(self.cfg.head_dim, t, 0)
        return lambda i: ring.sKP[fold_param(self.cfg.head_dim, fc, i), slot]

    def _fp4_scales(self, ring: StageRing, slot) -> list:
        """FP4 formats: the K and V block-scale bytes of stage ``slot`` as Int32 words (:mod:`foscar.cute.operands_fp4`)."""
        cfg = self.cfg
        return [cute.make_tensor(cute.recast_ptr(p.iterator + slot * w, dtype=Int32), cute.make_layout(w))
                for p, w in ((ring.sKP, cfg.k_param_words), (ring.sVP, cfg.v_param_words))]

    @cute.jit
    def _release_pair(self, ring: StageRing, slot, slot_b, has_b):
        """Two tiles a pass: the stages of tiles A and B freed (B's where the pass has one)."""
        cute.arch.mbarrier_arrive(ring.empty + slot)
        if has_b:
            cute.arch.mbarrier_arrive(ring.empty + slot_b)

    @cute.jit
    def _read_words(self, ring: StageRing, slot, regs: TileRegisters, thr: WarpgroupThread):
        """This thread's words of the tile in stage ``slot`` (``fragment.k_word``, ``v_word``), into ``regs``."""
        cfg, D = self.cfg, self.cfg.head_dim
        k_at = lambda i: ring.sK[(k_word(cfg.bits, D, 0, thr.warp, thr.lane, i), slot)]  # noqa: E731
        v_at = lambda vb, mh: ring.sV[(v_word(cfg.bits, D, 0, thr.tidx, vb, mh), slot)]  # noqa: E731
        if cutlass.const_expr(cfg.flat_words):  # each stage a flat run of words: a thread's words off one base
            sK, sV = (cute.make_tensor(t.iterator, cute.make_layout(cute.cosize(t.layout))) for t in (ring.sK, ring.sV))
            base = slot * cfg.tile_words
            k_at = lambda i: sK[base + k_word(cfg.bits, D, 0, thr.warp, thr.lane, i)]  # noqa: E731
            v_at = lambda vb, mh: sV[base + v_word(cfg.bits, D, 0, thr.tidx, vb, mh)]  # noqa: E731
        for i in cutlass.range_constexpr(cfg.k_words):
            regs.kw[i] = k_at(i)
        for vb in cutlass.range_constexpr(cfg.v_blocks):
            for mh in cutlass.range_constexpr(cfg.mh):
                regs.vw[mh, vb] = v_at(vb, mh)

    @cute.jit
    def _read_params(self, ring: StageRing, slot, regs: TileRegisters, thr_c: cute.Tensor, thr: WarpgroupThread):
        """The ``(s', z')`` of this thread's two token rows of the tile in stage ``slot``, into ``regs``."""
        cfg = self.cfg
        row0 = thr.row0
        sKP = ring.sKP
        sVP = ring.sVP
        par = regs.par
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(2):
                if cutlass.const_expr(not cfg.k_channel):  # channel-wise K: Q' reads the stage (_consume)
                    for cc in cutlass.range_constexpr(cfg.kc):
                        par[(r * cfg.kc + cc) * 2 + j] = sKP[((row0 + 8 * r) * cfg.kc + cc) * 2 + j, slot]
                for cc in cutlass.range_constexpr(cfg.vc):
                    if cutlass.const_expr(cfg.v_channel):
                        par[cfg.k_par_words + (r * cfg.vc + cc) * 2 + j] = Float32(0.0)  # no per-token V scale
                    else:
                        par[cfg.k_par_words + (r * cfg.vc + cc) * 2 + j] = sVP[((row0 + 8 * r) * cfg.vc + cc) * 2 + j,
                                                                          slot]
        if cutlass.const_expr(cfg.v_channel):  # the group's (s', z') of this thread's accumulator channels
            for e in cutlass.range_constexpr(cfg.acc_elems):
                ch, _ = thr_c[e]
                for j in cutlass.range_constexpr(2):
                    regs.vpar[2 * e + j] = sVP[2 * ch + j, slot]
