"""Channel-wise K's operand-fold with E4M3 K operands (paper Sec. 4.1): a token group's ``Q' = Q s'`` as two E4M3
terms with a power-of-two scale per query row, and its offset correction per row (:func:`fold_q_terms`); which
thread builds which contraction indices is :mod:`foscar.cute.fold_map`'s.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint32

from .fold_map import TERM_CHANNELS, term_channels, term_chunk
from .operands_e4m3 import power_of_two, scale_exponent, term_stride


@cute.jit
def fold_q_terms(cfg, t, threads: int, sQ: cute.Tensor, sQk: cute.Tensor, sKf: cute.Tensor, buf, params: cute.Tensor,
                 turn=None):
    """:func:`~foscar.cute.folds.fold_q` with E4M3 K operands: ``Q' = Q s'`` of each query row as two E4M3 terms
    with a power-of-two scale ``2^e`` per row (from the row's largest ``|Q'|``, its builders' butterfly maximum,
    :func:`~foscar.cute.operands_e4m3.scale_exponent`), ``hi = e4m3(Q' 2^e)`` in column ``h`` and ``lo =
    e4m3((Q' 2^e - hi) 16)`` in column ``gp + h`` (:func:`~foscar.cute.operands_e4m3.term_stride`) at the
    channel's contraction index; ``sKf[buf, h]`` the row's correction ``sum_d Q mid - u sum_d Q'`` (``u``: the
    middle code, ``k_factor * pivot`` of either token half; ``Q'`` as the terms carry it) and ``sKf[buf, cols + h]
    = 2^-e``; the columns of no term are :func:`fold_terms_padding`'s, written once. Thread ``t`` builds
    contraction indices ``4 k .. 4 k + 3`` of row ``h`` (:func:`~foscar.cute.fold_map.term_chunk`; with fewer
    threads than rows, the rows in turns), one 32-bit word of each term, from two BF16 words of Q and two 16-byte
    ``(s', z')`` pairs of ``params`` (the group's ``(s', z')`` row, channel ``d``'s at ``2 d``, ``2 d + 1``;
    :func:`~foscar.cute.fold_map.term_channels`); ``turn``: that turn's rows only (of :func:`fold_turns`; a caller's
    loop at run time keeps one turn's registers live). No synchronisation: the caller fences the writes for the
    wgmma's proxy and publishes them."""
    D = cfg.head_dim
    lanes = D // TERM_CHANNELS  # builders of a row: consecutive lanes of one warp
    rows = threads // lanes  # rows built at once
    gp = term_stride(cfg)
    unit = cfg.k_factors[0] * cfg.k_pivots[0]
    h0, k = term_chunk(D, t)
    d0, off = term_channels(cfg.bits, k)
    qv = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
    pv = cute.make_rmem_tensor(cute.make_layout(4), Float32)
    r = cute.make_rmem_tensor(cute.make_layout(TERM_CHANNELS), Float32)  # Q' at indices 4 k + v, then times 2^e
    hi = cute.make_rmem_tensor(cute.make_layout(TERM_CHANNELS), Float8E4M3FN)
    lo = cute.make_rmem_tensor(cute.make_layout(TERM_CHANNELS), Float8E4M3FN)
    for j in cutlass.range_constexpr(1 if turn is not None else fold_turns(cfg, threads)):  # the rows in turns
        h = h0 + (j if turn is None else turn) * rows
        row = cutlass.min(h, cfg.gqa - 1)  # a row past the heads folds a head's and stores nothing
        part = Float32(0.0)
        top = Float32(0.0)
        for w in cutlass.range_constexpr(2):  # channels d0 + w off and the next: indices 4 k + w and 4 k + w + 2
            d = d0 + w * off
            cute.autovec_copy(cute.local_tile(sQ[(row, None)], (2,), (d // 2,)), qv)
            cute.autovec_copy(cute.local_tile(params, (4,), (d // 2,)), pv)
            for i in cutlass.range_constexpr(2):
                x = Float32(qv[i])
                sc = pv[2 * i]
                part = part + x * (pv[2 * i + 1] + cfg.k_mid * sc)
                y = x * sc
                top = cute.arch.fmax(top, cute.arch.fmax(y, -y))
                r[w + 2 * i] = y
        top = lanes_abs_max(top, lanes)  # the row's largest |Q'|
        e = scale_exponent(top)
        inv = power_of_two(-e)
        r.store(r.load() * power_of_two(e))
        hi.store(r.load().to(Float8E4M3FN))
        hf = hi.load().to(Float32)
        lo.store(((r.load() - hf) * 16.0).to(Float8E4M3FN))
        lf = lo.load().to(Float32)
        held = Float32(0.0)  # sum_d Q' as the two terms hold it, in units of 2^-e
        for v in cutlass.range_constexpr(TERM_CHANNELS):
            held = held + hf[v] + lf[v] * 0.0625
        if h < cfg.gqa:
            cute.autovec_copy(hi, cute.local_tile(sQk[(h, None, buf)], (TERM_CHANNELS,), (k,)))
            cute.autovec_copy(lo, cute.local_tile(sQk[(gp + h, None, buf)], (TERM_CHANNELS,), (k,)))
        part = part - unit * held * inv + (top - top)  # an infinite Q' (a tampered s'): NaN, never saturated terms
        for sh in cutlass.range_constexpr(lanes.bit_length() - 1):  # the row's sum over its lanes
            part = part + cute.arch.shuffle_sync_bfly(part, lanes >> (sh + 1))
        if k == 0 and h < cfg.gqa:
            sKf[buf, h] = part
            sKf[buf, cfg.cols + h] = inv


def fold_turns(cfg, threads: int) -> int:
    """The turns in which ``threads`` threads fold every query row's terms (:func:`fold_q_terms`)."""
    rows = threads // (cfg.head_dim // TERM_CHANNELS)
    return (cfg.gqa + rows - 1) // rows


def lanes_abs_max(x: Float32, lanes: int) -> Float32:
    """The largest of ``x >= 0`` (or NaN) over groups of ``lanes`` consecutive lanes: a whole warp's as one
    unsigned integer reduction of the bits (non-negative floats order as their bits; NaN above infinity), else a
    butterfly of maxima."""
    if lanes == 32:
        bits = (x.bitcast(Int32) & 0x7FFFFFFF).to(Uint32)
        return cute.arch.warp_redux_sync(bits, "max").to(Int32).bitcast(Float32)
    for sh in range(lanes.bit_length() - 1):
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, lanes >> (sh + 1)))
    return x


@cute.jit
def fold_terms_padding(cfg, t, threads: int, sQk: cute.Tensor, sKf: cute.Tensor, first=0, count: int = 0):
    """What :func:`fold_q_terms` leaves alone in each of its buffers (``sKf``'s rows; ``count`` of them from
    ``first`` where given): the columns of no term (padded heads, past both terms) zero words in ``sQk`` and, past
    the heads, a correction 0 and ``2^-e`` 1 in ``sKf`` (their scores finite). Written once, before the first fold,
    by the thread ``t`` of the folding threads (``threads``) that folds those words, whose fence and publication
    before each fold's reads order them."""
    D = cfg.head_dim
    lanes = D // TERM_CHANNELS
    rows = threads // lanes
    gp = term_stride(cfg)
    h0, k = term_chunk(D, t)
    zero = cute.make_rmem_tensor(cute.make_layout(TERM_CHANNELS), Float8E4M3FN)
    zero.store(cute.full_like(cute.make_rmem_tensor(cute.make_layout(TERM_CHANNELS), Float32).load(), 0.0)
               .to(Float8E4M3FN))
    for i in cutlass.range_constexpr(count or cute.size(sKf, mode=[0])):
        b = first + i
        for c in cutlass.range_constexpr(cfg.qk_cols):
            if cutlass.const_expr(not (c < cfg.gqa or gp <= c < gp + cfg.gqa)):
                if h0 == c % rows:
                    cute.autovec_copy(zero, cute.local_tile(sQk[(c, None, b)], (TERM_CHANNELS,), (k,)))
        if t < cfg.cols - cfg.gqa:
            sKf[b, cfg.gqa + t] = Float32(0.0)
            sKf[b, cfg.cols + cfg.gqa + t] = Float32(1.0)
