"""Plain BF16 split-KV decode (stage 1) over a paged BF16 cache ``[pages, Hkv, page, D]``.

Two uses: the unquantized sink and recent windows of a foscar cache (one page per sequence, the
recent ring read with wrap-around), and the BF16 baseline decode with the same tiling. Q, K, V and P
reach the MMA as BF16 whatever the window dtype (an FP16 window is rounded to BF16 per tile).
"""
import triton
import triton.language as tl

from .common import dot, online_softmax, partial_result, round_operand, split_of, split_range


@triton.jit
def bf16_decode_stage1(
    Q, KB, VB, BT, START, LEN, OP, LP,
    qk_scale,
    stride_qb, stride_qh,
    stride_kp, stride_kh, stride_kt,  # [pages, Hkv, page, D]
    stride_vp, stride_vh, stride_vt,
    stride_btb,
    stride_opb, stride_oph, stride_ops,
    stride_lpb, stride_lph,
    PART0,  # index of the first partial slot this launch writes
    D: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    IDENTITY_PAGES: tl.constexpr, WRAP: tl.constexpr, INTERPRET: tl.constexpr,
    WINDOW: tl.constexpr = 0, SINK: tl.constexpr = 0, RECENT: tl.constexpr = 0, FLUSH: tl.constexpr = 1,
    STEP: tl.constexpr = 1, TAIL: tl.constexpr = 0,
):
    """Token ``i < LEN[b]`` of sequence ``b`` sits at position ``START[b] + i`` (modulo ``PAGE`` when
    ``WRAP``: a ring in one page) of its pages, ``BT[b, :]`` (page ``b`` when ``IDENTITY_PAGES``). A foscar
    cache's window and a step of ``STEP`` tokens (:mod:`foscar.multitoken`): row ``hh`` is head ``kvh G + hh % G``
    of step token ``hh // G`` (row ``b STEP + hh // G`` of ``Q`` and of the partials), which sees the window's
    tokens at sequence positions below ``L - TAIL - STEP + 1 + hh // G`` (``TAIL``: a part of a longer step); a
    row that sees none of them writes an empty partial (``lse = -inf``)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    first = 0  # the sequence position of the window's first token, and the last step token's limit
    limit = 0
    if WINDOW == 0:  # explicit ranges
        n = tl.load(LEN + b)
        start = tl.load(START + b)
    else:  # a foscar cache's window, from its length (START holds the lengths): 1 = sink, 2 = recent ring
        L = tl.load(START + b)
        n_sink, n_quant, n_recent = split_of(L, SINK, RECENT, FLUSH)
        limit = L - TAIL
        if WINDOW == 1:
            n = n_sink
            start = 0 * n_sink
        else:
            n = n_recent
            start = n_quant
            first = n_sink + n_quant
    t_lo, t_hi = split_range(n, BLOCK_N)
    hh = tl.arange(0, BLOCK_H)
    dd = tl.arange(0, D)
    tt = tl.arange(0, BLOCK_N)
    hmask = hh < G * STEP
    q_row = b * STEP + hh // G  # a step's rows (one token: b)
    head = kvh * G + hh % G
    q = tl.load(Q + q_row[:, None] * stride_qb + head[:, None] * stride_qh + dd[None, :], mask=hmask[:, None],
                other=0.0).to(tl.bfloat16)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    for tile in range(t_lo, t_hi):
        i = tile * BLOCK_N + tt
        valid = i < n
        pos = start + i
        if WRAP:
            pos = pos % PAGE
        if IDENTITY_PAGES:
            page = b.to(tl.int64) + 0 * pos
        else:
            page = tl.load(BT + b * stride_btb + pos // PAGE, mask=valid, other=0).to(tl.int64)
        row = pos % PAGE
        k = tl.load(KB + page[:, None] * stride_kp + kvh * stride_kh + row[:, None] * stride_kt + dd[None, :],
                    mask=valid[:, None], other=0.0)
        v = tl.load(VB + page[:, None] * stride_vp + kvh * stride_vh + row[:, None] * stride_vt + dd[None, :],
                    mask=valid[:, None], other=0.0)
        k = round_operand(k, INTERPRET)  # FP16 windows too: the MMA takes BF16 operands on both sides
        v = round_operand(v, INTERPRET)
        seen = valid[None, :]
        if STEP > 1 or TAIL > 0:  # causal among the step's tokens
            seen = seen & ((first + i)[None, :] < (limit - (STEP - 1) + hh // G)[:, None])
        s = tl.where(seen, dot(q, tl.trans(k), INTERPRET) * qk_scale, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(m_i, l_i, s, STEP > 1 or TAIL > 0)
        acc = acc * alpha[:, None] + dot(round_operand(p, INTERPRET), v, INTERPRET)
    den, lse = partial_result(m_i, l_i)
    out = acc / den[:, None]
    slot = PART0 + split
    tl.store(OP + q_row[:, None] * stride_opb + head[:, None] * stride_oph + slot * stride_ops + dd[None, :], out,
             mask=hmask[:, None])
    tl.store(LP + q_row * stride_lpb + head * stride_lph + slot, lse, mask=hmask)
