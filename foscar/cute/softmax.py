"""Online softmax (base 2) over the token axis of ``S^T``, per query-row column, for one warpgroup.

A thread holds ``4 nb`` elements of a tile's ``S^T`` (``nb = cols / 8`` column blocks; element ``e``: column
slot :func:`~foscar.cute.fragment.s_slot`, the column ``8 (e // 4) + 2 quad + e % 2``, token row
``row0 + 8 ((e // 2) % 2)``), two columns per block; a column's 64 tokens sit on the eight lanes sharing
``quad`` in each of the four warps, so a column reduction is three butterfly shuffles, then the warps
through shared memory. With two tiles per pass (``thr.pair``, :mod:`foscar.cute.pair`, 8 columns) quads 2
and 3 hold the second tile's heads 0-3: one more shuffle joins a head's two tiles.
:class:`OnlineSoftmax` is the running state of a thread's ``2 nb`` columns.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cutlass_dsl import dsl_user_op

from .config import HEADS, THREADS
from .fragment import s_slot, slot_elements
from .ptx import asm


class OnlineSoftmax:
    """The running maxima ``m`` of this thread's ``2 nb`` columns (base 2, scaled scores; a list by column
    slot) and the running sums ``sums`` of ``exp2(s - m)`` per column slot (a ``2 nb``-register tensor: the
    thread's two token rows of the slot, summed over the warpgroup's rows at the end: :func:`column_sums`). A
    run-time loop carries ``m``.
    ``guard`` (a step of several tokens): a column may see no token of a tile or of a whole split (its
    causal limit), and its maximum stays ``-inf``; the exponentials then take 0 in its place, so that
    ``exp2(-inf - -inf)`` never makes a NaN of an empty column.

    The lazy rescale (:mod:`foscar.cute.lazy`) carries ``thr`` too: ``m`` then holds the maxima the scores are
    taken relative to (a column's running maximum, 0 while it has seen no token) and ``thr`` each column's
    threshold on those relative scores (:data:`~foscar.format.RESCALE_HEADROOM`, ``-inf`` while it has seen
    no token; ``Sm90Config.pair_vote``: in ``P``'s domain, FP16 pairs, :func:`foscar.cute.lazy.pair_thresholds`),
    so that a tile's scores come from K's fold already less the maxima."""

    def __init__(self, m: list, sums: cute.Tensor, guard: bool = False, thr: list | None = None):
        self.m = m
        self.sums = sums
        self.guard = guard
        self.m_use = m
        self.thr = thr

    def __extract_mlir_values__(self):
        return [x.ir_value() for x in self.m + (self.thr or [])]

    def __new_from_mlir_values__(self, values) -> OnlineSoftmax:
        n = len(self.m)
        thr = None if self.thr is None else [type(t)(v) for t, v in zip(self.thr, values[n:])]
        return OnlineSoftmax([Float32(v) for v in values[:n]], self.sums, self.guard, thr)

    def advance(self, tm: list) -> list:
        """Take a tile's column maxima ``tm``: the new running maxima, and the factors ``al`` (by column slot)
        that rescale what was accumulated under the old ones."""
        self.m, self.m_use, al = raised_maxima(self.m, tm, self.guard)
        return al

    def probabilities(self, s: list, al: list) -> list:
        """``P = exp2(S - m)`` of a tile's elements ``s`` under the running maxima, added to the running sums
        (rescaled by ``al``, :meth:`advance`)."""
        p = [cute.math.exp2(s[e] - self.m_use[s_slot(e)], fastmath=True) for e in range(len(s))]
        for k in range(len(s) // 2):  # slot k: its two token rows' elements
            e, e2 = slot_elements(k)
            self.sums[k] = (self.sums[k] * al[k] + p[e]) + p[e2]
        return p


@dsl_user_op
def barrier_any(pred: Int32, barrier_id, number_of_threads: int, *, loc=None, ip=None) -> Int32:
    """Named barrier ``barrier_id`` (an int or a warp-uniform run-time value) of ``number_of_threads``
    (``bar.red.or.pred``) that also returns, to every thread, whether ``pred`` is nonzero in any of them: 1 or 0,
    the same in all. Orders shared memory as ``bar.sync`` does. (NVVM's barrier op takes a reduction on barrier 0
    only: inline PTX.)"""
    body = [".reg .pred p, q;", "setp.ne.u32 p, $1, 0;", *barrier_or("q", "p", "$2", number_of_threads)]
    return asm(Int32, [Int32(pred), Int32(barrier_id)], "\n\t".join(body), memory=True, loc=loc, ip=ip)


def barrier_or(out: str, pred: str, barrier: str, number_of_threads: int) -> list:
    """The PTX lines of :func:`barrier_any`'s barrier: predicate ``out`` the OR of ``pred`` over the
    ``number_of_threads`` threads of named barrier ``barrier`` (an operand), and ``$0`` 1 or 0 from it."""
    return [f"bar.red.or.pred {out}, {barrier}, {int(number_of_threads)}, {pred};", f"selp.u32 $0, 1, 0, {out};"]


def maxima_to_subtract(m: list, guard: bool) -> list:
    """The running maxima a tile's exponentials subtract: ``m``, or with ``guard`` (a column may have seen no
    token) :func:`nonempty_max` of each."""
    return [nonempty_max(x) for x in m] if guard else m


def raised_maxima(m: list, tm: list, guard: bool):
    """``(mn, mn_use, al)``: the running maxima ``m`` raised to a tile's column maxima ``tm``, those to subtract
    (:func:`maxima_to_subtract`) and the factors that rescale what was accumulated under ``m``."""
    mn = [cute.arch.fmax(m[k], tm[k]) for k in range(len(tm))]
    mn_use = maxima_to_subtract(mn, guard)
    return mn, mn_use, [cute.math.exp2(m[k] - mn_use[k], fastmath=True) for k in range(len(tm))]


@cute.jit
def past_headroom(d: list, thr: list) -> Int32:
    """1 where any of this thread's scores ``d`` (relative to the maxima) passes its column's threshold (``thr``,
    by column slot), else 0: the lazy rescale's vote (:mod:`foscar.cute.lazy`)."""
    need = Int32(0)
    for e in cutlass.range_constexpr(len(d)):
        if d[e] > thr[s_slot(e)]:
            need = Int32(1)
    return need


@cute.jit
def nonempty_max(m: Float32) -> Float32:
    """A running maximum to subtract: ``m``, or 0 while its column has seen no token (``-inf``)."""
    u = m
    if m == -Float32.inf:
        u = Float32(0.0)
    return u


def reduction_layout(cfg) -> cute.Layout:
    """The layout of a warpgroup's reduction slots ``sRed[buf, warp, slot]``: the four warps' values of a slot
    side by side (16 bytes), so that a thread reads a slot's four with one vector load."""
    return cute.make_layout((2, 4, cfg.red_slots), stride=(4, 1, 8))


@cute.jit
def tile_maxima(cfg, thr, sRed: cute.Tensor, tile, s: list, vs: list):
    """One shared-memory round for a tile's column maxima (of the scores ``s``) and its largest bound
    on the P' units (token-wise V: :func:`foscar.cute.folds.p_units_bound` of this thread's two rows in ``vs``,
    one pair per channel group; the second group's maximum is left in slot ``cols + 1`` of ``sRed``; channel-wise
    V: none, ``vs`` unread, ``tv`` 0, its slots from ``cols`` are the column sums of ``P~``,
    :func:`foscar.cute.folds.publish_p`).
    Lanes, then the four warps through ``sRed``'s buffer ``tile % 2``: ``(tm, tv)``, ``tm`` by column slot."""
    slots = 2 * cfg.nb
    units = not cfg.v_channel  # token-wise V: the largest bound on the P' units rides along
    mx = [cute.arch.fmax(s[e], s[e2]) for e, e2 in map(slot_elements, range(slots))]
    vmx = Float32(0.0)
    if cutlass.const_expr(units):
        vs0, vs1 = vs[0]
        vmx = cute.arch.fmax(vs0, vs1)  # the bounds are >= 0
    for sh in cutlass.range_constexpr(3):
        for k in cutlass.range_constexpr(slots):
            mx[k] = cute.arch.fmax(mx[k], cute.arch.shuffle_sync_bfly(mx[k], 4 << sh))
        if cutlass.const_expr(units):
            vmx = cute.arch.fmax(vmx, cute.arch.shuffle_sync_bfly(vmx, 4 << sh))
    if cutlass.const_expr(thr.pair):  # the same head's column of the pass's other tile, two quads over
        for k in cutlass.range_constexpr(slots):
            mx[k] = cute.arch.fmax(mx[k], cute.arch.shuffle_sync_bfly(mx[k], 2))
    if cutlass.const_expr(units):
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
    buf = tile & 1  # tile >= 0
    cols = cfg.cols
    if lane < 4:
        for k in cutlass.range_constexpr(slots):
            sRed[buf, warp, HEADS * (k // 2) + 2 * lane + k % 2] = mx[k]
    if cutlass.const_expr(units):
        if lane == 0:
            sRed[buf, warp, cols] = vmx
            if cutlass.const_expr(cfg.vc == 2):
                sRed[buf, warp, cols + 1] = wmx
    cute.arch.barrier(barrier_id=thr.bar_id, number_of_threads=THREADS)
    tm = [sRed[buf, 0, HEADS * (k // 2) + 2 * quad + k % 2] for k in range(slots)]
    tv = Float32(0.0)
    if cutlass.const_expr(units):
        tv = sRed[buf, 0, cols]
    for wi in cutlass.range_constexpr(1, 4):
        for k in cutlass.range_constexpr(slots):
            tm[k] = cute.arch.fmax(tm[k], sRed[buf, wi, HEADS * (k // 2) + 2 * quad + k % 2])
        if cutlass.const_expr(units):
            tv = cute.arch.fmax(tv, sRed[buf, wi, cols])
    return tm, tv


@cute.jit
def column_sums(el: cute.Tensor, sSum: cute.Tensor, thr) -> list:
    """Sums over a tile's 64 token rows of per-slot values ``el`` (``2 nb``, by column slot: each the sum of
    the thread's two token rows): lanes sharing the columns, then the four warps through ``sSum``
    (``[4, cols]``). Returns the sums by column slot."""
    warp = thr.warp
    lane = thr.lane
    quad = thr.quad
    slots = cute.size(el)
    c = [el[k] for k in range(slots)]
    for sh in cutlass.range_constexpr(3):
        for k in cutlass.range_constexpr(slots):
            c[k] = c[k] + cute.arch.shuffle_sync_bfly(c[k], 4 << sh)
    if cutlass.const_expr(thr.pair):  # two tiles per pass: the head's elements of the other tile
        for k in cutlass.range_constexpr(slots):
            c[k] = c[k] + cute.arch.shuffle_sync_bfly(c[k], 2)
    cute.arch.barrier(barrier_id=thr.bar_id, number_of_threads=THREADS)  # earlier readers of sSum are done
    if lane < 4:
        for k in cutlass.range_constexpr(slots):
            sSum[warp, HEADS * (k // 2) + 2 * lane + k % 2] = c[k]
    cute.arch.barrier(barrier_id=thr.bar_id, number_of_threads=THREADS)
    t = []
    for k in cutlass.range_constexpr(slots):
        col = HEADS * (k // 2) + 2 * quad + k % 2
        t.append(sSum[0, col] + sSum[1, col] + sSum[2, col] + sSum[3, col])
    return t


@cute.jit
def raise_running_maximum(m: Float32, values):
    """One step of a base-2 running merge (the combine's partials, :mod:`foscar.cute.windows`' tokens):
    ``(m_new, m_safe, scale)``, the maximum of ``m`` and ``values`` (an iterable, read in order; ``fmax`` skips a NaN, whose weight
    ``2^(NaN - m_safe)`` is NaN), the maximum to subtract (0 while it is ``-inf``) and the factor of what was
    summed under ``m`` (0 while nothing was seen)."""
    m_new = m
    for x in values:
        m_new = cute.arch.fmax(m_new, x)
    m_safe = m_new
    if m_new == -Float32.inf:
        m_safe = Float32(0.0)
    return m_new, m_safe, cute.math.exp2(m - m_safe, fastmath=True)


@cute.jit
def merged_output(acc: Float32, total: Float32) -> Float32:
    """The output of a running merge (the combine's, the split merges in stage 1): ``acc / total``, or ``acc`` (0)
    where nothing weighed (``total`` 0); a NaN total divides and stays NaN."""
    denom = Float32(1.0)
    if total != 0:  # NaN != 0
        denom = total
    return acc / denom


@cute.jit
def merged_lse(m: Float32, total: Float32) -> Float32:
    """The natural-log LSE of a base-2 running merge (the combine's, the split merges in stage 1) with maximum ``m``
    and sum ``total``: ``-inf`` where nothing weighed, NaN where the sum is."""
    out = -Float32.inf
    if total != 0:  # NaN != 0
        m_safe = m
        if m == -Float32.inf:
            m_safe = Float32(0.0)
        out = (m_safe + cute.math.log2(total)) * Float32(0.6931471805599453)
    return out
