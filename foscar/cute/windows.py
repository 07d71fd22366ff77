"""The BF16 sink and recent ring of a cache attended inside the CuTe combine (:mod:`foscar.cute.combine`), so that
a decode of a windowed format takes no launch of its own for them (:data:`~foscar.cute.config.COMBINE_WINDOWS`).

A window holds at most ``sink + ring`` tokens (:attr:`~foscar.cute.config.CombineConfig.ring`: the ring's slots),
a few dozen to a couple of hundred: too few for tensor cores to pay, so the combine's threads take them in FP32.
Warp ``w`` of the CTA (one query head of one sequence) takes window tokens ``w, w + warps, ...``: lane ``l`` holds
channels ``l CH .. l CH + CH - 1`` (``CH = D / 32``) of the query, and of each token's K and V row (one 16-byte or
smaller vector load each, the warp's loads one coalesced row), the score a butterfly sum over the lanes. The warp
keeps an online softmax over its tokens in base 2 (running maximum, sum and the output's channels); the warps'
states meet in shared memory, where each channel's thread merges them under their common maximum. No load waits
for another warp: a token's K and V are issued together, :data:`GROUP` tokens at a time.

Token ``i`` of the window (``i < n_sink + n_recent``, from the sequence's length as
:meth:`foscar.KVFormat.split_length` splits it) is sink token ``i`` for ``i < n_sink``, else the ring's slot
``(n_quant + i - n_sink) % ring``, as the Triton window kernel (:func:`foscar.triton.bf16.bf16_decode_stage1`)
reads them. A rotated cache's windows hold rotated values: the query is rotated into the cache's space first
(:func:`foscar.cute.rotation.walsh_hadamard`). Products and sums are FP32 of the window's BF16/FP16 values.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .rotation import walsh_hadamard
from .softmax import raise_running_maximum

GROUP = 8  #: window tokens a warp loads together before it scores them


@cute.jit
def window_row(cfg, mKs: cute.Tensor, mKr: cute.Tensor, b, kvh, i, n_sink, n_quant, lane, frag: cute.Tensor):
    """Lane ``lane``'s channels of window token ``i``'s row (``mKs``: the sink, ``mKr``: the ring, K or V) into
    ``frag`` (``D / 32`` values of the window dtype)."""
    ch = cfg.head_dim // 32
    if i < n_sink:
        cute.autovec_copy(cute.local_tile(mKs[b, kvh, i, None], (ch,), (lane,)), frag)
    else:
        if cutlass.const_expr(cfg.ring > 0):
            slot = (n_quant + i - n_sink) % cfg.ring
            cute.autovec_copy(cute.local_tile(mKr[b, kvh, slot, None], (ch,), (lane,)), frag)


@cute.jit
def window_state(cfg, wtype, mQ: cute.Tensor, mKs: cute.Tensor, mVs: cute.Tensor, mKr: cute.Tensor, mVr: cute.Tensor,
                 mSEQ: cute.Tensor, mRot: cute.Tensor, qk_scale: Float32, sQw: cute.Tensor, sW: cute.Tensor, b, h,
                 tid):
    """``(m, total, acc)``: the base-2 softmax state of query row ``h`` of sequence ``b`` over its windows, for
    the thread of channel ``tid % D`` (``m`` the window's largest scaled score, ``-inf`` for an empty window;
    ``total`` the sum of ``2^(s - m)``; ``acc`` the channel's sum of ``2^(s - m) v``), by all the CTA's threads
    (``D ranks``, barriers of the whole CTA). ``sQw``: ``(1, 1, D)`` floats for the query row; ``sW``:
    ``(warps, D + 2)`` floats for the warps' states. Every thread returns the same ``m``; ranks other than 0
    return ``total = acc = 0`` (the combine adds the ranks' sums)."""
    D = cfg.head_dim
    threads = D * cfg.ranks
    warps = threads // 32
    ch = D // 32
    d = tid % D
    r = tid // D
    lane = tid % 32
    warp = tid // 32
    L = mSEQ[b]
    n_sink = cutlass.min(L, cfg.sink)
    n_quant = cutlass.max(L - n_sink - cfg.recent, 0) // cfg.flush * cfg.flush
    n_win = L - n_quant  # the sink's tokens and the ring's
    kvh = h // cfg.gqa
    # the query row, in the cache's space (a rotated cache: q R = H (q s / sqrt(D)))
    if r == 0:
        x = Float32(mQ[b, h, d])
        if cutlass.const_expr(cfg.rotate):
            x = x * mRot[d]
        sQw[0, 0, d] = x
    cute.arch.sync_threads()
    if cutlass.const_expr(cfg.rotate):
        walsh_hadamard(sQw, 1, D, tid, threads, 0)
    qv = [sQw[0, 0, lane * ch + c] for c in range(ch)]
    m = -Float32.inf
    total = Float32(0.0)
    acc = [Float32(0.0) for _ in range(ch)]
    per_warp = (cfg.sink + cfg.ring + warps - 1) // warps
    for g0 in cutlass.range_constexpr(0, per_warp, GROUP):
        n_g = min(GROUP, per_warp - g0)
        kf = [cute.make_rmem_tensor(cute.make_layout(ch), wtype) for _ in range(n_g)]
        vf = [cute.make_rmem_tensor(cute.make_layout(ch), wtype) for _ in range(n_g)]
        for j in cutlass.range_constexpr(n_g):  # the group's loads, all in flight together
            i = warp + warps * (g0 + j)
            kf[j].fill(0.0)
            vf[j].fill(0.0)
            if i < n_win:
                window_row(cfg, mKs, mKr, b, kvh, i, n_sink, n_quant, lane, kf[j])
                window_row(cfg, mVs, mVr, b, kvh, i, n_sink, n_quant, lane, vf[j])
        s = []
        for j in cutlass.range_constexpr(n_g):
            part = Float32(0.0)
            for c in cutlass.range_constexpr(ch):
                part = part + qv[c] * Float32(kf[j][c])
            for sh in cutlass.range_constexpr(5):
                part = part + cute.arch.shuffle_sync_bfly(part, 16 >> sh)
            sj = part * qk_scale
            if warp + warps * (g0 + j) >= n_win:
                sj = -Float32.inf
            s.append(sj)
        m_new, m_safe, scale = raise_running_maximum(m, s)
        total = total * scale
        for c in cutlass.range_constexpr(ch):
            acc[c] = acc[c] * scale
        for j in cutlass.range_constexpr(n_g):
            p = cute.math.exp2(s[j] - m_safe, fastmath=True)  # a token past the window weighs 0
            total = total + p
            for c in cutlass.range_constexpr(ch):
                acc[c] = acc[c] + p * Float32(vf[j][c])
        m = m_new
    # the warps' states under their common maximum, channel by channel
    for c in cutlass.range_constexpr(ch):
        sW[warp, lane * ch + c] = acc[c]
    if lane == 0:
        sW[warp, D] = m
        sW[warp, D + 1] = total
    cute.arch.sync_threads()
    m_all = -Float32.inf
    for w in cutlass.range_constexpr(warps):
        m_all = cute.arch.fmax(m_all, sW[w, D])
    m_safe = m_all
    if m_all == -Float32.inf:
        m_safe = Float32(0.0)
    total_all = Float32(0.0)
    acc_all = Float32(0.0)
    if r == 0:
        for w in cutlass.range_constexpr(warps):
            f = cute.math.exp2(sW[w, D] - m_safe, fastmath=True)
            total_all = total_all + f * sW[w, D + 1]
            acc_all = acc_all + f * sW[w, d]
    return m_all, total_all, acc_all
