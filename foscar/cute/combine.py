"""Stage 2 in CuTe DSL: the LSE merge of the split partials (and the BF16 windows' partials) into the
output, what :func:`foscar.triton.combine.combine_stage2` computes, so that a CuTe decode of a format
without windows runs no Triton kernel (a process's first Triton launch takes most of a second).

One CTA per (query row, batch entry), or per ``rows`` query rows of one KV head where the combine attends the
windows (each thread its channel of every row); per channel ``ranks`` threads, each taking ``thread_chunk``
of a chunk's partials (the config's ``chunk``: one round trip to memory for a decode's partials up to
:data:`~foscar.cute.combine_config.COMBINE_MAX_CHUNK`). A thread issues the loads of its channel's outputs
(registers) and of its share of the chunk's LSEs (shared memory) together; every thread then takes the
chunk's maximum from shared memory, so that all ranks share one running maximum, and the ranks' sums
are added at the end. Launched as a programmatic dependent of stage 1 (``cfg.pdl``), it waits for stage 1's
grid before its first read. A windowed format's BF16 sink and recent ring are attended by the combine itself
(:mod:`foscar.cute.windows`: no launch of their own), before that wait, and merged as one more partial.
Partial LSEs are base 2; the written LSE is natural log. Empty partials
(``lse = -inf``) weigh 0 whatever their output holds; all empty: ``out = 0``, ``lse = -inf``. A NaN or
``+inf`` LSE, or a NaN output of a partial that weighs, makes the output and the LSE NaN, never a merge
of the others.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.memory import SmemAllocator

from . import windows
from .combine_config import CombineConfig
from .rotation import walsh_hadamard
from .softmax import merged_lse, merged_output, raise_running_maximum


class CombineSm90:
    """The compiled combine of one :class:`~foscar.cute.combine_config.CombineConfig`."""

    def __init__(self, cfg: CombineConfig, out_type, window_type=None):
        self.cfg, self.out_type, self.window_type = cfg, out_type, window_type

    @cute.jit
    def __call__(self, mOP: cute.Tensor, mLP: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mRot: cute.Tensor,
                 stream: cuda.CUstream):
        """Merge ``mOP [B, Hq, parts, D]``, ``mLP [B, Hq, parts]`` into ``mO [B, Hq, D]`` (and ``mLSE
        [B, Hq]`` when the config writes it; else any tensor), on ``stream``; with the config's ``rotate``, the
        merged row rotated back out of the cache's space (``mRot [D]``: each channel's ``s / sqrt(D)``,
        :mod:`foscar.cute.rotation`; else any tensor)."""
        self._launch(mOP, mLP, mO, mLSE, mRot, mOP, mOP, mOP, mOP, mOP, mLP, Float32(0.0), stream)

    @cute.jit
    def _launch(self, mOP: cute.Tensor, mLP: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mRot: cute.Tensor,
                mQ: cute.Tensor, mKs: cute.Tensor, mVs: cute.Tensor, mKr: cute.Tensor, mVr: cute.Tensor,
                mSEQ: cute.Tensor, qk_scale: Float32, stream: cuda.CUstream):
        batch = cute.size(mOP, mode=[0])
        heads = cute.size(mOP, mode=[1])
        self.kernel(mOP, mLP, mO, mLSE, mRot, mQ, mKs, mVs, mKr, mVr, mSEQ, qk_scale).launch(
            grid=(heads // self.cfg.rows, batch, 1), block=(self.cfg.threads, 1, 1), stream=stream,
            use_pdl=self.cfg.pdl)

    @cute.kernel
    def kernel(self, mOP: cute.Tensor, mLP: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mRot: cute.Tensor,
               mQ: cute.Tensor, mKs: cute.Tensor, mVs: cute.Tensor, mKr: cute.Tensor, mVr: cute.Tensor,
               mSEQ: cute.Tensor, qk_scale: Float32):
        tid, _, _ = cute.arch.thread_idx()
        block, b, _ = cute.arch.block_idx()
        cfg = self.cfg
        D = cfg.head_dim
        R = cfg.ranks
        rows = cfg.rows
        per = cfg.thread_chunk
        chunk = cfg.chunk
        threads = cfg.threads
        d = tid % D
        r = tid // D
        h0 = block * rows  # the CTA's first row; the thread takes channel d of each
        alloc = SmemAllocator()
        sL = alloc.allocate_tensor(Float32, cute.make_layout((rows, chunk), stride=(chunk, 1)), byte_alignment=16)
        sAcc = alloc.allocate_tensor(Float32, cute.make_layout((rows, D + 1), stride=(D + 1, 1)),
                                     byte_alignment=16)  # rank 1's sums
        sRow = None  # a rotated cache: the merged rows, rotated back in place
        if cutlass.const_expr(cfg.rotate):
            sRow = alloc.allocate_tensor(Float32, cute.make_layout((1, rows, D), stride=(0, D, 1)), byte_alignment=16)
        parts = cute.size(mLP, mode=[2])
        m = [-Float32.inf for _ in range(rows)]
        total = [Float32(0.0) for _ in range(rows)]
        acc = [Float32(0.0) for _ in range(rows)]
        if cutlass.const_expr(cfg.windows):  # the windows first: they do not wait for stage 1
            sm = windows.allocate(alloc, cfg, self.window_type)
            m, total, acc = windows.window_state(cfg, self.window_type, mQ, mKs, mVs, mKr, mVr, mSEQ, mRot, qk_scale,
                                                 sm, b, h0, tid)
        if cutlass.const_expr(cfg.pdl):  # a programmatic dependent: stage 1's partials are written and visible
            cute.arch.griddepcontrol_wait()
        for c0 in cutlass.range(0, parts, chunk, unroll=1):
            base = c0 + r * per
            o = []
            for g in cutlass.range_constexpr(rows):  # this thread's outputs, in flight together
                for i in cutlass.range_constexpr(per):
                    o.append(mOP[b, h0 + g, cutlass.min(base + i, parts - 1), d])  # past the end: weighed 0 below
            for g in cutlass.range_constexpr(rows):
                for k in cutlass.range_constexpr((chunk + threads - 1) // threads):  # the chunk's LSEs, shared
                    i = k * threads + tid
                    if i < chunk:
                        li = mLP[b, h0 + g, cutlass.min(c0 + i, parts - 1)]
                        if c0 + i >= parts:
                            li = -Float32.inf
                        sL[g, i] = li
            cute.arch.sync_threads()
            for g in cutlass.range_constexpr(rows):
                m_new, m_safe, scale = raise_running_maximum(m[g], (sL[g, i] for i in range(chunk)))
                total[g] = total[g] * scale
                acc[g] = acc[g] * scale
                for i in cutlass.range_constexpr(per):
                    w = cute.math.exp2(sL[g, r * per + i] - m_safe, fastmath=True)  # an empty partial weighs 0
                    total[g] = total[g] + w
                    if w > 0:  # an empty partial's output is never read into the sum (it may hold anything)
                        acc[g] = acc[g] + w * o[g * per + i]
                m[g] = m_new
            cute.arch.sync_threads()  # every thread has read the chunk's LSEs before the next chunk's land
        if cutlass.const_expr(R == 2):  # rank 1's sums onto rank 0's (one running maximum: no rescale)
            if r == 1:
                for g in cutlass.range_constexpr(rows):
                    sAcc[g, d] = acc[g]
                    if d == 0:
                        sAcc[g, D] = total[g]
            cute.arch.sync_threads()
            if r == 0:
                for g in cutlass.range_constexpr(rows):
                    acc[g] = acc[g] + sAcc[g, d]
                    total[g] = total[g] + sAcc[g, D]
        for g in cutlass.range_constexpr(rows):
            if cutlass.const_expr(cfg.rotate):  # o = (o_R H) s / sqrt(D): every channel of the rows first
                if r == 0:
                    sRow[0, g, d] = merged_output(acc[g], total[g])
            elif r == 0:
                mO[b, h0 + g, d] = merged_output(acc[g], total[g]).to(self.out_type)
        if cutlass.const_expr(cfg.rotate):
            cute.arch.sync_threads()
            walsh_hadamard(sRow, rows, D, tid, threads, 0)
            if r == 0:
                for g in cutlass.range_constexpr(rows):
                    mO[b, h0 + g, d] = (sRow[0, g, d] * mRot[d]).to(self.out_type)
        if r == 0:
            if cutlass.const_expr(cfg.write_lse):
                if d == 0:
                    for g in cutlass.range_constexpr(rows):
                        mLSE[b, h0 + g] = merged_lse(m[g], total[g])


class CombineWindowsSm90(CombineSm90):
    """The compiled combine of a :class:`~foscar.cute.combine_config.CombineConfig` with windows."""

    @cute.jit
    def __call__(self, mOP: cute.Tensor, mLP: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mRot: cute.Tensor,
                 mQ: cute.Tensor, mKs: cute.Tensor, mVs: cute.Tensor, mKr: cute.Tensor, mVr: cute.Tensor,
                 mSEQ: cute.Tensor, qk_scale: Float32, stream: cuda.CUstream):
        """:meth:`CombineSm90.__call__`, the BF16 windows merged as one more partial: the query ``mQ [B, Hq, D]``
        (BF16, the caller's space), the sink ``mKs``, ``mVs`` and the recent ring ``mKr``, ``mVr`` (``[B, Hkv,
        slots, D]``), the lengths ``mSEQ [B]`` and the softmax scale times ``log2(e)``."""
        self._launch(mOP, mLP, mO, mLSE, mRot, mQ, mKs, mVs, mKr, mVr, mSEQ, qk_scale, stream)
