"""The split merge by stage 1's last CTA of each (sequence, KV head) (:attr:`~foscar.cute.config.Sm90Config.
fused_merge`, :data:`~foscar.cute.config.FUSED_MERGE`): every CTA writes its consumers' partials to memory as
always; then one thread of its consumers releases them and counts the CTA in on the (sequence, KV head)'s counter
(an atomic add, acquire-release at GPU scope, past the consumers' barrier: the fence is cumulative over the
partials they stored). The CTA that counts last (the split count minus one) merges every split's partials of the
KV head's rows into the output (and LSE), what the combine (:mod:`foscar.cute.combine`) computes, and sets the
counter back to zero, so that the next launch (a CUDA-graph replay too) finds it so: no second launch. The
workspace's counters (:func:`foscar.splitkv.workspace_for`) are the Triton kernels' fused merge's.

The merge's arithmetic is the combine's and the cluster merge's (:mod:`foscar.cute.cluster`): empty partials
(``lse = -inf``) weigh 0 whatever their output holds; all empty, ``out = 0`` and ``lse = -inf``; a NaN or ``+inf``
LSE, or a NaN output of a partial that weighs, makes the output and LSE NaN. The partials are read at L2 (``.cg``):
other SMs wrote them.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .config import THREADS, Sm90Config
from .softmax import barrier_any, merged_lse, merged_output, raise_running_maximum

#: Partials whose loads a thread issues together before it merges them, over all its (column, channel) pairs: one
#: round trip to L2 for up to this many partials of a pair that is alone (fewer a round the more pairs a thread takes);
#: twice as many where a consumer thread holds :data:`WIDE_REGISTERS` or more (one CTA an SM) and takes at most 4 pairs
#: (GQA 32 at one CTA an SM spilled with twice: 16 pairs' running states beside the loads).
LOADS_IN_FLIGHT = 16
WIDE_REGISTERS = 200


@cute.jit
def _global(t: cute.Tensor, coord):
    """A pointer to element ``coord`` of global tensor ``t``."""
    return t.iterator + cute.crd2idx(coord, t.layout)


@cute.jit
def merge(cfg: Sm90Config, consumers: cutlass.Constexpr, registers: cutlass.Constexpr, mOP: cute.Tensor,
          mLP: cute.Tensor, dest: tuple, query_row, bar_id: cutlass.Constexpr):
    """Called by each consumer thread once its partial is in ``mOP [B, rows, parts, D]``, ``mLP [B, rows, parts]``:
    the CTA counts in (``dest``: the output, the LSE and the counters, :class:`FoldDecodeSm90WSMerged`); the last of
    the (sequence, KV head)'s splits merges its columns' partials, channel by channel over the consumers' threads,
    into ``mO`` at the rows ``query_row(g, kvh, n_kvh)`` gives (a step's tokens too), and (``cfg.fused_merge`` 2)
    the LSE, natural log, into ``mLSE``. The count reaches every consumer thread through the second barrier's
    reduction (``bar.red.or``: no shared memory word). ``registers``: a consumer thread's (setmaxnreg); ``bar_id``: the
    consumers' named barrier."""
    mO, mLSE, mSEM = dest
    D = cfg.head_dim
    G = cfg.rows
    n = consumers * THREADS
    kvh, b, _ = cute.arch.block_idx()
    n_kvh, _, n_splits = cute.arch.grid_dim()
    tidx, _, _ = cute.arch.thread_idx()
    t = tidx - THREADS  # this thread among the consumers'
    counter = _global(mSEM, (b * n_kvh + kvh,))
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=n)  # every consumer's partial stored
    last = Int32(0)
    if t == 0:
        cute.arch.fence_acq_rel_gpu()
        if cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu") == n_splits - 1:
            last = Int32(1)
    if barrier_any(last, bar_id, n) != 0:  # the last split of the KV head here: every other's partials released
        parts = cute.size(mLP, mode=[2])
        pairs = (G * D + n - 1) // n
        wide = registers >= WIDE_REGISTERS and pairs <= 4  # more pairs: their running states take the registers
        per = max(1, LOADS_IN_FLIGHT * (2 if wide else 1) // pairs)  # partials a round
        pair = [t + k * n for k in range(pairs)]  # this thread's (column, channel) pairs: column i // D, channel i % D
        rows = [query_row(cutlass.min(i, G * D - 1) // D, kvh, n_kvh) for i in pair]
        m = [-Float32.inf for _ in range(pairs)]
        total = [Float32(0.0) for _ in range(pairs)]
        acc = [Float32(0.0) for _ in range(pairs)]
        for p0 in cutlass.range(0, parts, per, unroll=1):
            lse = []
            o = []
            for k in cutlass.range_constexpr(pairs):  # every load of the round in flight together
                for j in cutlass.range_constexpr(per):
                    p = cutlass.min(p0 + j, parts - 1)
                    o.append(cute.arch.load(_global(mOP, (b, rows[k], p, pair[k] % D)), Float32, cop="cg"))
                    x = cute.arch.load(_global(mLP, (b, rows[k], p)), Float32, cop="cg")
                    if p0 + j >= parts:  # past the end: the last partial's, weighed 0
                        x = -Float32.inf
                    lse.append(x)
            for k in cutlass.range_constexpr(pairs):
                m_new, m_safe, scale = raise_running_maximum(m[k], lse[k * per:(k + 1) * per])
                total[k] = total[k] * scale
                acc[k] = acc[k] * scale
                for j in cutlass.range_constexpr(per):
                    w = cute.math.exp2(lse[k * per + j] - m_safe, fastmath=True)  # an empty partial weighs 0
                    total[k] = total[k] + w
                    if w > 0:  # an empty partial's output is never read into the sum (it may hold anything)
                        acc[k] = acc[k] + w * o[k * per + j]
                m[k] = m_new
        for k in cutlass.range_constexpr(pairs):
            ch = pair[k] % D
            if pair[k] < G * D:
                mO[b, rows[k], ch] = merged_output(acc[k], total[k]).to(mO.element_type)
                if cutlass.const_expr(cfg.fused_merge == 2):
                    if ch == 0:
                        mLSE[b, rows[k]] = merged_lse(m[k], total[k])
        if t == 0:  # no other split of this launch counts here again: zero for the next
            cute.arch.atomic_exch(counter, Int32(0), sem="relaxed", scope="gpu")
