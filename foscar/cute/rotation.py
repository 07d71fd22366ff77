"""The format's Hadamard rotation (:func:`foscar.rotation.rotation_matrix`, ``R = diag(s) H / sqrt(D)``) inside
the CuTe kernels, so that a rotated cache costs no launch of its own: stage 1 rotates the query into the
cache's space as it stages Q (``q R = H (q * s / sqrt(D))``: :func:`rotate_q`), and the split merge rotates
the merged output back (``o = (o_R H) * s / sqrt(D)``: :func:`walsh_hadamard` on the merged row, then the
same per-channel factor). Both are an in-place Walsh-Hadamard transform over shared memory, ``log2(D)``
butterfly rounds with a barrier after each. The factor ``s / sqrt(D)`` per channel is the kernels'
``rotation`` argument (:func:`foscar.rotation.rotation_factors`).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .config import THREADS


@cute.jit
def walsh_hadamard(buf: cute.Tensor, rows: cutlass.Constexpr, n: cutlass.Constexpr, tidx, threads: cutlass.Constexpr,
                   bar_id: cutlass.Constexpr):
    """``buf[0, r, :n] <- buf[0, r, :n] H`` for ``r < rows`` (``H`` Sylvester's unnormalized Hadamard matrix,
    ``n`` a power of two), by ``threads`` threads (``tidx`` 0 to ``threads - 1``), in place: each round
    one butterfly per pair, then a barrier (named ``bar_id`` over ``threads``; ``0``: the whole CTA)."""
    pairs = rows * (n // 2)
    for stage in cutlass.range_constexpr(n.bit_length() - 1):
        span = 1 << stage
        for j in cutlass.range_constexpr((pairs + threads - 1) // threads):
            p = j * threads + tidx
            if p < pairs:
                r = p // (n // 2)
                i = p % (n // 2)
                lo = (i // span) * (2 * span) + i % span
                a = buf[0, r, lo]
                c = buf[0, r, lo + span]
                buf[0, r, lo] = a + c
                buf[0, r, lo + span] = a - c
        if cutlass.const_expr(bar_id == 0):
            cute.arch.sync_threads()
        else:
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=threads)


@cute.jit
def rotate_q(cfg, mQ: cute.Tensor, mRot: cute.Tensor, sQrot: cute.Tensor, b, query_row, tidx, bar_id: cutlass.Constexpr):
    """``sQrot[0, c, :] = q R`` of the ``cfg.rows`` query rows ``mQ[b, query_row(c), :]`` (FP32; the padded
    columns zero), by one warpgroup (named barrier ``bar_id``): Q read in the cache's space from there on."""
    D = cfg.head_dim
    for h in cutlass.range_constexpr(cfg.cols):
        for d0 in cutlass.range_constexpr(max(1, D // THREADS)):
            d = d0 * THREADS + tidx
            if d < D:
                val = Float32(0.0)
                if cutlass.const_expr(h < cfg.rows):
                    val = Float32(mQ[b, query_row(h), d]) * mRot[d]
                sQrot[0, h, d] = val
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=THREADS)
    walsh_hadamard(sQrot, cfg.rows, D, tidx, THREADS, bar_id)
