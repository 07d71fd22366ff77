"""The online softmax with a lazy rescale (``Sm90Config.lazy_rescale``), through token-wise V's operand-fold
(:func:`lazy_softmax`) or channel-wise V's acc-fold (:func:`lazy_softmax_acc_fold`).

A pass keeps the running maxima ``m`` and the P' units ``sigma`` it has while no score passes its column's
maximum by more than :data:`~foscar.format.RESCALE_HEADROOM` and no token row asks for larger units;
then it needs neither the warps' exchange of maxima nor a rescale, and one barrier serves both the vote and
the P' stores (:func:`lazy_softmax`). The maxima are a shift that ``m + log2(sum)`` undoes, so any ``m``
within the headroom gives the same attention; ``P <= 2^8`` stays within FP16 P' and the FP32 sums. The scores
arrive less the maxima, from K's fold (:func:`~foscar.cute.folds.k_acc_fold` with ``mu``): ``P = exp2(d)``, and
the vote compares each with its column's threshold. With ``Sm90Config.pair_vote`` it compares ``P``'s FP16 pairs,
which the P' scaling forms (:func:`~foscar.cute.folds.scaled_pairs`), with thresholds held in ``P``'s domain as FP16
pairs (:func:`pair_vote_barrier`).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32, Uint32
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import dsl_user_op

from ..format import RESCALE_HEADROOM
from .config import THREADS
from .fragment import s_slot, slot_elements
from .folds import gather_offset_corrections, p_column_sums, p_operands, p_scales, publish_p, store_p_operands
from .ptx import asm, f16_pair
from .softmax import barrier_any, barrier_or, past_headroom, raised_maxima, tile_maxima

#: Two columns' thresholds in ``P``'s domain (``Sm90Config.pair_vote``), an FP16 pair, while neither has seen a token:
#: -1 each, so that any ``P`` votes (a masked score's 0 too; ``P`` underflows FP16 below ``2^-24``, so 0 would miss a
#: first score far below the column's start)
EMPTY_PAIR = 0xBC00BC00


@cute.jit
def lazy_softmax(cfg, wg, state, sc, d: list, step, first: cutlass.Constexpr = 0,
                 pv_in_flight: cutlass.Constexpr = False):
    """The online softmax of a pass's scores ``d`` with a lazy rescale (token-wise V), through the P' stores:
    returns the new ``(softmax, out)``. ``d``: the scores less the maxima they are taken relative to
    (``softmax.m``, :class:`~foscar.cute.softmax.OnlineSoftmax` with thresholds); ``step``: the pass's index
    (the reduction buffer it takes).

    Each thread forms ``P = exp2(d)`` and ``P'`` in the units ``sigma`` it has, and stores ``P'``; one barrier
    (:func:`_vote`) publishes the stores and tells every thread whether any score
    passed its column's threshold (its maximum by more than :data:`~foscar.format.RESCALE_HEADROOM`, or
    any score where the column has seen none) or any token row asks for larger units
    (:func:`~foscar.cute.folds.p_units_bound`). Almost always none did, and the pass needs no exchange of
    maxima, no rescale and no second barrier (``P <= 2^8``: FP16 ``P'`` and the FP32 sums hold it, and the
    maxima are only a shift that ``m + log2(sum)`` undoes). Else the warps exchange the pass's maxima
    (:func:`~foscar.cute.softmax.tile_maxima`), rescale the state and store ``P'`` again, as every pass did
    before. A NaN score passes no comparison and stays NaN in ``P``; a column that has seen no token keeps its
    maximum at ``-inf`` (threshold ``-inf``, or -1 in ``P``'s domain) and its scores relative to 0. ``wg``: the
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
    p = [cute.math.exp2(d[e], fastmath=True) for e in range(n_el)]
    units = [(cute.arch.fmax(vb[g][0], vb[g][1]), sigma_old[g]) for g in range(groups)]  # a row asks for more
    pt = cute.make_rmem_tensor(cute.make_layout(n_el), Float32)
    qt = [cute.make_rmem_tensor(cute.make_layout(n_el), Float16) for _ in range(groups)]
    mt = cute.make_rmem_tensor(cute.make_layout(slots), Float32)  # the maxima subtracted, and the thresholds
    ht = _threshold_tensor(cfg, slots)
    st = cute.make_rmem_tensor(cute.make_layout(groups), Float32)
    q = p_operands(cfg, sc.v, p, sigma_old)
    store_p_operands(cfg, wg, q, first)
    kept = (pt, qt, mt, ht, st)
    _keep(kept, p, q, mu_old, softmax.thr, sigma_old)
    if _vote(cfg, thr, d, p, softmax.thr, units) != 0:  # the same in every thread of the warpgroup
        if cutlass.const_expr(pv_in_flight):  # the accumulator is rescaled below
            warpgroup.wait_group(0)
        s = [d[e] + mu_old[s_slot(e)] for e in range(n_el)]
        tm, tv = tile_maxima(cfg, thr, wg.smem.sRed, step, s, vb)
        sigma = p_scales(cfg, wg, out, step, tv)
        mn_use, al, th = _raised(cfg, mu_old, softmax.thr, tm)
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
    softmax.thr = [ht[k] for k in range(cute.size(ht))]
    out.sigma = sigma_new
    return softmax, out


@cute.jit
def lazy_softmax_acc_fold(cfg, wg, state, d: list, step):
    """The online softmax of a tile's scores ``d`` (less the maxima, as in :func:`lazy_softmax`) with a lazy
    rescale, channel-wise V: returns ``(softmax, out, psum)``, the column sums of the tile's ``P`` as consumed for
    :func:`~foscar.cute.folds.v_acc_fold_product` (None where V^T's extra m64 block sums them there,
    ``Sm90Config.column_sum_mma``). ``step``: the tile's index (the reduction buffer it takes).

    Each thread forms ``P = exp2(d)`` and publishes ``P~`` (:func:`~foscar.cute.folds.p_tilde`) with its warp's
    column sums (:func:`~foscar.cute.folds.publish_p`); one barrier publishes them and tells every thread whether any
    score passed its column's threshold. Almost always none did: no exchange of maxima, no rescale (``P <= 2^8``
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
    pt = cute.make_rmem_tensor(cute.make_layout(n_el), Float32)
    mt = cute.make_rmem_tensor(cute.make_layout(slots), Float32)
    ht = _threshold_tensor(cfg, slots)
    p = [cute.math.exp2(d[e], fastmath=True) for e in range(n_el)]
    publish_p(cfg, wg, p, buf)
    _keep((pt, [], mt, ht, []), p, [], mu_old, softmax.thr, [])
    if _vote(cfg, thr, d, p, softmax.thr, []) != 0:  # the same in every thread of the warpgroup
        s = [d[e] + mu_old[s_slot(e)] for e in range(n_el)]
        tm, _ = tile_maxima(cfg, thr, sRed, step, s, None)  # channel-wise V: no P' units
        mn_use, al, th = _raised(cfg, mu_old, softmax.thr, tm)
        out.scale_to(al, out.sigma)
        for k in cutlass.range_constexpr(slots):
            softmax.sums[k] = softmax.sums[k] * al[k]
        p2 = [cute.math.exp2(s[e] - mn_use[s_slot(e)], fastmath=True) for e in range(n_el)]
        publish_p(cfg, wg, p2, buf)  # the column sums' slots: read by no one yet
        cute.arch.barrier(barrier_id=thr.bar_id, number_of_threads=THREADS)
        _keep((pt, [], mt, ht, []), p2, [], mn_use, th, [])
    add_slot_sums(softmax.sums, [pt[e] for e in range(n_el)])
    softmax.m = [mt[k] for k in range(slots)]
    softmax.thr = [ht[k] for k in range(cute.size(ht))]
    return softmax, out, p_column_sums(cfg, wg, buf, n_el // 2)


def add_slot_sums(sums: cute.Tensor, p: list):
    """A pass's ``P`` (element ``e``: column slot :func:`~foscar.cute.fragment.s_slot`) added to the running sums
    by column slot, a slot's two token rows in turn."""
    for k in range(cute.size(sums)):
        e, e2 = slot_elements(k)
        sums[k] = (sums[k] + p[e]) + p[e2]


def _raised(cfg, mu: list, thr: list, tm: list):
    """``(mn_use, al, th)`` once a pass's column maxima ``tm`` are known: the new maxima to subtract (0 while a
    column has seen no token), the factors that rescale what was accumulated relative to ``mu`` and the new
    thresholds (``-inf`` for a column still empty; ``cfg.pair_vote``: :func:`pair_thresholds`)."""
    if cutlass.const_expr(cfg.pair_vote):  # a half's sign: -1, the column empty
        empty = [(thr[k // 2] >> (16 * (k % 2) + 15)) & Uint32(1) != Uint32(0) for k in range(len(mu))]
    else:
        empty = [thr[k] == -Float32.inf for k in range(len(mu))]
    m = [_running_maximum(mu[k], empty[k]) for k in range(len(mu))]
    mn, mn_use, al = raised_maxima(m, tm, True)
    if cutlass.const_expr(cfg.pair_vote):
        return mn_use, al, pair_thresholds(mn)
    return mn_use, al, [_threshold(x) for x in mn]


@cute.jit
def _running_maximum(mu: Float32, empty) -> Float32:
    """A column's running maximum from the maximum its scores are taken relative to: ``-inf`` while it has seen
    no token (``empty``)."""
    m = mu
    if empty:
        m = -Float32.inf
    return m


@cute.jit
def _threshold(m: Float32, in_p: cutlass.Constexpr = False) -> Float32:
    """A column's threshold under the running maximum ``m``: on its relative scores the headroom, or ``-inf`` (any
    score) while it has seen no token; ``in_p``: in ``P``'s domain, ``2^headroom``, or -1 (any ``P``)."""
    t = Float32(2.0 ** RESCALE_HEADROOM if in_p else RESCALE_HEADROOM)
    if m == -Float32.inf:
        t = Float32(-1.0) if in_p else -Float32.inf
    return t


def pair_thresholds(m: list) -> list:
    """The thresholds in ``P``'s domain of the columns whose running maxima are ``m`` (by column slot), as FP16
    pairs (word ``j``: slots ``2 j`` and ``2 j + 1``, :func:`pair_vote_barrier`)."""
    return [f16_pair(_threshold(m[k], True), _threshold(m[k + 1], True)) for k in range(0, len(m), 2)]


@cute.jit
def _vote(cfg, thr, d: list, p: list, thresholds: list, units: list) -> Int32:
    """The pass's one barrier (the warpgroup's, publishing the ``P'`` stores) and its vote, 1 or 0 in every thread:
    whether any score ``d`` passed its column's threshold, or (``units``, pairs ``(a, b)``) any ``a > b``.
    ``cfg.pair_vote``: on ``P``'s FP16 pairs (``p``: ``P``, :func:`pair_vote_barrier`)."""
    if cutlass.const_expr(cfg.pair_vote):
        pairs = [f16_pair(p[e], p[e + 1]) for e in range(0, len(p), 2)]
        return pair_vote_barrier(pairs, thresholds, units, thr.bar_id, THREADS)
    need = past_headroom(d, thresholds)
    for a, b in units:
        if a > b:
            need = Int32(1)
    return barrier_any(need, thr.bar_id, THREADS)


@dsl_user_op
def pair_vote_barrier(pairs: list, thr: list, units: list, barrier_id, number_of_threads: int, *, loc=None,
                      ip=None) -> Int32:
    """The lazy rescale's vote on ``P``'s FP16 pairs (``Sm90Config.pair_vote``) in the named barrier ``barrier_id``
    of ``number_of_threads`` (:func:`~foscar.cute.softmax.barrier_any`): 1 in every thread where in any thread a
    ``P`` passes its column's threshold in ``P``'s domain or, of a pair ``(a, b)`` of FP32 ``units``, ``a > b``;
    else 0. ``pairs[i]``: elements ``2 i`` and ``2 i + 1`` (a token row's two adjacent columns: slots ``2 j``,
    ``2 j + 1`` for ``i = 2 j`` and ``2 j + 1``, the two token rows); ``thr[j]``: those slots' thresholds
    (:func:`pair_thresholds`). A column block's two rows are joined (``max.f16x2``, which drops a NaN as the
    comparison of a NaN score fails) and compared in pairs (``setp.gt.f16x2``), each comparison taking one earlier
    predicate: two instructions a block of four scores, and the predicates joined once. ``P`` rounded to FP16 may
    pass ``2^headroom`` by up to ``2^-11`` of it without a vote: within FP16 ``P'`` and the FP32 sums all the same."""
    n, nu, u = len(pairs), len(units), 1 + len(pairs) + len(thr)  # operands: $1 pairs, thr, units, barrier_id
    body = ["setp.ne.u32 c, 0, 0;"]  # false
    for i in range(nu):
        body.append(f"setp.gt.or.f32 c, ${u + 2 * i}, ${u + 1 + 2 * i}, c;")
    for j in range(len(thr)):
        x, y, t = 1 + 2 * j, 2 + 2 * j, 1 + n + j
        body.append(f"max.f16x2 m, ${x}, ${y};")
        body.append(f"setp.gt.or.f16x2 p{j}|q{j}, m, ${t}, {'c' if j == 0 else f'p{j - 1}'};")
    last = [f"p{len(thr) - 1}"] + [f"q{j}" for j in range(len(thr))]
    body.append(f"or.pred r, {last[0]}, {last[1]};")
    body += [f"or.pred r, r, {x};" for x in last[2:]]
    body += barrier_or("r", "r", f"${u + 2 * nu}", number_of_threads)
    preds = ", ".join(["c", "r"] + [f"p{j}, q{j}" for j in range(len(thr))])
    args = [Uint32(w) for w in list(pairs) + list(thr)] + [Float32(x) for ab in units for x in ab] + [Int32(barrier_id)]
    return asm(Int32, args, ".reg .pred " + preds + ";\n\t.reg .b32 m;\n\t" + "\n\t".join(body), memory=True,
               loc=loc, ip=ip)


def _threshold_tensor(cfg, slots: int) -> cute.Tensor:
    """The register tensor that carries a pass's thresholds out of the rare branch: by column slot, or
    (``cfg.pair_vote``) one FP16 pair for two slots."""
    if cutlass.const_expr(cfg.pair_vote):
        return cute.make_rmem_tensor(cute.make_layout(slots // 2), Uint32)
    return cute.make_rmem_tensor(cute.make_layout(slots), Float32)


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
    for k in range(len(th)):
        ht[k] = th[k]
    for g in range(len(sigma)):
        st[g] = sigma[g]
