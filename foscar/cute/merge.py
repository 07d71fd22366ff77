"""v1's split merge inside stage 1 (``Sm90Config.fused_merge``): one launch per decode.

Each CTA writes its consumers' partials (:meth:`~foscar.cute.warpgroup.TileKernel._epilogue`), then counts
itself done on its (sequence, KV head)'s counter (an ``acq_rel`` atomic at GPU scope, after every consumer
thread's writes are fenced). The CTA that counts last merges the KV head's query rows over every partial, as
:class:`~foscar.cute.combine.CombineSm90` does (base-2 LSEs, the natural-log LSE written): an empty partial
(``lse = -inf``) weighs 0 whatever its output holds, all empty gives ``out = 0`` and ``lse = -inf``, and a NaN
or ``+inf`` LSE or a NaN output of a partial that weighs makes the row NaN. It then sets the counter back to
zero, so that the next launch (a CUDA-graph replay too) finds it so. What it takes: a cache without BF16
windows and rotation (the combine attends those), a BF16 output (:func:`foscar.cute.launch.run` decides).
Off by default (:data:`~foscar.cute.config.FUSED_MERGE`): measured slower than the two-launch merge on the H200,
its loops over the partials waiting on one load after another (``docs/results-h200.md``).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from .combine import LN2
from .config import CONSUMERS, THREADS
from .kernel_v1 import CONSUMERS_BARRIER as BARRIER  # both consumer warpgroups' named barrier


@cute.jit
def merge_if_last(cfg, query_row, mOP: cute.Tensor, mLP: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                  mCnt: cute.Tensor, sFlag: cute.Tensor, b, kvh, n_kvh, n_splits, ctid):
    """By both consumer warpgroups (``ctid`` 0..255) once each has written its partial: count this CTA done
    on counter ``b * n_kvh + kvh`` of ``mCnt``; the last of the KV head's ``n_splits`` CTAs merges its rows
    (``query_row(c)``, ``c < cfg.rows``) of ``mOP [B, rows, parts, D]``, ``mLP [B, rows, parts]`` into ``mO
    [B, rows, D]`` and (``cfg.merge_lse``) ``mLSE [B, rows]`` (``sFlag``: one shared Int32 that carries the count to every thread)."""
    threads = CONSUMERS * THREADS
    cute.arch.fence_acq_rel_gpu()  # this thread's partial, before the count
    cute.arch.barrier(barrier_id=BARRIER, number_of_threads=threads)
    counter = b * n_kvh + kvh
    if ctid == 0:
        sFlag[0] = cute.arch.atomic_add(mCnt.iterator + counter, Int32(1), sem="acq_rel", scope="gpu")
    cute.arch.barrier(barrier_id=BARRIER, number_of_threads=threads)
    if sFlag[0] == n_splits - 1:  # the same in every thread
        cute.arch.fence_acq_rel_gpu()  # the other CTAs' partials, after their counts
        D = cfg.head_dim
        parts = n_splits * CONSUMERS
        for j in cutlass.range_constexpr((cfg.rows * D + threads - 1) // threads):
            i = j * threads + ctid
            c = i // D
            d = i % D
            if c < cfg.rows:
                row = query_row(c)
                m = -Float32.inf
                for p in cutlass.range(parts, unroll=4):
                    m = cute.arch.fmax(m, mLP[b, row, p])  # fmax skips a NaN: its weight below is NaN
                m_safe = m
                if m == -Float32.inf:
                    m_safe = Float32(0.0)
                total = Float32(0.0)
                acc = Float32(0.0)
                for p in cutlass.range(parts, unroll=4):
                    w = cute.math.exp2(mLP[b, row, p] - m_safe, fastmath=True)  # an empty partial weighs 0
                    total = total + w
                    if w > 0:  # an empty partial's output is never read into the sum (it may hold anything)
                        acc = acc + w * mOP[b, row, p, d]
                denom = Float32(1.0)
                if total != 0:  # NaN != 0: a NaN total divides and stays NaN
                    denom = total
                mO[b, row, d] = (acc / denom).to(BFloat16)
                if cutlass.const_expr(cfg.merge_lse):
                    if d == 0:
                        lse = -Float32.inf
                        if total != 0:
                            lse = (m_safe + cute.math.log2(total)) * Float32(LN2)
                        mLSE[b, row] = lse
        if ctid == 0:
            mCnt[counter] = Int32(0)
