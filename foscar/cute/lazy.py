"""The online softmax with a lazy rescale (``Sm90Config.lazy_rescale``), through token-wise V's operand-fold
(:func:`lazy_softmax`) or channel-wise V's acc-fold (:func:`lazy_softmax_acc_fold`).

A pass keeps the running maxima ``m`` and the P' units ``sigma`` it has while no score passes its column's
maximum by more than :data:`~foscar.format.RESCALE_HEADROOM` and no token row asks for larger units;
then it needs neither the warps' exchange of maxima nor a rescale, and one barrier serves both the vote and
the P' stores (:func:`lazy_softmax`). The maxima are a shift that ``m + log2(sum)`` undoes, so any ``m``
within the headroom gives the same attention; ``P <= 2^8`` stays within FP16 P' and the FP32 sums. The scores
arrive less the maxima, from K's fold (:func:`~foscar.cute.folds.k_acc_fold` with ``mu``): ``P = exp2(d)``, and
the vote compares each with its column's threshold.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from ..format import RESCALE_HEADROOM
from .config import THREADS
from .fragment import s_slot, slot_elements
from .folds import gather_offset_corrections, p_column_sums, p_operands, p_scales, publish_p, store_p_operands
from .softmax import barrier_any, past_headroom, raised_maxima, tile_maxima


@cute.jit
def lazy_softmax(cfg, wg, state, sc, d: list, step, first: cutlass.Constexpr = 0,
                 pv_in_flight: cutlass.Constexpr = False):
    """The online softmax of a pass's scores ``d`` with a lazy rescale (token-wise V), through the P' stores:
    returns the new ``(softmax, out)``. ``d``: the scores less the maxima they are taken relative to
    (``softmax.m``, :class:`~foscar.cute.softmax.OnlineSoftmax` with thresholds); ``step``: the pass's index
    (the reduction buffer it takes).

    Each thread forms ``P = exp2(d)`` and ``P'`` in the units ``sigma`` it has, and stores ``P'``; one barrier
    (:func:`~foscar.cute.softmax.barrier_any`) publishes the stores and tells every thread whether any score
    passed its column's threshold (its maximum by more than :data:`~foscar.format.RESCALE_HEADROOM`, or
    any score where the column has seen none) or any token row asks for larger units
    (:func:`~foscar.cute.folds.p_units_bound`). Almost always none did, and the pass needs no exchange of
    maxima, no rescale and no second barrier (``P <= 2^8``: FP16 ``P'`` and the FP32 sums hold it, and the
    maxima are only a shift that ``m + log2(sum)`` undoes). Else the warps exchange the pass's maxima
    (:func:`~foscar.cute.softmax.tile_maxima`), rescale the state and store ``P'`` again, as every pass did
    before. A NaN score passes no comparison and stays NaN in ``P``; a column that has seen no token keeps its
    maximum at ``-inf`` (threshold ``-inf``) and its scores relative to 0. ``wg``: the
    :class:`~foscar.cute.warpgroup.Warpgroup`, ``state`` its :class:`~foscar.cute.warpgroup.RunningState`,
    ``sc`` the pass's :class:`~foscar.cute.warpgroup.TileScales` of this thread's rows. ``first``: the tile's
    first token in the pass's ``P'``; ``pv_in_flight``: a PV product may still be accumulating (an overlapped pass,
    :mod:`foscar.cute.overlap`), so the rare rescale waits for it first."""
    thr = wg.thr
    softmax = state.softmax
    out = state.out
    mu_old = softmax.m
    sigma_old = out.sigma
    n_el = len(d)
    slots = len(mu_old)
    groups = len(sigma_old)
    vb = sc.v_scales()
    need = past_headroom(d, softmax.thr)
    for g in cutlass.range_constexpr(groups):
        if cute.arch.fmax(vb[g][0], vb[g][1]) > sigma_old[g]:
            need = Int32(1)
    pt = cute.make_rmem_tensor(cute.make_layout(n_el), Float32)
    qt = [cute.make_rmem_tensor(cute.make_layout(n_el), Float16) for _ in range(groups)]
    mt = cute.make_rmem_tensor(cute.make_layout(slots), Float32)  # the maxima subtracted, and the thresholds
    ht = cute.make_rmem_tensor(cute.make_layout(slots), Float32)
    st = cute.make_rmem_tensor(cute.make_layout(groups), Float32)
    p = [cute.math.exp2(d[e], fastmath=True) for e in range(n_el)]
    q = p_operands(cfg, sc.v, p, sigma_old)
    store_p_operands(cfg, wg, q, first)
    kept = (pt, qt, mt, ht, st)
    _keep(kept, p, q, mu_old, softmax.thr, sigma_old)
    if barrier_any(need, thr.bar_id, THREADS) != 0:  # the same in every thread of the warpgroup
        if cutlass.const_expr(pv_in_flight):  # the accumulator is rescaled below
            warpgroup.wait_group(0)
        s = [d[e] + mu_old[s_slot(e)] for e in range(n_el)]
        tm, tv = tile_maxima(cfg, thr, wg.smem.sRed, step, s, vb)
        sigma = p_scales(cfg, wg, out, step, tv)
        mn_use, al, th = _raised(mu_old, softmax.thr, tm)
        out.scale_to(al, sigma)
        for k in cutlass.range_constexpr(slots):
            softmax.sums[k] = softmax.sums[k] * al[k]
            for g in cutlass.range_constexpr(groups):
                out.corr[g][k] = out.corr[g][k] * al[k]
        p2 = [cute.math.exp2(s[e] - mn_use[s_slot(e)], fastmath=True) for e in range(n_el)]
        q2 = p_operands(cfg, sc.v, p2, sigma)
        store_p_operands(cfg, wg, q2, first)
        cute.arch.barrier(barrier_id=thr.bar_id, number_of_threads=THREADS)
        _keep(kept, p2, q2, mn_use, th, sigma)
    sigma_new = [st[g] for g in range(groups)]
    p_new = [pt[e] for e in range(n_el)]
    add_slot_sums(softmax.sums, p_new)
    gather_offset_corrections(cfg, out, sc.v, p_new, [[qt[g][e] for e in range(n_el)] for g in range(groups)],
                              sigma_new)
    softmax.m = [mt[k] for k in range(slots)]
    softmax.thr = [ht[k] for k in range(slots)]
    out.sigma = sigma_new
    return softmax, out


@cute.jit
def lazy_softmax_acc_fold(cfg, wg, state, d: list, step):
    """The online softmax of a tile's scores ``d`` (less the maxima, as in :func:`lazy_softmax`) with a lazy
    rescale, channel-wise V: returns ``(softmax, out, psum)``, the column sums of the tile's ``P~`` for
    :func:`~foscar.cute.folds.v_acc_fold_product`. ``step``: the tile's index (the reduction buffer it takes).

    Each thread forms ``P = exp2(d)`` and publishes ``P~ = fp16(P)`` with its warp's column sums
    (:func:`~foscar.cute.folds.publish_p`); one barrier publishes them and tells every thread whether any score
    passed its column's threshold. Almost always none did: no exchange of maxima, no rescale (``P <= 2^8``
    within FP16 ``P~`` and the FP32 sums). Else the warps exchange the tile's maxima
    (:func:`~foscar.cute.softmax.tile_maxima`, slots below ``cols``), the accumulator and the sums are rescaled,
    and ``P~`` and its sums are published again behind a second barrier. NaN scores and empty columns as in
    :func:`lazy_softmax`."""
    thr = wg.thr
    softmax = state.softmax
    out = state.out
    mu_old = softmax.m
    n_el = len(d)
    slots = len(mu_old)
    buf = step & 1
    sRed = wg.smem.sRed
    need = past_headroom(d, softmax.thr)
    pt = cute.make_rmem_tensor(cute.make_layout(n_el), Float32)
    mt = cute.make_rmem_tensor(cute.make_layout(slots), Float32)
    ht = cute.make_rmem_tensor(cute.make_layout(slots), Float32)
    p = [cute.math.exp2(d[e], fastmath=True) for e in range(n_el)]
    publish_p(cfg, wg, [Float16(x) for x in p], buf)
    _keep((pt, [], mt, ht, []), p, [], mu_old, softmax.thr, [])
    if barrier_any(need, thr.bar_id, THREADS) != 0:  # the same in every thread of the warpgroup
        s = [d[e] + mu_old[s_slot(e)] for e in range(n_el)]
        tm, _ = tile_maxima(cfg, thr, sRed, step, s, None)  # channel-wise V: no P' units
        mn_use, al, th = _raised(mu_old, softmax.thr, tm)
        out.scale_to(al, out.sigma)
        for k in cutlass.range_constexpr(slots):
            softmax.sums[k] = softmax.sums[k] * al[k]
        p2 = [cute.math.exp2(s[e] - mn_use[s_slot(e)], fastmath=True) for e in range(n_el)]
        publish_p(cfg, wg, [Float16(x) for x in p2], buf)  # the column sums' slots: read by no one yet
        cute.arch.barrier(barrier_id=thr.bar_id, number_of_threads=THREADS)
        _keep((pt, [], mt, ht, []), p2, [], mn_use, th, [])
    add_slot_sums(softmax.sums, [pt[e] for e in range(n_el)])
    softmax.m = [mt[k] for k in range(slots)]
    softmax.thr = [ht[k] for k in range(slots)]
    return softmax, out, p_column_sums(cfg, wg, buf, n_el // 2)


def add_slot_sums(sums: cute.Tensor, p: list):
    """A pass's ``P`` (element ``e``: column slot :func:`~foscar.cute.fragment.s_slot`) added to the running sums
    by column slot, a slot's two token rows in turn."""
    for k in range(cute.size(sums)):
        e, e2 = slot_elements(k)
        sums[k] = (sums[k] + p[e]) + p[e2]


def _raised(mu: list, thr: list, tm: list):
    """``(mn_use, al, th)`` once a pass's column maxima ``tm`` are known: the new maxima to subtract (0 while a
    column has seen no token), the factors that rescale what was accumulated relative to ``mu`` and the new
    thresholds (``-inf`` for a column still empty)."""
    m = [_running_maximum(mu[k], thr[k]) for k in range(len(mu))]
    mn, mn_use, al = raised_maxima(m, tm, True)
    return mn_use, al, [_threshold(x) for x in mn]


@cute.jit
def _running_maximum(mu: Float32, thr: Float32) -> Float32:
    """A column's running maximum from the maximum its scores are taken relative to and its threshold:
    ``-inf`` while it has seen no token."""
    m = mu
    if thr == -Float32.inf:
        m = -Float32.inf
    return m


@cute.jit
def _threshold(m: Float32) -> Float32:
    """A column's threshold on its relative scores under the running maximum ``m``: the headroom, or ``-inf``
    (any score) while it has seen no token."""
    t = Float32(RESCALE_HEADROOM)
    if m == -Float32.inf:
        t = -Float32.inf
    return t


def _keep(kept: tuple, p: list, q: list, m: list, th: list, sigma: list):
    """The pass's ``P``, ``P'`` (per group), maxima subtracted, thresholds and units into the register tensors
    ``kept`` that carry them out of the run-time branch of :func:`lazy_softmax` (:func:`lazy_softmax_acc_fold`: no
    ``P'`` or units)."""
    pt, qt, mt, ht, st = kept
    for e in range(len(p)):
        pt[e] = p[e]
        for g in range(len(q)):
            qt[g][e] = q[g][e]
    for k in range(len(m)):
        mt[k] = m[k]
        ht[k] = th[k]
    for g in range(len(sigma)):
        st[g] = sigma[g]
