"""Triton split-KV decode over a foscar cache: stage 1 (one program per batch entry, KV head, split).

Both products are transposed, as in the paper's Hopper kernel: ``S^T = K Q^T`` and ``O^T = V^T P^T``.
The KV tile's ``BLOCK_N`` tokens run along M (every row real) and the ``G`` query heads of one KV
head along N (padded to ``BLOCK_H >= 8``), so the operand built from packed words is the register A
operand of both MMAs. A program walks its split's KV tiles through the page table with a software
pipeline of its own (the next tile's words and parameters in flight while a tile is computed, the
page two tiles ahead), builds the operands from the packed words (:mod:`foscar.triton.tiles`), and
applies the folded constants exactly as :func:`foscar.decode_folded` does (paper Sec. 4.1-4.2; same
names):

- token-wise K, acc-fold: group-local partials ``Q[:, G] . y[t, G]`` (a batched dot over the
  ``C = D/g`` channel groups), each scaled by ``s'[t, G]``, plus ``z'[t, G] * sum(Q[:, G])`` (both
  taken around the pivot ``c``, as :func:`foscar.decode_folded` does);
- channel-wise K, operand-fold: ``Q' = bf16(Q * s')`` of the tile's token group, plus the correction
  ``sum(Q * (z' + c s')) - c * sum(Q')`` around the pivot ``c``;
- token-wise V, operand-fold: ``P' = bf16(P * s'[t, G])`` per channel group, plus
  ``sum_t P (z' + c s') - c * sum(P')``;
- channel-wise V, acc-fold: ``s' * (P~ . y) + z' * sum(P~)`` per tile (one token group).

Codes are injected into the top mantissa bits (:func:`foscar.format.operand_for`: ``y = q + 2^bits``,
offset 16 for INT4, 4 for INT2, instead of the paper's 128: the same two instructions per register,
but the accumulators carry a smaller ``beta * s' * sum``). Every offset term is taken around the
pivot ``c`` (the operand of the middle code): ``x = s' (y - c) + mid``, with ``mid = z' + *_MID * s'``
the group's middle value, formed from the stored ``z'`` (made for ``q + 128``) in one FMA. The QK
operands are BF16 (Q as given). The PV operands are FP16 on the GPU (``PV_F16``; ``P~ = fp16(P)``,
and ``P s'`` divided by a power of two, the largest ``|s'|`` seen so far, before rounding): 8x finer
than BF16, which keeps the operand-fold error below BF16 attention's even for one-token sequences.

K corrections land before the softmax, V corrections in the accumulator before the final division
(token-wise V: every ``CORR_EVERY`` tiles, never only at the end, see ``docs/triton-perf.md``). Corrections
use the operands the MMA consumed. ``FOLD=False`` gives the per-value
reconstruction kernel of the paper's ablation: the same tiling, but every value is dequantized
(``s*q + z`` per value) before plain BF16 dots.

Each program writes its partial output ``acc / l`` and ``lse`` (base 2, scaled scores); an empty
split writes ``lse = -inf``. :mod:`foscar.triton.combine` merges the partials: a kernel of its own, or
(``FUSED_COMBINE``) the last split of each KV head, found with a self-resetting counter per head.
``PREFETCH``: KV tiles in flight while one is computed (1 or 2).

``LAZY`` (token-wise V of one channel group): the lazy rescale. Each row's maximum and the units ``sigma`` are
kept while no score of a tile passes its row's maximum by ``HEADROOM`` (base 2) and no ``|s'_V|`` passes
``sigma`` (one count a tile, :func:`~foscar.triton.common.past_headroom`); only then does the tile reduce the rows'
maxima and rescale. From 16 rows the masks are taken only by the tiles that reach a row's limit; at 8 and 32
rows the pivot's share of the V corrections, ``sum_t P'``, comes from the tensor core (``PIVOT_DOT``).
"""
import triton
import triton.language as tl

from .combine import merge_parts
from .common import (causal_softmax_step, dot, dot_acc, lazy_references, masked_scores, partial_result, past_headroom,
                     round_operand, split_of, split_range, step_seen, walsh_hadamard)
from .tiles import k_codes, k_operand, k_words, v_codes, v_operand_t, v_words

LOG2E = 1.4426950408889634


@triton.jit
def _pv_operand(x, PV_F16: tl.constexpr, INTERPRET: tl.constexpr):
    """A PV operand: FP16 (or BF16) on the GPU, float32 under the interpreter. (One return per
    helper: Triton 3.6 rejects constexpr branches that return different types.)"""
    y = x
    if not INTERPRET:
        if PV_F16:
            y = x.to(tl.float16)
        else:
            y = x.to(tl.bfloat16)
    return y


@triton.jit
def _raised_units(sigma, top):
    """The P' units after a tile whose ``|s'_V|`` (and offset bound) reach ``top``: ``sigma``, or the power of two at
    or above ``top`` where that is larger (``top`` 0, a tile of constant groups: ``sigma``)."""
    up = tl.exp2(tl.ceil(tl.log2(tl.where(top > 0, top, 1.0))))
    return tl.maximum(sigma, tl.where(top > 0, up, 0.0))


@triton.jit
def _middle(s, z, MID: tl.constexpr, INTERPRET: tl.constexpr):
    """``z' + MID * s'`` with one rounding: an FMA on the GPU, float64 under the interpreter (which has
    no fused multiply-add). Two roundings would cost ``2^-24 * |MID * s'|``, ~100x ``ulp(mid)``."""
    if INTERPRET:
        r = (z.to(tl.float64) + MID * s.to(tl.float64)).to(tl.float32)
    else:
        r = tl.fma(s, MID, z)
    return r


@triton.jit
def _token_sz(ptr, off, tt, valid, C: tl.constexpr):
    """Token-wise ``(s', z')`` of a tile's tokens, ``[C, BLOCK_N]`` each (zero where not ``valid``)."""
    cc = tl.arange(0, C)
    o = ((off + tt)[None, :] * C + cc[:, None]) * 2
    return tl.load(ptr + o, mask=valid[None, :], other=0.0), tl.load(ptr + o + 1, mask=valid[None, :], other=0.0)


@triton.jit
def _channel_sz(ptr, off, fresh, old_s, old_z, D: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr):
    """Channel-wise ``(s', z')`` of a tile's token group, ``[D]`` each: read only when ``fresh`` (the tile
    starts a group, or a split), else ``(old_s, old_z)`` (a page shorter than a group keeps its group's
    row as row 0)."""
    row = off // GROUP if PAGE >= GROUP else 0
    dd = tl.arange(0, D)
    s = tl.load(ptr + (row * D + dd) * 2, mask=fresh, other=0.0)
    z = tl.load(ptr + (row * D + dd) * 2 + 1, mask=fresh, other=0.0)
    return tl.where(fresh, s, old_s), tl.where(fresh, z, old_z)


@triton.jit
def _load_tile(KC, VC, KP, VP, page, kvh, tile, t_lo, t_hi, n_quant, tt, k_s, k_z, v_s, v_z,
               stride_cp, stride_ch, stride_kpp, stride_kph, stride_vpp, stride_vph,
               BITS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
               K_TOKEN: tl.constexpr, V_TOKEN: tl.constexpr, KC_: tl.constexpr, VC_: tl.constexpr):
    """Issue the loads of KV tile ``tile`` (on ``page``): K and V words and the folded ``(s', z')``.
    Nothing is read past the split (``tile >= t_hi``); channel-wise parameters are read only when the
    tile starts a token group (``k_s, k_z, v_s, v_z`` are the current ones, kept otherwise)."""
    ok = tile < t_hi
    t0 = tile * BLOCK_N
    off = t0 % PAGE  # first token of the tile inside its page
    WPT: tl.constexpr = D * BITS // 32  # words per token
    kw = k_words(KC + page * stride_cp + kvh * stride_ch + off * WPT, ok, BLOCK_N, D, BITS, KC_)
    vw = v_words(VC + page * stride_cp + kvh * stride_ch + off * WPT, ok, BLOCK_N, D, BITS, VC_)
    kp = KP + page * stride_kpp + kvh * stride_kph
    vp = VP + page * stride_vpp + kvh * stride_vph
    valid = (t0 + tt < n_quant) & ok
    fresh = ok & ((t0 % GROUP == 0) | (tile == t_lo))
    if K_TOKEN:
        k_s, k_z = _token_sz(kp, off, tt, valid, KC_)
    else:
        k_s, k_z = _channel_sz(kp, off, fresh, k_s, k_z, D, GROUP, PAGE)
    if V_TOKEN:
        v_s, v_z = _token_sz(vp, off, tt, valid, VC_)
    else:
        v_s, v_z = _channel_sz(vp, off, fresh, v_s, v_z, D, GROUP, PAGE)
    return kw, vw, k_s, k_z, v_s, v_z


@triton.jit
def fold_decode_stage1(
    Q, KC, VC, KP, VP, BT, SEQ, OP, LP, O, LSE, SEM, ROT,
    qk_scale,  # sm_scale * log2(e)
    stride_qb, stride_qh,
    stride_cp, stride_ch,  # codes pool [pages, Hkv, W]
    stride_kpp, stride_kph,  # K params pool [pages, Hkv, rows, cols, 2]
    stride_vpp, stride_vph,
    stride_btb,
    stride_opb, stride_oph, stride_ops,  # partial outputs [B, Hq, S, D]
    stride_lpb, stride_lph,  # partial LSE [B, Hq, S]
    stride_ob, stride_oh, stride_lb, stride_lh,  # output [B, Hq, D] and LSE [B, Hq] (FUSED_COMBINE)
    BITS: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, GROUP: tl.constexpr, K_TOKEN: tl.constexpr, V_TOKEN: tl.constexpr,
    SINK: tl.constexpr, RECENT: tl.constexpr, FLUSH: tl.constexpr,
    K_PATTERN: tl.constexpr, K_SHL: tl.constexpr, K_MID: tl.constexpr, K_PIVOT: tl.constexpr,
    V_PATTERN: tl.constexpr, V_SHL: tl.constexpr, V_MID: tl.constexpr, V_PIVOT: tl.constexpr,
    PV_F16: tl.constexpr, FOLD: tl.constexpr, INTERPRET: tl.constexpr, PREFETCH: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, WINDOWS: tl.constexpr, MERGE_H: tl.constexpr, CHUNK: tl.constexpr,
    WRITE_LSE: tl.constexpr, P_START: tl.constexpr, P_OFFSET_RATIO: tl.constexpr, ROTATE: tl.constexpr,
    STEP: tl.constexpr, LAZY: tl.constexpr, HEADROOM: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    KC_: tl.constexpr = D // GROUP if K_TOKEN else 1  # channel groups of a token-wise K
    VC_: tl.constexpr = D // GROUP if V_TOKEN else 1
    KGC: tl.constexpr = D // KC_
    VGC: tl.constexpr = D // VC_
    HALF: tl.constexpr = ((1 << BITS) - 1) / 2  # the middle code: x = s' (q - HALF) + mid

    L = tl.load(SEQ + b)
    _, n_quant, _ = split_of(L, SINK, RECENT, FLUSH)
    t_lo, t_hi = split_range(n_quant, BLOCK_N)

    hh = tl.arange(0, BLOCK_H)
    dd = tl.arange(0, D)
    tt = tl.arange(0, BLOCK_N)
    hmask = hh < G * STEP
    row_seen = step_seen(L, n_quant, hh, G, STEP, SINK, RECENT, FLUSH, WINDOWS)  # a step's causal limits
    first_seen = n_quant  # no score of a tile before it is masked (the least of the rows' limits, each <= n_quant)
    if STEP > 1:
        first_seen = tl.min(tl.where(hmask, row_seen, n_quant), axis=0)
    # row hh: query head kvh G + hh % G of token hh // G of the step, a row b STEP + hh // G of Q (and of the
    # partials and the output); one token (STEP 1): head kvh G + hh of row b
    if STEP == 1:
        row_off = b * stride_qb + (kvh * G + hh) * stride_qh
        op_off = b * stride_opb + (kvh * G + hh) * stride_oph
        lp_off = b * stride_lpb + (kvh * G + hh) * stride_lph
    else:
        row_off = (b * STEP + hh // G) * stride_qb + (kvh * G + hh % G) * stride_qh
        op_off = (b * STEP + hh // G) * stride_opb + (kvh * G + hh % G) * stride_oph
        lp_off = (b * STEP + hh // G) * stride_lpb + (kvh * G + hh % G) * stride_lph
    q_ptr = Q + row_off[:, None] + dd[None, :]
    if ROTATE:  # a rotated cache: q R = (q f) H in FP32 (ROT: the factors f), then the BF16 operand
        qr = walsh_hadamard(tl.load(q_ptr, mask=hmask[:, None], other=0.0).to(tl.float32) * tl.load(ROT + dd)[None, :],
                            D)
        # back through this split's partial-output rows (written again below): loaded as the query is, the
        # rotated query has the layout the tile loop was built for (else its layout costs spills there)
        s_ptr = OP + op_off[:, None] + split * stride_ops + dd[None, :]
        tl.store(s_ptr, qr, mask=hmask[:, None])
        tl.debug_barrier()
        q = round_operand(tl.load(s_ptr, mask=hmask[:, None], other=0.0, cache_modifier=".cg"), INTERPRET)
    else:
        q = tl.load(q_ptr, mask=hmask[:, None], other=0.0).to(tl.bfloat16)
    qf = q.to(tl.float32)
    if K_TOKEN:  # Q split by channel group: [KC_, BLOCK_H, KGC], and its sums (from the consumed BF16 Q)
        q3 = tl.permute(tl.reshape(q, (BLOCK_H, KC_, KGC)), (1, 0, 2))
        q_sum3 = tl.sum(q3.to(tl.float32), axis=2)  # [KC_, BLOCK_H]
        if INTERPRET:
            q3 = q3.to(tl.float32)

    # channel-wise K: the operand Q' = bf16(Q s') and its correction, rebuilt at each token group's first tile
    qs = round_operand(qf, INTERPRET)
    kcorr = tl.zeros((BLOCK_H,), tl.float32)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    # the lazy rescale at 8 or 32 rows: the pivot's share of the V corrections, sum_t P', by the tensor core (row 0 of
    # e0 P', the other rows 0; in units of sigma as acc is), where each element widened its P' and took an FMA (at
    # 16 rows Triton makes that product an mma.sync from P' reloaded: 15 instructions a tile more than it saves)
    PIVOT_DOT: tl.constexpr = LAZY and BLOCK_H != 16
    if LAZY:  # the references the lazy rescale takes from m_i, kept beside it (lazy_references)
        m_use, m_ref = lazy_references(m_i)
    if PIVOT_DOT:
        e0 = _pv_operand(((tl.arange(0, 16)[:, None] == 0) & (tt[None, :] >= 0)).to(tl.float32), PV_F16, INTERPRET)
        psum = tl.zeros((16, BLOCK_H), tl.float32)
    # The softmax denominator is kept per score element and reduced once, after the loop.
    l_el = tl.zeros((BLOCK_N, BLOCK_H), tl.float32)
    c_el = tl.zeros((BLOCK_N, BLOCK_H), tl.float32)  # token-wise V: offset corrections not yet in acc
    CORR_EVERY: tl.constexpr = 8  # tiles between folds of the V corrections into acc
    acc = tl.zeros((VC_, VGC, BLOCK_H), tl.float32)  # O^T per channel group: PV runs as V^T P^T
    # token-wise V, one channel group: acc is in units of sigma (foscar.format.P_UNITS_START and
    # P_UNITS_OFFSET_RATIO: from P_START up, >= every |s'| and P_OFFSET_RATIO |z'| seen); 1 elsewhere
    sigma = 1.0
    if V_TOKEN and FOLD and VC_ == 1:
        sigma = P_START

    # Software pipeline, by hand: while tile i is computed, the words and parameters of tile i+1 are in
    # flight and the page of tile i+2 is being looked up. (Triton's pipeliner waits for a tile's copies
    # right before using them: no overlap at all, docs/triton-perf.md.)
    bt_row = BT + b * stride_btb
    page = tl.load(bt_row + (t_lo * BLOCK_N) // PAGE, mask=t_lo < t_hi, other=0).to(tl.int64)
    kw, vw, k_s, k_z, v_s, v_z = _load_tile(
        KC, VC, KP, VP, page, kvh, t_lo, t_lo, t_hi, n_quant, tt,
        tl.zeros((D,), tl.float32), tl.zeros((D,), tl.float32), tl.zeros((D,), tl.float32), tl.zeros((D,), tl.float32),
        stride_cp, stride_ch, stride_kpp, stride_kph, stride_vpp, stride_vph,
        BITS, D, BLOCK_N, PAGE, GROUP, K_TOKEN, V_TOKEN, KC_, VC_)
    page = tl.load(bt_row + ((t_lo + 1) * BLOCK_N) // PAGE, mask=t_lo + 1 < t_hi, other=0).to(tl.int64)
    if PREFETCH == 2:  # two tiles in flight: tile t_lo + 1 too
        kw_n, vw_n, k_s_n, k_z_n, v_s_n, v_z_n = _load_tile(
            KC, VC, KP, VP, page, kvh, t_lo + 1, t_lo, t_hi, n_quant, tt, k_s, k_z, v_s, v_z,
            stride_cp, stride_ch, stride_kpp, stride_kph, stride_vpp, stride_vph,
            BITS, D, BLOCK_N, PAGE, GROUP, K_TOKEN, V_TOKEN, KC_, VC_)
        page = tl.load(bt_row + ((t_lo + 2) * BLOCK_N) // PAGE, mask=t_lo + 2 < t_hi, other=0).to(tl.int64)

    for tile in range(t_lo, t_hi):
        t0 = tile * BLOCK_N
        valid = t0 + tt < n_quant
        # ---- tile+PREFETCH in flight ---------------------------------------------------------------
        if PREFETCH == 2:
            kw_2, vw_2, k_s_2, k_z_2, v_s_2, v_z_2 = _load_tile(
                KC, VC, KP, VP, page, kvh, tile + 2, t_lo, t_hi, n_quant, tt, k_s_n, k_z_n, v_s_n, v_z_n,
                stride_cp, stride_ch, stride_kpp, stride_kph, stride_vpp, stride_vph,
                BITS, D, BLOCK_N, PAGE, GROUP, K_TOKEN, V_TOKEN, KC_, VC_)
        else:
            kw_n, vw_n, k_s_n, k_z_n, v_s_n, v_z_n = _load_tile(
                KC, VC, KP, VP, page, kvh, tile + 1, t_lo, t_hi, n_quant, tt, k_s, k_z, v_s, v_z,
                stride_cp, stride_ch, stride_kpp, stride_kph, stride_vpp, stride_vph,
                BITS, D, BLOCK_N, PAGE, GROUP, K_TOKEN, V_TOKEN, KC_, VC_)
        page = tl.load(bt_row + ((tile + 1 + PREFETCH) * BLOCK_N) // PAGE, mask=tile + 1 + PREFETCH < t_hi,
                       other=0).to(tl.int64)
        # ---- S^T = K Q^T with the K offset corrections (before the softmax) -------------------------
        # Transposed: tokens along M (all rows real), the G query heads along N (padded to 8, not 16),
        # and K, built in registers, is the A operand.
        kmid = _middle(k_s, k_z, K_MID, INTERPRET)
        if K_TOKEN:
            if FOLD:  # acc-fold: scale each group-local partial, add z' * sum(Q)
                yk = k_operand(kw, BLOCK_N, D, BITS, KC_, K_SHL, K_PATTERN, INTERPRET)
                part = _dot_batched(yk, tl.permute(q3, (0, 2, 1)), INTERPRET)  # [KC_, BLOCK_N, BLOCK_H]
                # centred on the pivot: s' (part - c sum Q) + (z' + c s') sum Q
                # (sm_scale log2 e folded into the per-token s' and mid: no multiply per score)
                st = tl.sum((part - K_PIVOT * q_sum3[:, None, :]) * (k_s * qk_scale)[:, :, None]
                            + q_sum3[:, None, :] * (kmid * qk_scale)[:, :, None], axis=0)
            else:  # per-value reconstruction: x = s' (q - HALF) + mid = s*q + z, then a plain dot
                kc = k_codes(kw, BLOCK_N, D, BITS, KC_)
                x = round_operand(k_s[:, :, None] * (kc.to(tl.float32) - HALF) + kmid[:, :, None], INTERPRET)
                st = tl.sum(_dot_batched(x, tl.permute(q3, (0, 2, 1)), INTERPRET), axis=0)
        else:
            if FOLD:  # operand-fold: Q' = bf16(Q s'); correction around the pivot
                if (t0 % GROUP == 0) | (tile == t_lo):  # a new token group
                    qs = round_operand(qf * k_s[None, :], INTERPRET)
                    kcorr = tl.sum(qf * kmid[None, :], axis=1) - K_PIVOT * tl.sum(qs.to(tl.float32), axis=1)
                yk = tl.reshape(k_operand(kw, BLOCK_N, D, BITS, 1, K_SHL, K_PATTERN, INTERPRET), (BLOCK_N, D))
                st = dot(yk, tl.trans(qs), INTERPRET) + kcorr[None, :]
            else:
                ck = tl.reshape(k_codes(kw, BLOCK_N, D, BITS, 1), (BLOCK_N, D))
                x = round_operand(k_s[None, :] * (ck.to(tl.float32) - HALF) + kmid[None, :], INTERPRET)
                st = dot(x, tl.trans(q), INTERPRET)
        if not (K_TOKEN and FOLD):
            st = st * qk_scale
        # ---- online softmax (base 2) over the token axis, masked (causal among a step's tokens) -------
        vs = v_s
        vmid = _middle(v_s, v_z, V_MID, INTERPRET)
        if LAZY:  # the maxima and units kept while no score passes them by HEADROOM and no |s'| passes sigma
            if BLOCK_H >= 16:  # 16 rows or more: only the tiles that reach a row's limit take the masks
                if t0 + BLOCK_N > first_seen:
                    st = masked_scores(st, valid, t0, tt, row_seen, STEP)
            else:
                st = masked_scores(st, valid, t0, tt, row_seen, STEP)
            vs1 = tl.reshape(vs, (BLOCK_N,))
            top = tl.max(tl.maximum(tl.abs(vs1), tl.abs(tl.reshape(v_z, (BLOCK_N,))) * P_OFFSET_RATIO), axis=0)
            if past_headroom(st, m_ref, HEADROOM) + (top > sigma).to(tl.int32) > 0:  # rarely, after the first tile
                m_new = tl.maximum(m_i, tl.max(st, axis=0))
                alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
                sig_new = _raised_units(sigma, top)
                acc = acc * (alpha * (sigma / sig_new))[None, None, :]
                if PIVOT_DOT:
                    psum = psum * (alpha * (sigma / sig_new))[None, :]
                l_el = l_el * alpha[None, :]
                c_el = c_el * alpha[None, :]
                m_i = m_new
                m_use, m_ref = lazy_references(m_i)
                sigma = sig_new
            p = tl.exp2(st - m_use[None, :])  # <= 2^HEADROOM
            l_el = l_el + p
            pvr = _pv_operand(p * (vs1 / sigma)[:, None], PV_F16, INTERPRET)
            if PIVOT_DOT:
                c_el = c_el + p * tl.reshape(vmid, (BLOCK_N,))[:, None]  # P mid; the pivot's share in psum
                psum = dot_acc(e0, pvr, psum, INTERPRET)
            else:
                c_el = c_el + (p * tl.reshape(vmid, (BLOCK_N,))[:, None] - (V_PIVOT * sigma) * pvr.to(tl.float32))
            yv = tl.reshape(v_operand_t(vw, BLOCK_N, D, BITS, 1, V_SHL, V_PATTERN, PV_F16, INTERPRET), (D, BLOCK_N))
            acc = tl.reshape(dot_acc(yv, pvr, tl.reshape(acc, (D, BLOCK_H)), INTERPRET), (1, D, BLOCK_H))
            if (tile - t_lo) % CORR_EVERY == CORR_EVERY - 1:
                fold = tl.sum(c_el, axis=0) / sigma
                if PIVOT_DOT:
                    fold = fold - V_PIVOT * tl.sum(psum, axis=0)
                    psum = tl.zeros((16, BLOCK_H), tl.float32)
                acc += fold[None, None, :]
                c_el = tl.zeros((BLOCK_N, BLOCK_H), tl.float32)
        else:
            m_i, alpha, p, l_el = causal_softmax_step(st, valid, t0, tt, row_seen, m_i, l_el, STEP)  # p: P^T
        # ---- O^T += V^T P^T with the V offset corrections (before the division) -------------------
        if not (V_TOKEN and FOLD and VC_ == 1):
            acc = acc * alpha[None, None, :]
        if LAZY:
            pass  # the lazy softmax took the tile's PV product
        elif V_TOKEN:
            if FOLD and VC_ == 1:  # operand-fold, one channel group: 2-D, in the layout the scores came in
                vs1 = tl.reshape(vs, (BLOCK_N,))
                top = tl.maximum(tl.max(tl.abs(vs1), axis=0),  # P <= 1: the largest |s'| so far bounds P'
                                 tl.max(tl.abs(tl.reshape(v_z, (BLOCK_N,))), axis=0) * P_OFFSET_RATIO)
                sig_new = _raised_units(sigma, top)
                pvr = _pv_operand(p * (vs1 / sig_new)[:, None], PV_F16, INTERPRET)
                # the correction sum_t P mid - c sum_t P' sig, kept per element and folded into acc every
                # CORR_EVERY tiles: acc (sum P' y, y = q + beta > 0) grows with the length, and only the
                # correction brings it back to the output's size, so a correction kept apart to the end
                # of the split would cancel a sum over all of it (an error growing with the split's tiles,
                # docs/triton-perf.md); CORR_EVERY tiles bound that growth at a fraction of the reduction's
                # cost per tile
                c_el = c_el * alpha[None, :] + (p * tl.reshape(vmid, (BLOCK_N,))[:, None]
                                                - (V_PIVOT * sig_new) * pvr.to(tl.float32))
                yv = tl.reshape(v_operand_t(vw, BLOCK_N, D, BITS, 1, V_SHL, V_PATTERN, PV_F16, INTERPRET),
                                (D, BLOCK_N))
                # acc (units of sigma) rescaled, then the MMA accumulates into it: [D, BLOCK_H]
                acc2 = tl.reshape(acc, (D, BLOCK_H)) * (alpha * (sigma / sig_new))[None, :]
                acc = tl.reshape(dot_acc(yv, pvr, acc2, INTERPRET), (1, D, BLOCK_H))
                sigma = sig_new
                if (tile - t_lo) % CORR_EVERY == CORR_EVERY - 1:
                    acc += (tl.sum(c_el, axis=0) / sigma)[None, None, :]
                    c_el = tl.zeros((BLOCK_N, BLOCK_H), tl.float32)
            elif FOLD:  # operand-fold per channel group: P' = P s'[t, G] (power-of-two scaled), pivot correction
                top = tl.max(tl.abs(vs), axis=1)  # [VC_]: P <= 1, so |s'| bounds the operand
                scale = tl.exp2(tl.ceil(tl.log2(tl.where(top > 0, top, 1.0))))[:, None]  # [VC_, 1]
                pvr = _pv_operand(p[None, :, :] * (vs / scale)[:, :, None], PV_F16, INTERPRET)  # [VC_, N, H]
                corr = (tl.sum(p[None, :, :] * vmid[:, :, None], axis=1)
                        - V_PIVOT * scale * tl.sum(pvr.to(tl.float32), axis=1))  # [VC_, BLOCK_H]
                yv = v_operand_t(vw, BLOCK_N, D, BITS, VC_, V_SHL, V_PATTERN, PV_F16, INTERPRET)
                part = _dot_batched(yv, pvr, INTERPRET)  # [VC_, VGC, BLOCK_H]
                acc += part * scale[:, :, None] + corr[:, None, :]
            else:
                vc = v_codes(vw, BLOCK_N, D, BITS, VC_)
                x = round_operand(vs[:, :, None] * (vc.to(tl.float32) - HALF) + vmid[:, :, None], INTERPRET)
                pb = round_operand(p, INTERPRET)
                acc += _dot_batched(tl.permute(x, (0, 2, 1)), tl.broadcast_to(pb[None, :, :], (VC_, BLOCK_N, BLOCK_H)),
                                    INTERPRET)
        else:
            if FOLD:  # acc-fold: one token group per tile
                pb = _pv_operand(p, PV_F16, INTERPRET)
                yv = tl.reshape(v_operand_t(vw, BLOCK_N, D, BITS, 1, V_SHL, V_PATTERN, PV_F16, INTERPRET),
                                (D, BLOCK_N))
                part = dot(yv, pb, INTERPRET)  # [D, BLOCK_H]
                p_sum = tl.sum(pb.to(tl.float32), axis=0)[None, :]  # centred: s' (part - c sum P) + (z' + c s') sum P
                upd = (part - V_PIVOT * p_sum) * vs[:, None] + p_sum * vmid[:, None]
            else:
                cv = tl.reshape(v_codes(vw, BLOCK_N, D, BITS, 1), (BLOCK_N, D))
                pb = round_operand(p, INTERPRET)
                x = round_operand(vs[None, :] * (cv.to(tl.float32) - HALF) + vmid[None, :], INTERPRET)
                upd = dot(tl.trans(x), pb, INTERPRET)
            acc += tl.reshape(upd, (VC_, VGC, BLOCK_H))
        kw, vw, k_s, k_z, v_s, v_z = kw_n, vw_n, k_s_n, k_z_n, v_s_n, v_z_n
        if PREFETCH == 2:
            kw_n, vw_n, k_s_n, k_z_n, v_s_n, v_z_n = kw_2, vw_2, k_s_2, k_z_2, v_s_2, v_z_2

    # ---- partial output and LSE of this split -------------------------------------------------------
    den, lse = partial_result(m_i, tl.sum(l_el, axis=0))
    if PIVOT_DOT:  # the pivot sums not yet folded
        corr = tl.sum(c_el, axis=0) - (V_PIVOT * sigma) * tl.sum(psum, axis=0)
        out = (acc * sigma + corr[None, None, :]) / den[None, None, :]
    else:
        out = (acc * sigma + tl.sum(c_el, axis=0)[None, None, :]) / den[None, None, :]
    finish_split(tl.reshape(out, (D, BLOCK_H)), lse, OP, LP, O, LSE, SEM, op_off, lp_off, split, b, kvh, hmask, dd,
                 stride_ops, stride_opb, stride_lpb, stride_oph, stride_lph, stride_ob, stride_lb, stride_oh, stride_lh,
                 G=G, D=D, STEP=STEP, FUSED_COMBINE=FUSED_COMBINE, WINDOWS=WINDOWS, MERGE_H=MERGE_H, CHUNK=CHUNK,
                 WRITE_LSE=WRITE_LSE, ROTATE=ROTATE, ROT=ROT)


@triton.jit
def finish_split(out, lse, OP, LP, O, LSE, SEM, op_off, lp_off, split, b, kvh, hmask, dd,
                 stride_ops, stride_opb, stride_lpb, stride_oph, stride_lph, stride_ob, stride_lb, stride_oh, stride_lh,
                 G: tl.constexpr, D: tl.constexpr, STEP: tl.constexpr, FUSED_COMBINE: tl.constexpr,
                 WINDOWS: tl.constexpr, MERGE_H: tl.constexpr, CHUNK: tl.constexpr, WRITE_LSE: tl.constexpr,
                 ROTATE: tl.constexpr, ROT):
    """A split's end, in every stage-1 kernel: its partial output ``out`` (``O^T [D, BLOCK_H]``) and ``lse``
    stored, and with ``FUSED_COMBINE`` the merge in the epilogue: the last of this KV head's splits to finish
    merges its query heads' partials (and the BF16 windows', written by kernels launched before this one).
    The counter resets itself, so the next launch (a CUDA-graph replay too) finds it at zero."""
    o_ptr = OP + op_off[None, :] + split * stride_ops + dd[:, None]
    tl.store(o_ptr, out, mask=hmask[None, :])
    tl.store(LP + lp_off + split, lse, mask=hmask)
    if FUSED_COMBINE:
        tl.debug_barrier()  # every thread's partial stored before the release below
        sem = SEM + b * tl.num_programs(1) + kvh
        done = tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(2) - 1:
            tl.atomic_xchg(sem, 0, sem="relaxed", scope="gpu")
            mh = tl.arange(0, MERGE_H)
            heads = kvh * G + mh
            if STEP > 1:  # a step's rows b STEP + j of head kvh G + h: row j Hq + kvh G + h from row b STEP (the
                # launcher fuses the merge only where the row strides are Hq times the head strides)
                heads = (mh // G) * (G * tl.num_programs(1)) + kvh * G + mh % G
            merge_parts(OP + b * STEP * stride_opb, LP + b * STEP * stride_lpb, O + b * STEP * stride_ob,
                        LSE + b * STEP * stride_lb, heads, mh < G * STEP, tl.num_programs(2) + WINDOWS,
                        stride_oph, stride_ops, stride_lph, stride_oh, stride_lh, ROT,
                        CHUNK=CHUNK, D=D, WRITE_LSE=WRITE_LSE, CACHED=False, ROTATE=ROTATE)


@triton.jit
def _dot_batched(a, b, INTERPRET: tl.constexpr):
    """Batched ``a[c] @ b[c]`` over a leading channel-group axis; a plain 2-D dot when it has size 1."""
    if a.shape[0] == 1:
        r = dot(tl.reshape(a, (a.shape[1], a.shape[2])), tl.reshape(b, (b.shape[1], b.shape[2])), INTERPRET)
        r = tl.reshape(r, (1, a.shape[1], b.shape[2]))
    else:
        r = dot(a, b, INTERPRET)
    return r
