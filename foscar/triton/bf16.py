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
    of step token ``hh // G`` (row ``b STEP + hh // G`` of ``Q`` and of the partials), which reads the window of
    its own length ``L - TAIL - STEP + 1 + hh // G`` (``TAIL``: a part of a longer step): the sink's tokens below
    it, the ring's from that length's quantized count (the ring holds them: ``KVFormat.rollback``); a row that
    sees none of them writes an empty partial (``lse = -inf``)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    hh = tl.arange(0, BLOCK_H)
    causal: tl.constexpr = WINDOW > 0 and (STEP > 1 or TAIL > 0)
    lo = 0  # a step's rows: the window tokens (from the first) each row sees, [lo, hi)
    hi = 0
    if WINDOW == 0:  # explicit ranges
        n = tl.load(LEN + b)
        start = tl.load(START + b)
    else:  # a foscar cache's window, from its length (START holds the lengths): 1 = sink, 2 = recent ring
        L = tl.load(START + b)
        n_sink, n_quant, n_recent = split_of(L, SINK, RECENT, FLUSH)
        L_row = L - TAIL - (STEP - 1) + hh // G  # each row's length: its windows are that length's
        sink_row, quant_row, _ = split_of(L_row, SINK, RECENT, FLUSH)
        if WINDOW == 1:
            n = n_sink
            start = 0 * n_sink
            hi = sink_row
        else:
            n = n_recent
            start = n_quant
            if causal:  # from the first row's quantized count (the ring holds it: KVFormat.rollback)
                _, start, _ = split_of(L - TAIL - (STEP - 1), SINK, RECENT, FLUSH)
                n = L - TAIL - tl.minimum(L - TAIL, SINK) - start
            lo = quant_row - start
            hi = L_row - sink_row - start
    t_lo, t_hi = split_range(n, BLOCK_N)
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
        if causal:  # each row over its own length's window
            seen = seen & (i[None, :] >= lo[:, None]) & (i[None, :] < hi[:, None])
        s = tl.where(seen, dot(q, tl.trans(k), INTERPRET) * qk_scale, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(m_i, l_i, s, causal)
        acc = acc * alpha[:, None] + dot(round_operand(p, INTERPRET), v, INTERPRET)
    den, lse = partial_result(m_i, l_i)
    out = acc / den[:, None]
    slot = PART0 + split
    tl.store(OP + q_row[:, None] * stride_opb + head[:, None] * stride_oph + slot * stride_ops + dd[None, :], out,
             mask=hmask[:, None])
    tl.store(LP + q_row * stride_lpb + head * stride_lph + slot, lse, mask=hmask)
