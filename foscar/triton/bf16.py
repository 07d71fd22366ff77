"""Plain BF16 split-KV decode (stage 1) over a paged BF16 cache ``[pages, Hkv, page, D]``.

Two uses: the unquantized sink and recent windows of a foscar cache (one page per sequence, the
recent ring read with wrap-around), and the BF16 baseline decode with the same tiling.
"""
import triton
import triton.language as tl


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
    NUM_SPLITS: tl.constexpr, IDENTITY_PAGES: tl.constexpr, WRAP: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Token ``i < LEN[b]`` of sequence ``b`` sits at position ``START[b] + i`` (modulo ``PAGE`` when
    ``WRAP``: a ring in one page) of its pages, ``BT[b, :]`` (page ``b`` when ``IDENTITY_PAGES``)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(LEN + b)
    start = tl.load(START + b)
    n_tiles = tl.cdiv(n, BLOCK_N)
    per = tl.cdiv(n_tiles, NUM_SPLITS)
    t_lo = split * per
    t_hi = tl.minimum(t_lo + per, n_tiles)
    hh = tl.arange(0, BLOCK_H)
    dd = tl.arange(0, D)
    tt = tl.arange(0, BLOCK_N)
    hmask = hh < G
    q = tl.load(Q + b * stride_qb + (kvh * G + hh)[:, None] * stride_qh + dd[None, :], mask=hmask[:, None],
                other=0.0).to(tl.bfloat16)
    if INTERPRET:
        q = q.to(tl.float32)
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
        if INTERPRET:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.where(valid[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if INTERPRET:
            pb = p
        else:
            pb = p.to(tl.bfloat16)
        acc = acc * alpha[:, None] + tl.dot(pb, v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    slot = PART0 + split
    tl.store(OP + b * stride_opb + (kvh * G + hh)[:, None] * stride_oph + slot * stride_ops + dd[None, :], out,
             mask=hmask[:, None])
    tl.store(LP + b * stride_lpb + (kvh * G + hh) * stride_lph + slot, lse, mask=hmask)
