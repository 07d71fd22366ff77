"""Online softmax (base 2) over the token axis of ``S^T``, per head column, for one warpgroup.

A thread holds four elements of a tile's ``S^T`` (element ``e``: head column ``2 quad + e % 2``, token row
``row0 + 8 (e // 2)``); a column's 64 tokens sit on the eight lanes sharing ``quad`` in each of the four
warps, so a column reduction is three butterfly shuffles, then the warps through shared memory. With two
tiles per pass (``thr.pair``, :mod:`foscar.cute.pair`) quads 2 and 3 hold the second tile's heads 0-3: one
more shuffle joins a head's two tiles.
:class:`OnlineSoftmax` is the running state of a thread's two columns.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .config import HEADS, THREADS


class OnlineSoftmax:
    """The running maxima ``m0``, ``m1`` of this thread's two head columns (base 2, scaled scores) and the
    running sums ``sums`` of ``exp2(s - m)`` per accumulator element (a 4-register tensor, summed over the
    token rows at the end: :func:`column_sums`). A run-time loop carries ``m0`` and ``m1``."""

    def __init__(self, m0: Float32, m1: Float32, sums: cute.Tensor):
        self.m0 = m0
        self.m1 = m1
        self.sums = sums

    def __extract_mlir_values__(self):
        return [self.m0.ir_value(), self.m1.ir_value()]

    def __new_from_mlir_values__(self, values) -> OnlineSoftmax:
        return OnlineSoftmax(Float32(values[0]), Float32(values[1]), self.sums)

    def advance(self, tm0: Float32, tm1: Float32):
        """Take a tile's column maxima ``tm0``, ``tm1``: the new running maxima, and the factors ``(al0, al1)``
        that rescale what was accumulated under the old ones."""
        mn0 = cute.arch.fmax(self.m0, tm0)
        mn1 = cute.arch.fmax(self.m1, tm1)
        al0 = cute.math.exp2(self.m0 - mn0, fastmath=True)
        al1 = cute.math.exp2(self.m1 - mn1, fastmath=True)
        self.m0 = mn0
        self.m1 = mn1
        return al0, al1

    def probabilities(self, s: list, al: tuple) -> list:
        """``P = exp2(S - m)`` of a tile's four elements ``s`` under the running maxima, added to the running
        sums (rescaled by ``al``, :meth:`advance`)."""
        p = [cute.math.exp2(s[0] - self.m0, fastmath=True), cute.math.exp2(s[1] - self.m1, fastmath=True),
             cute.math.exp2(s[2] - self.m0, fastmath=True), cute.math.exp2(s[3] - self.m1, fastmath=True)]
        for e in range(4):
            self.sums[e] = self.sums[e] * al[e % 2] + p[e]
        return p


@cute.jit
def tile_maxima(cfg, thr, sRed: cute.Tensor, tile, s: list, vs: list):
    """One shared-memory round for a tile's column maxima (of the four scores ``s``) and its largest bound
    on the P' units (token-wise V: :func:`foscar.cute.folds.p_units_bound` of this thread's two rows in ``vs``,
    one pair per channel group; the second group's maximum is left in slot ``HEADS + 1`` of ``sRed``).
    Lanes, then the four warps through ``sRed``'s buffer ``tile % 2``: ``(tm0, tm1, tv)``."""
    mx0 = cute.arch.fmax(s[0], s[2])
    mx1 = cute.arch.fmax(s[1], s[3])
    vs0, vs1 = vs[0]
    vmx = cute.arch.fmax(vs0, vs1)  # the bounds are >= 0
    for sh in cutlass.range_constexpr(3):
        mx0 = cute.arch.fmax(mx0, cute.arch.shuffle_sync_bfly(mx0, 4 << sh))
        mx1 = cute.arch.fmax(mx1, cute.arch.shuffle_sync_bfly(mx1, 4 << sh))
        vmx = cute.arch.fmax(vmx, cute.arch.shuffle_sync_bfly(vmx, 4 << sh))
    if cutlass.const_expr(thr.pair):  # the same head's column of the pass's other tile, two quads over
        mx0 = cute.arch.fmax(mx0, cute.arch.shuffle_sync_bfly(mx0, 2))
        mx1 = cute.arch.fmax(mx1, cute.arch.shuffle_sync_bfly(mx1, 2))
    vmx = cute.arch.fmax(vmx, cute.arch.shuffle_sync_bfly(vmx, 1))
    vmx = cute.arch.fmax(vmx, cute.arch.shuffle_sync_bfly(vmx, 2))
    if cutlass.const_expr(cfg.vc == 2):
        ws0, ws1 = vs[1]
        wmx = cute.arch.fmax(ws0, ws1)
        for sh in cutlass.range_constexpr(5):
            wmx = cute.arch.fmax(wmx, cute.arch.shuffle_sync_bfly(wmx, 16 >> sh))
    warp = thr.warp
    lane = thr.lane
    quad = thr.quad
    buf = tile % 2
    if lane < 4:
        sRed[buf, warp, 2 * lane] = mx0
        sRed[buf, warp, 2 * lane + 1] = mx1
    if lane == 0:
        sRed[buf, warp, HEADS] = vmx
        if cutlass.const_expr(cfg.vc == 2):
            sRed[buf, warp, HEADS + 1] = wmx
    cute.arch.barrier(barrier_id=thr.bar_id, number_of_threads=THREADS)
    tm0 = sRed[buf, 0, 2 * quad]
    tm1 = sRed[buf, 0, 2 * quad + 1]
    tv = sRed[buf, 0, HEADS]
    for wi in cutlass.range_constexpr(1, 4):
        tm0 = cute.arch.fmax(tm0, sRed[buf, wi, 2 * quad])
        tm1 = cute.arch.fmax(tm1, sRed[buf, wi, 2 * quad + 1])
        tv = cute.arch.fmax(tv, sRed[buf, wi, HEADS])
    return tm0, tm1, tv


@cute.jit
def column_sums(el: cute.Tensor, sSum: cute.Tensor, thr):
    """Sums over a tile's 64 token rows of per-element values ``el`` (element e: column 2 quad + e % 2):
    lanes sharing the columns, then the four warps through ``sSum``."""
    warp = thr.warp
    lane = thr.lane
    quad = thr.quad
    c0 = el[0] + el[2]
    c1 = el[1] + el[3]
    for sh in cutlass.range_constexpr(3):
        c0 = c0 + cute.arch.shuffle_sync_bfly(c0, 4 << sh)
        c1 = c1 + cute.arch.shuffle_sync_bfly(c1, 4 << sh)
    if cutlass.const_expr(thr.pair):  # two tiles per pass: the head's elements of the other tile
        c0 = c0 + cute.arch.shuffle_sync_bfly(c0, 2)
        c1 = c1 + cute.arch.shuffle_sync_bfly(c1, 2)
    cute.arch.barrier(barrier_id=thr.bar_id, number_of_threads=THREADS)  # earlier readers of sSum are done
    if lane < 4:
        sSum[warp, 2 * lane] = c0
        sSum[warp, 2 * lane + 1] = c1
    cute.arch.barrier(barrier_id=thr.bar_id, number_of_threads=THREADS)
    t0 = sSum[0, 2 * quad] + sSum[1, 2 * quad] + sSum[2, 2 * quad] + sSum[3, 2 * quad]
    t1 = sSum[0, 2 * quad + 1] + sSum[1, 2 * quad + 1] + sSum[2, 2 * quad + 1] + sSum[3, 2 * quad + 1]
    return t0, t1
