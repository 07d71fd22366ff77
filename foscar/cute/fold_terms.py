"""Channel-wise K's operand-fold with E4M3 K operands (paper Sec. 4.1): a token group's ``Q' = Q s'`` as two E4M3
terms with a power-of-two scale per query row, and its offset correction per row (:func:`fold_q_terms`); which
thread builds which contraction indices is :mod:`foscar.cute.fold_map`'s.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint32

from .fold_map import TERM_CHANNELS, term_channels, term_chunk
from .operands_e4m3 import power_of_two, term_stride
from .ptx import e4m3_half, e4m3_word, f16_half, f16_pair, fma_f16_pairs, residual16


@cute.jit
def fold_q_terms(cfg, t, threads: int, sQ: cute.Tensor, sQk: cute.Tensor, sKf: cute.Tensor, buf, params: cute.Tensor,
                 turn=None):
    """:func:`~foscar.cute.folds.fold_q` with E4M3 K operands: ``Q' = Q s'`` of each query row as two E4M3 terms
    with a power-of-two scale ``2^e`` per row (from the row's largest ``|Q'|``, its builders' maximum,
    :func:`fold_exponent`), ``hi = e4m3(Q' 2^e)`` in column ``h`` and ``lo =
    e4m3((Q' 2^e - hi) 16)`` in column ``gp + h`` (:func:`~foscar.cute.operands_e4m3.term_stride`) at the
    channel's contraction index; ``sKf[buf, h]`` the row's correction ``sum_d Q mid - u sum_d Q'`` (``u``: the
    middle code, ``k_factor * pivot`` of either token half; ``Q'`` as the terms carry it) and ``sKf[buf, cols + h]
    = 2^-e``; the columns of no term are :func:`fold_terms_padding`'s, written once. Thread ``t`` builds
    contraction indices ``4 k .. 4 k + 3`` of row ``h`` (:func:`~foscar.cute.fold_map.term_chunk`; with fewer
    threads than rows, the rows in turns), one 32-bit word of each term, from two BF16 words of Q and two 16-byte
    ``(s', z')`` pairs of ``params`` (the group's ``(s', z')`` row, channel ``d``'s at ``2 d``, ``2 d + 1``;
    :func:`~foscar.cute.fold_map.term_channels`); ``turn``: that turn's rows only (of :func:`fold_turns`; a caller's
    loop at run time keeps one turn's registers live). The split in FP16 pairs with ``cfg.fold_f16_split``
    (:func:`split_f16_pairs`); the stores at offsets hoisted out of the pass loop (:func:`store_hoisted`). No
    synchronisation: the caller fences the writes for the wgmma's proxy and publishes them."""
    D = cfg.head_dim
    lanes = D // TERM_CHANNELS  # builders of a row: consecutive lanes of one warp
    rows = threads // lanes  # rows built at once
    gp = term_stride(cfg)
    unit = cfg.k_factors[0] * cfg.k_pivots[0]
    h0, k = term_chunk(D, t)
    d0, step = term_channels(cfg.bits, k)
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
        for w in cutlass.range_constexpr(2):  # channels d0 + w step and the next: indices 4 k + w and 4 k + w + 2
            d = d0 + w * step
            cute.autovec_copy(cute.local_tile(sQ[(row, None)], (2,), (d // 2,)), qv)
            cute.autovec_copy(cute.local_tile(params, (4,), (d // 2,)), pv)
            qw = cute.recast_tensor(qv, Uint32)[0]  # the channels' BF16 pair: each the top half of an FP32
            for i in cutlass.range_constexpr(2):
                x = ((qw << 16) if i == 0 else (qw & Uint32(0xFFFF0000))).bitcast(Float32)
                sc = pv[2 * i]
                part = part + x * (pv[2 * i + 1] + cfg.k_mid * sc)
                y = x * sc
                top = cute.arch.fmax(top, cute.arch.fmax(y, -y))
                r[w + 2 * i] = y
        top = lanes_abs_max(top, lanes)  # the row's largest |Q'|
        e = fold_exponent(top)
        inv = power_of_two(-e)
        r.store(r.load() * power_of_two(e))
        if cutlass.const_expr(cfg.fold_f16_split):
            hw, lw, held = split_f16_pairs(r)
        else:
            hi.store(r.load().to(Float8E4M3FN))
            hf = hi.load().to(Float32)
            lo.store(((r.load() - hf) * 16.0).to(Float8E4M3FN))
            lf = lo.load().to(Float32)
            held = Float32(0.0)  # sum_d Q' as the two terms hold it, in units of 2^-e
            for v in cutlass.range_constexpr(TERM_CHANNELS):
                held = held + hf[v] + lf[v] * 0.0625
            hw, lw = cute.recast_tensor(hi, Uint32)[0], cute.recast_tensor(lo, Uint32)[0]
        if h < cfg.gqa:
            at = term_word_offset(cfg.head_dim, sQk, h, k)  # lo's: a bit flip of hi's (h < gp, a power of two)
            stride = cute.crd2idx((0, 0, 1), sQk.layout)
            store_hoisted(sQk, at, buf, stride, hw)
            store_hoisted(sQk, at ^ term_word_offset(cfg.head_dim, sQk, gp, 0), buf, stride, lw)
        part = part - unit * held * inv + (top - top)  # an infinite Q' (a tampered s'): NaN, never saturated terms
        for sh in cutlass.range_constexpr(lanes.bit_length() - 1):  # the row's sum over its lanes
            part = part + cute.arch.shuffle_sync_bfly(part, lanes >> (sh + 1))
        if k == 0 and h < cfg.gqa:  # the thread's entries hoisted, the buffer's offset added after them
            stride = cute.crd2idx((1, 0), sKf.layout)
            store_hoisted(sKf, cute.crd2idx((0, h), sKf.layout), buf, stride, part)
            store_hoisted(sKf, cute.crd2idx((0, cfg.cols + h), sKf.layout), buf, stride, inv)


def split_f16_pairs(r: cute.Tensor):
    """``(hi, lo, held)`` of :func:`fold_q_terms`' four values ``r`` (``Q' 2^e``) with the split in FP16 pairs
    (:attr:`~foscar.cute.config.Sm90Config.fold_f16_split`): ``r`` rounded to FP16 once (``2^-11`` of each value,
    below the pair's ``2^-8``), then ``hi = e4m3(r)``, ``lo = e4m3((r - hi) 16)`` with the remainder and its
    scaling exact in FP16 (``r - hi`` is ``r``'s low bits), each term's word of four bytes; ``held``, the sum of
    ``hi + lo / 16`` (each exact in FP16 unless the two terms span more than 11 bits) in FP32."""
    pairs = [f16_pair(r[0], r[1]), f16_pair(r[2], r[3])]
    hw = e4m3_word(pairs[0], pairs[1])
    hf = [e4m3_half(hw, 0), e4m3_half(hw, 1)]
    lw = e4m3_word(*[residual16(pairs[i], hf[i]) for i in range(2)])
    w = [fma_f16_pairs(e4m3_half(lw, i), Uint32(0x2C002C00), hf[i]) for i in range(2)]  # hi + lo / 16
    return hw, lw, f16_half(w[0], 0) + f16_half(w[0], 1) + f16_half(w[1], 0) + f16_half(w[1], 1)


def fold_exponent(top: Float32) -> Int32:
    """:func:`~foscar.cute.operands_e4m3.scale_exponent` of a row's largest ``|Q'|`` in four integer instructions:
    ``135 - biased`` less one where the significand exceeds 1.75 (``448 = 1.75 x 2^8``), as ``135 - ((bits +
    0x1FFFFF) >> 23)``, at most 126 (a zero or subnormal ``top``: its row's terms are zeros either way, ``2^-126`` their
    factor); an infinite or NaN ``top`` gives -120 (the row's correction is NaN: :func:`fold_q_terms`)."""
    return cutlass.min(Int32(135) - ((top.bitcast(Int32) + 0x1FFFFF) >> 23), Int32(126))


def term_word_offset(head_dim: int, sQk: cute.Tensor, col, k):
    """The swizzled byte offset, within a buffer of ``sQk``, of contraction indices ``4 k .. 4 k + 3`` of column
    ``col`` (one 32-bit word of a term, :func:`store_hoisted`): from the thread's indices alone. The swizzle is
    linear over XOR, so where two offsets' bits are disjoint (a row ``h < gp`` and the row ``gp``, a power of two)
    the swizzled offset of their sum is the XOR of theirs."""
    return swizzled_term_offset(head_dim, cute.crd2idx((col, TERM_CHANNELS * k, 0), sQk.layout))


@cute.jit
def store_hoisted(t: cute.Tensor, off, buf, stride, x):
    """``x`` (32 bits: a term's word, a row's correction or ``2^-e``) at element ``off`` of ``t``'s buffer ``buf``
    (``stride`` elements a buffer): ``off`` the element's offset in buffer 0, from the thread's indices alone (the
    same every fold: hoisted out of the pass loop), the buffer's offset added after it. For ``Q'`` (``off`` from
    :func:`term_word_offset`, swizzled) a buffer is whole swizzle periods from a base aligned to one
    (:func:`~foscar.cute.operands_e4m3.sq_layout_e4m3`, allocated at 1024 bytes), so the swizzle leaves it alone."""
    addr = t.iterator.toint() + t.element_type.width // 8 * (off + buf * stride)
    cute.make_tensor(cute.make_ptr(type(x), addr, cute.AddressSpace.smem, assumed_align=4), cute.make_layout(1))[0] = x


def swizzled_term_offset(head_dim: int, off):
    """The byte offset ``off`` of a ``Q'`` buffer (:func:`~foscar.cute.operands_e4m3.sq_layout_e4m3`'s outer layout)
    swizzled as its layout swizzles it: ``Swizzle<3,4,3>`` (``<2,4,3>`` at head dim 64), bits 7-9 (7-8) XORed into
    bits 4-6 (4-5)."""
    return off ^ ((off >> 3) & (0x70 if head_dim % 128 == 0 else 0x30))


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
