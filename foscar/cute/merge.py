"""v1's split merge inside stage 1 (``Sm90Config.fused_merge``, :data:`~foscar.cute.config.FUSED_MERGE`): one
launch per short decode, where the combine's own launch, gap and latency are a large share of the time.

Each CTA writes its consumers' partials (:meth:`~foscar.cute.warpgroup.TileKernel._epilogue`), then counts itself
done on its (sequence, KV head)'s counter (an ``acq_rel`` atomic at GPU scope, after every consumer thread's writes
are fenced). The CTA that counts last merges the KV head's query rows over every partial, as
:class:`~foscar.cute.combine.CombineSm90` does (base-2 LSEs, the natural-log LSE written): an empty partial
(``lse = -inf``) weighs 0 whatever its output holds, all empty gives ``out = 0`` and ``lse = -inf``, and a NaN or
``+inf`` LSE or a NaN output of a partial that weighs makes the row NaN. It then sets the counter back to zero, so
that the next launch (a CUDA-graph replay too) finds it so.

The merge takes three round trips to memory, each with all of its loads in flight: the rows' partial LSEs into
shared memory (every consumer thread a few), each row's maximum, weights and their sum by one warp (shuffles), then
the outputs: thread ``t`` takes channel ``t % D`` of the rows and every ``threads / D``-th partial, its loads
unrolled, the ranks' sums added through shared memory. What it takes (:func:`foscar.cute.launch.merges_in_stage1`):
at most :data:`~foscar.cute.config.MERGE_ROWS` rows and :data:`~foscar.cute.config.MERGE_PARTS` partials, a cache
without BF16 windows or rotation, a BF16 output.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .combine import LN2
from .config import CONSUMERS, MERGE_PARTS, THREADS
from .kernel_v1 import CONSUMERS_BARRIER, FoldDecodeSm90WS

#: the merge's threads: both consumer warpgroups
MERGE_THREADS = CONSUMERS * THREADS


class FoldDecodeSm90WSMerge(FoldDecodeSm90WS):
    """v1 with the split merge inside stage 1 (``cfg.fused_merge``): the stage-1 tensors, then the output, its LSE
    (``cfg.merge_lse``; else any tensor) and the counters (:data:`~foscar.cute.config.MERGE_TENSORS`)."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKC: cute.Tensor, mVC: cute.Tensor, mKP: cute.Tensor, mVP: cute.Tensor,
                 mBT: cute.Tensor, mSEQ: cute.Tensor, mOP: cute.Tensor, mLP: cute.Tensor, mRot: cute.Tensor,
                 mTS: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mCnt: cute.Tensor, qk_scale: Float32,
                 num_splits: Int32, stream: cuda.CUstream):
        self._launch(mQ, mKC, mVC, mKP, mVP, mBT, mSEQ, mOP, mLP, mRot, mTS, qk_scale, num_splits, stream,
                     (mO, mLSE, mCnt))


class MergeSmem:
    """The merge's shared memory: the count (``flag``), the rows' partial LSEs then weights (``w [rows,
    MERGE_PARTS]``), each row's weight sum and maximum (``tm [2, rows]``) and the ranks' channel sums (``acc
    [ranks, rows, D]``)."""

    def __init__(self, flag, w, tm, acc):
        self.flag, self.w, self.tm, self.acc = flag, w, tm, acc


def allocate(alloc, cfg) -> MergeSmem:
    """:class:`MergeSmem` from ``alloc`` (a ``SmemAllocator``) for ``cfg``'s rows and head dim."""
    ranks = MERGE_THREADS // cfg.head_dim
    return MergeSmem(alloc.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16),
                     alloc.allocate_tensor(Float32, cute.make_layout((cfg.rows, MERGE_PARTS), stride=(MERGE_PARTS, 1)),
                                           byte_alignment=16),
                     alloc.allocate_tensor(Float32, cute.make_layout((2, cfg.rows), stride=(cfg.rows, 1)),
                                           byte_alignment=16),
                     alloc.allocate_tensor(Float32, cute.make_layout((ranks, cfg.rows, cfg.head_dim),
                                                                     stride=(cfg.rows * cfg.head_dim, cfg.head_dim, 1)),
                                           byte_alignment=16))


@cute.jit
def merge_if_last(cfg, query_row, mOP: cute.Tensor, mLP: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                  mCnt: cute.Tensor, sm: MergeSmem, b, kvh, n_kvh, n_splits, ctid):
    """By both consumer warpgroups (``ctid`` 0..255) once each has written its partial: count this CTA done on
    counter ``b * n_kvh + kvh`` of ``mCnt``; the last of the KV head's ``n_splits`` CTAs merges its rows
    (``query_row(c)``, ``c < cfg.rows``) of ``mOP [B, rows, parts, D]``, ``mLP [B, rows, parts]`` into ``mO [B,
    rows, D]`` and (``cfg.merge_lse``) ``mLSE [B, rows]``, then zeroes the counter."""
    flag = sm.flag  # shared-memory tensors as locals: the branches below carry no Python object
    cute.arch.fence_acq_rel_gpu()  # this thread's partial, before the count
    cute.arch.barrier(barrier_id=CONSUMERS_BARRIER, number_of_threads=MERGE_THREADS)
    counter = b * n_kvh + kvh
    if ctid == 0:
        flag[0] = cute.arch.atomic_add(mCnt.iterator + counter, Int32(1), sem="acq_rel", scope="gpu")
    cute.arch.barrier(barrier_id=CONSUMERS_BARRIER, number_of_threads=MERGE_THREADS)
    if flag[0] == n_splits - 1:  # the same in every thread
        cute.arch.fence_acq_rel_gpu()  # the other CTAs' partials, after their counts
        _merge_rows(cfg, query_row, mOP, mLP, mO, mLSE, sm.w, sm.tm, sm.acc, b, n_splits * CONSUMERS, ctid)
        if ctid == 0:
            mCnt[counter] = Int32(0)


@cute.jit
def _merge_rows(cfg, query_row, mOP: cute.Tensor, mLP: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                sW: cute.Tensor, sTM: cute.Tensor, sAcc: cute.Tensor, b, parts, ctid):
    """The merge of :func:`merge_if_last` by the last CTA (:class:`MergeSmem`'s ``w``, ``tm``, ``acc``): three
    round trips (module docstring)."""
    rows = cfg.rows
    D = cfg.head_dim
    ranks = MERGE_THREADS // D
    for i in cutlass.range_constexpr((rows * MERGE_PARTS + MERGE_THREADS - 1) // MERGE_THREADS):  # the LSEs
        j = i * MERGE_THREADS + ctid
        r = j // MERGE_PARTS
        p = j % MERGE_PARTS
        if r < rows:
            x = -Float32.inf  # past the partials: weighs 0
            if p < parts:
                x = mLP[b, query_row(r), p]
            sW[r, p] = x
    cute.arch.barrier(barrier_id=CONSUMERS_BARRIER, number_of_threads=MERGE_THREADS)
    warp = ctid // 32
    lane = ctid % 32
    for rr in cutlass.range_constexpr((rows + MERGE_THREADS // 32 - 1) // (MERGE_THREADS // 32)):
        r = warp + rr * (MERGE_THREADS // 32)
        if r < rows:  # warp-uniform: one warp a row
            m = -Float32.inf
            for k in cutlass.range_constexpr(MERGE_PARTS // 32):
                m = cute.arch.fmax(m, sW[r, k * 32 + lane])
            for sh in cutlass.range_constexpr(5):  # the row's maximum over the warp (fmax skips a NaN: its weight is NaN)
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, 16 >> sh))
            m_safe = m
            if m == -Float32.inf:
                m_safe = Float32(0.0)
            total = Float32(0.0)
            for k in cutlass.range_constexpr(MERGE_PARTS // 32):
                w = cute.math.exp2(sW[r, k * 32 + lane] - m_safe, fastmath=True)  # an empty partial weighs 0
                sW[r, k * 32 + lane] = w
                total = total + w
            for sh in cutlass.range_constexpr(5):
                total = total + cute.arch.shuffle_sync_bfly(total, 16 >> sh)
            if lane == 0:
                sTM[0, r] = total
                sTM[1, r] = m_safe
    cute.arch.barrier(barrier_id=CONSUMERS_BARRIER, number_of_threads=MERGE_THREADS)
    d = ctid % D
    rank = ctid // D
    acc = [Float32(0.0) for _ in range(rows)]
    for p in cutlass.range(rank, parts, ranks, unroll=4):  # this rank's partials, the rows' loads in flight together
        o = [mOP[b, query_row(r), p, d] for r in range(rows)]
        for r in cutlass.range_constexpr(rows):
            w = sW[r, p]
            if w > 0:  # an empty partial's output is never read into the sum (it may hold anything)
                acc[r] = acc[r] + w * o[r]
    for r in cutlass.range_constexpr(rows):
        sAcc[rank, r, d] = acc[r]
    cute.arch.barrier(barrier_id=CONSUMERS_BARRIER, number_of_threads=MERGE_THREADS)
    if rank == 0:
        for r in cutlass.range_constexpr(rows):
            total = sTM[0, r]
            s = acc[r]
            for k in cutlass.range_constexpr(1, ranks):
                s = s + sAcc[k, r, d]
            denom = Float32(1.0)
            if total != 0:  # NaN != 0: a NaN total divides and stays NaN
                denom = total
            mO[b, query_row(r), d] = (s / denom).to(BFloat16)
            if cutlass.const_expr(cfg.merge_lse):
                if d == 0:
                    lse = -Float32.inf
                    if total != 0:
                        lse = (sTM[1, r] + cute.math.log2(total)) * Float32(LN2)
                    mLSE[b, query_row(r)] = lse
