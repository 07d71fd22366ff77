"""The BF16 sink and recent ring of a cache attended inside the CuTe combine (:mod:`foscar.cute.combine`), so that
a decode of a windowed format takes no launch of its own for them (:data:`~foscar.cute.config.COMBINE_WINDOWS`).

A window holds at most ``sink + ring`` tokens (:attr:`~foscar.cute.combine_config.CombineConfig.ring`: the ring's
slots), a few dozen to a couple of hundred: too few for tensor cores to pay, so the combine's threads take them in
FP32. One CTA merges ``rows`` query rows of one KV head (:attr:`~foscar.cute.combine_config.CombineConfig.rows`),
each thread its channel of every row, so the head's window is read once for all of them. The window goes through
shared memory :attr:`~foscar.cute.combine_config.CombineConfig.window_stage` tokens at a time, each stage in four
phases with a barrier between them:

1. the stage's K and V rows, 16-byte vectors spread over every thread, loaded together and stored (one round
   trip to memory);
2. the scores: :data:`~foscar.cute.combine_config.WINDOW_SCORE_LANES` threads per (row, token), each the products
   of ``D / 8`` channels, summed by shuffles, times the softmax scale in base 2;
3. a warp per row raises the row's running maximum over the stage's scores, writes each token's weight
   ``2^(s - m)`` beside the other rows' (token-major, one vector load per token below) and sums them;
4. each thread rescales its rows' sums and adds its tokens' weighted values.

Token ``i`` of the window (``i < n_sink + n_recent``, from the sequence's length as
:meth:`foscar.KVFormat.split_length` splits it) is sink token ``i`` for ``i < n_sink``, else the ring's slot
``(n_quant + i - n_sink) % ring``, as the Triton window kernel (:func:`foscar.triton.bf16.bf16_decode_stage1`)
reads them. A step's row (token ``j`` of ``q_len``, :mod:`foscar.multitoken`) reads the windows of its own length
``L - q_len + 1 + j``, which the ring still holds (``KVFormat.rollback``): a one-token decode's at that length.
A rotated cache's windows hold rotated values: the query is rotated into the cache's space first
(:func:`foscar.cute.rotation.walsh_hadamard`). Products and sums are FP32 of the window's BF16/FP16 values. A
NaN score or value makes its row's sums NaN; an infinite score makes them NaN (``2^(inf - inf)``).
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .combine_config import WINDOW_BATCH, WINDOW_SCORE_LANES
from .limits import quantized_length
from .rotation import walsh_hadamard

VEC = 8  #: window elements per vector (16 bytes of BF16/FP16)


class WindowSmem(NamedTuple):
    """The windowed combine's shared memory: the query rows ``q (1, rows, D)`` (FP32, the cache's space), a stage's
    K and V rows ``k``, ``v`` ``(stage, D)`` (window dtype), its scores ``s (rows, stage)`` and weights
    ``p (stage, rows)``, and per row the maximum before and after the stage and the stage's sum of weights,
    ``m (rows, 3)``."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    s: cute.Tensor
    p: cute.Tensor
    m: cute.Tensor


def allocate(alloc, cfg, wtype) -> WindowSmem:
    """The :class:`WindowSmem` of ``cfg`` from the CTA's allocator."""
    D, W, R = cfg.head_dim, cfg.window_stage, cfg.rows
    return WindowSmem(alloc.allocate_tensor(Float32, cute.make_layout((1, R, D), stride=(0, D, 1)), byte_alignment=16),
                      alloc.allocate_tensor(wtype, cute.make_layout((W, D), stride=(D, 1)), byte_alignment=16),
                      alloc.allocate_tensor(wtype, cute.make_layout((W, D), stride=(D, 1)), byte_alignment=16),
                      alloc.allocate_tensor(Float32, cute.make_layout((R, W), stride=(W, 1)), byte_alignment=16),
                      alloc.allocate_tensor(Float32, cute.make_layout((W, R), stride=(R, 1)), byte_alignment=16),
                      alloc.allocate_tensor(Float32, cute.make_layout((R, 3), stride=(3, 1)), byte_alignment=16))


@cute.jit
def load_vector(cfg, mS: cute.Tensor, mR: cute.Tensor, b, kvh, i, c, n_sink, n_quant, frag: cute.Tensor):
    """Vector ``c`` of window token ``i``'s row (``mS``: the sink, ``mR``: the ring, K or V) into ``frag``."""
    if i < n_sink:
        cute.autovec_copy(cute.local_tile(mS[b, kvh, i, None], (VEC,), (c,)), frag)
    else:
        if cutlass.const_expr(cfg.ring > 0):
            slot = (n_quant + i - n_sink) % cfg.ring
            cute.autovec_copy(cute.local_tile(mR[b, kvh, slot, None], (VEC,), (c,)), frag)


@cute.jit
def stage_window(cfg, wtype, mKs: cute.Tensor, mVs: cute.Tensor, mKr: cute.Tensor, mVr: cute.Tensor, sm: WindowSmem,
                 b, kvh, t0, n_win, n_sink, n_quant, tid):
    """Phase 1: window tokens ``t0 ..`` (those below ``n_win``) into ``sm.k`` and ``sm.v``."""
    per_row = cfg.head_dim // VEC
    half = cfg.window_stage * per_row  # K's vectors, then V's
    per_thread = (2 * half + cfg.threads - 1) // cfg.threads
    for j0 in cutlass.range_constexpr(0, per_thread, WINDOW_BATCH):
        n = min(WINDOW_BATCH, per_thread - j0)
        frags = [cute.make_rmem_tensor(cute.make_layout(VEC), wtype) for _ in range(n)]
        for j in cutlass.range_constexpr(n):  # the loads, all in flight together
            e = (j0 + j) * cfg.threads + tid
            i = (e % half) // per_row
            if e < 2 * half and t0 + i < n_win:
                if e < half:
                    load_vector(cfg, mKs, mKr, b, kvh, t0 + i, e % per_row, n_sink, n_quant, frags[j])
                else:
                    load_vector(cfg, mVs, mVr, b, kvh, t0 + i, e % per_row, n_sink, n_quant, frags[j])
        for j in cutlass.range_constexpr(n):
            e = (j0 + j) * cfg.threads + tid
            i = (e % half) // per_row
            if e < 2 * half and t0 + i < n_win:
                if e < half:
                    cute.autovec_copy(frags[j], cute.local_tile(sm.k[i, None], (VEC,), (e % per_row,)))
                else:
                    cute.autovec_copy(frags[j], cute.local_tile(sm.v[i, None], (VEC,), (e % per_row,)))


@cute.jit
def score_window(cfg, wtype, sm: WindowSmem, qk_scale: Float32, t0, n_win, tid):
    """Phase 2: ``sm.s[row, i] = (q_row . k_i) qk_scale`` for the stage's tokens below ``n_win``."""
    lanes = WINDOW_SCORE_LANES
    ch = cfg.head_dim // lanes
    part = tid % lanes
    g = (tid // lanes) % cfg.rows
    step = cfg.threads // (lanes * cfg.rows)  # tokens scored at once
    qv = [sm.q[0, g, part * ch + c] for c in range(ch)]
    for k in cutlass.range_constexpr((cfg.window_stage + step - 1) // step):  # every lane shuffles: static trips
        i = k * step + tid // (lanes * cfg.rows)
        kf = cute.make_rmem_tensor(cute.make_layout(ch), wtype)
        cute.autovec_copy(cute.local_tile(sm.k[cutlass.min(i, cfg.window_stage - 1), None], (ch,), (part,)), kf)
        acc = Float32(0.0)
        for c in cutlass.range_constexpr(ch):
            acc = acc + qv[c] * Float32(kf[c])
        for sh in cutlass.range_constexpr(lanes.bit_length() - 1):
            acc = acc + cute.arch.shuffle_sync_bfly(acc, lanes >> (sh + 1))
        if part == 0:
            if i < cfg.window_stage:
                if t0 + i < n_win:
                    sm.s[g, i] = acc * qk_scale


@cute.jit
def weigh_window(cfg, sm: WindowSmem, t0, n_win, tid):
    """Phase 3: warp ``w`` takes rows ``w, w + warps, ..``: the row's maximum raised over the stage's scores,
    each score's weight under it (0 while it is ``-inf``) into ``sm.p``, their sum into ``sm.m``."""
    lane = tid % 32
    warps = cfg.threads // 32
    trips = (cfg.window_stage + 31) // 32
    for g0 in cutlass.range_constexpr(0, cfg.rows, warps):
        g = g0 + tid // 32
        if g < cfg.rows:
            top = -Float32.inf
            for k in cutlass.range_constexpr(trips):
                i = k * 32 + lane
                if i < cfg.window_stage:
                    if t0 + i < n_win:
                        top = cute.arch.fmax(top, sm.s[g, i])  # fmax skips a NaN: its weight is NaN below
            for sh in cutlass.range_constexpr(5):
                top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, 16 >> sh))
            m_new = cute.arch.fmax(sm.m[g, 1], top)
            m_safe = m_new
            if m_new == -Float32.inf:
                m_safe = Float32(0.0)
            total = Float32(0.0)
            for k in cutlass.range_constexpr(trips):
                i = k * 32 + lane
                if i < cfg.window_stage:
                    p = Float32(0.0)
                    if t0 + i < n_win:
                        p = cute.math.exp2(sm.s[g, i] - m_safe, fastmath=True)
                    sm.p[i, g] = p
                    total = total + p
            for sh in cutlass.range_constexpr(5):
                total = total + cute.arch.shuffle_sync_bfly(total, 16 >> sh)
            if lane == 0:
                sm.m[g, 0] = sm.m[g, 1]
                sm.m[g, 1] = m_new
                sm.m[g, 2] = total


@cute.jit
def window_state(cfg, wtype, mQ: cute.Tensor, mKs: cute.Tensor, mVs: cute.Tensor, mKr: cute.Tensor, mVr: cute.Tensor,
                 mSEQ: cute.Tensor, mRot: cute.Tensor, qk_scale: Float32, sm: WindowSmem, b, h0, tid):
    """``(m, total, acc)``, a list each: the base-2 softmax state over its windows of query rows ``h0 ..
    h0 + rows - 1`` of row ``b`` (sequence ``b``; a step's: token ``b % step`` of sequence ``b // step``, over the
    windows of that token's length), for the thread of channel
    ``tid % D`` and rank ``tid // D`` (``m`` the window's largest scaled score, ``-inf`` for an empty window;
    ``total`` the sum of ``2^(s - m)`` on rank 0, 0 on the others; ``acc`` the rank's sum of ``2^(s - m) v`` over
    its tokens: the combine adds the ranks' sums).
    By all the CTA's threads, barriers of the whole CTA."""
    D = cfg.head_dim
    d = tid % D
    r = tid // D
    seq = b  # the sequence of row b (a step's rows: b // step)
    if cutlass.const_expr(cfg.step > 1):
        seq = b // cfg.step
    L = mSEQ[seq]
    if cutlass.const_expr(cfg.step > 1 or cfg.tail > 0):  # row b's step token reads the windows of its length
        L = L - cfg.tail
        if cutlass.const_expr(cfg.step > 1):
            L = L - (cfg.step - 1 - b % cfg.step)
    n_sink = cutlass.min(L, cfg.sink)
    n_quant = quantized_length(cfg, L)
    n_win = L - n_quant  # the sink's tokens and the ring's
    kvh = h0 // cfg.gqa
    # the query rows, in the cache's space (a rotated cache: q R = H (q s / sqrt(D))), and the running maxima
    for k in cutlass.range_constexpr((cfg.rows * D + cfg.threads - 1) // cfg.threads):
        e = k * cfg.threads + tid
        if e < cfg.rows * D:
            x = Float32(mQ[b, h0 + e // D, e % D])
            if cutlass.const_expr(cfg.rotate):
                x = x * mRot[e % D]
            sm.q[0, e // D, e % D] = x
    if tid < cfg.rows:
        sm.m[tid, 1] = -Float32.inf
    cute.arch.sync_threads()
    if cutlass.const_expr(cfg.rotate):
        walsh_hadamard(sm.q, cfg.rows, D, tid, cfg.threads, 0)
    total = [Float32(0.0) for _ in range(cfg.rows)]
    acc = [Float32(0.0) for _ in range(cfg.rows)]
    for t0 in cutlass.range(0, n_win, cfg.window_stage, unroll=1):
        stage_window(cfg, wtype, mKs, mVs, mKr, mVr, sm, seq, kvh, t0, n_win, n_sink, n_quant, tid)
        cute.arch.sync_threads()
        score_window(cfg, wtype, sm, qk_scale, t0, n_win, tid)
        cute.arch.sync_threads()
        weigh_window(cfg, sm, t0, n_win, tid)
        cute.arch.sync_threads()
        for g in cutlass.range_constexpr(cfg.rows):
            m_safe = sm.m[g, 1]
            if m_safe == -Float32.inf:
                m_safe = Float32(0.0)
            scale = cute.math.exp2(sm.m[g, 0] - m_safe, fastmath=True)  # 0 while nothing was seen
            acc[g] = acc[g] * scale
            total[g] = total[g] * scale
            if r == 0:
                total[g] = total[g] + sm.m[g, 2]
        n = cutlass.min(n_win - t0, cfg.window_stage)
        for i in cutlass.range(r, n, cfg.ranks, unroll=4):
            pf = cute.make_rmem_tensor(cute.make_layout(cfg.rows), Float32)
            cute.autovec_copy(sm.p[i, None], pf)
            v = Float32(sm.v[i, d])
            for g in cutlass.range_constexpr(cfg.rows):
                acc[g] = acc[g] + pf[g] * v
        cute.arch.sync_threads()  # the stage read before the next one lands
    return [sm.m[g, 1] for g in range(cfg.rows)], total, acc
