"""Appending one decode step's K/V token per sequence to a foscar cache on the GPU (issue 7): the
graph-safe write path for token-wise K and V groups.

One program per (sequence, KV head, tensor). The new token goes to the BF16 sink while the sink is
filling, else to the recent ring; the ring token that leaves the recent window (with ``recent = 0``,
the new token itself) is quantized min-max, group by group, in float64 exactly as
:func:`foscar.quantize.quantize_groups` does, its codes written into the packed words of its page
(an atomic AND clears its bit fields, an atomic OR sets them: a word mixes tokens) and its ``(s', z')``
into the page's parameter rows. Lengths are read on the device: no host sync, no allocation, so a
CUDA graph captures it. :meth:`foscar.QuantKVCache.append` is the reference it matches bit for bit;
channel-wise groups (quantized a whole group at a time) use that path for now.
"""
import triton
import triton.language as tl


@triton.jit
def _field(t, c, TENSOR_V: tl.constexpr, BITS: tl.constexpr, D: tl.constexpr):
    """Word (within the pack block) and bit of token ``t`` (within the block), channel ``c``: the closed
    forms of :func:`foscar.format.block_map`."""
    if TENSOR_V:
        row = c % 64
        k = t
        warp = row // 16
        lanes_words: tl.constexpr = D // 64
    else:
        row = t
        k = c
        warp = 0 * c
        lanes_words: tl.constexpr = D * BITS // 64
    r16 = row % 16
    kb = k // 16
    k16 = k % 16
    lane = 4 * (r16 % 8) + (k16 % 8) // 2
    half = k16 % 2
    j = r16 // 8 + 2 * (k16 // 8)
    reg = 4 * kb + j
    PER_WORD: tl.constexpr = 16 // BITS
    thread = 32 * warp + lane
    if TENSOR_V:
        word = thread * lanes_words + c // 64
    else:
        word = thread * lanes_words + reg // PER_WORD
    shift = BITS * (reg % PER_WORD) + 16 * half
    return word, shift


@triton.jit
def append_token_kernel(
    X, SEQ, BT, NP, CODES, PARAMS, SINKW, RING,
    stride_xb, stride_xh,
    stride_btb,
    stride_cp, stride_ch,  # codes [pages, Hkv, W]
    stride_pp, stride_ph,  # params [pages, Hkv, page, D/g, 2]
    stride_sb, stride_sh, stride_st,  # sink [B, Hkv, sink, D]
    stride_rb, stride_rh, stride_rt,  # ring [B, Hkv, cap, D]
    BITS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr, SINK: tl.constexpr,
    RECENT: tl.constexpr, BETA: tl.constexpr, TENSOR_V: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    C: tl.constexpr = D // GROUP
    QMAX: tl.constexpr = (1 << BITS) - 1
    CAP: tl.constexpr = RECENT if RECENT > 0 else 1
    WPB: tl.constexpr = BLOCK_TOKENS * D * BITS // 32
    cc = tl.arange(0, C)
    gg = tl.arange(0, GROUP)
    ch = cc[:, None] * GROUP + gg[None, :]  # [C, g] channel index
    i = tl.load(SEQ + b)  # the new token's index (the length before this append)
    x = tl.load(X + b * stride_xb + h * stride_xh + ch)  # [C, g], the input dtype
    if i < SINK:
        tl.store(SINKW + b * stride_sb + h * stride_sh + i * stride_st + ch, x.to(SINKW.dtype.element_ty))
    else:
        p = i - SINK  # post-sink index; with token-wise groups a token leaves the ring per step
        leaving = p - RECENT
        ring_ptr = RING + b * stride_rb + h * stride_rh + ch
        if leaving >= 0:
            if RECENT > 0:
                src = tl.load(ring_ptr + (leaving % CAP) * stride_rt).to(tl.float64)
            else:
                src = x.to(tl.float64)
            lo = tl.min(src, axis=1)
            hi = tl.max(src, axis=1)
            sp = ((hi - lo) / QMAX).to(tl.float32)  # s' = s (alpha = 1 for the BF16 mapping)
            zp = (lo - BETA * sp.to(tl.float64)).to(tl.float32)  # z' = z - beta s', one rounding
            s_eff = sp.to(tl.float64)
            z_eff = zp.to(tl.float64) + BETA * s_eff
            safe = tl.where(s_eff > 0, s_eff, 1.0)
            q = tl.where(s_eff[:, None] > 0, (src - z_eff[:, None]) / safe[:, None], 0.0)
            q = (q + 4503599627370496.0) - 4503599627370496.0  # round half to even (torch.round): 2^52 trick
            q = tl.minimum(tl.maximum(q, 0.0), QMAX).to(tl.int32)
            page_i = leaving // PAGE
            off = leaving % PAGE
            if page_i < tl.load(NP + b):  # past the sequence's pages nothing is written (checked on the host)
                page = tl.load(BT + b * stride_btb + page_i).to(tl.int64)
                word, shift = _field(off % BLOCK_TOKENS, ch, TENSOR_V, BITS, D)
                wptr = CODES + page * stride_cp + h * stride_ch + (off // BLOCK_TOKENS) * WPB + word
                tl.atomic_and(wptr, ~(QMAX << shift))
                tl.atomic_or(wptr, q << shift)
                pptr = PARAMS + page * stride_pp + h * stride_ph + (off * C + cc) * 2
                tl.store(pptr, sp)
                tl.store(pptr + 1, zp)
        if RECENT > 0:  # after the read: the new token may take the slot the leaving one had
            tl.debug_barrier()
            tl.store(ring_ptr + (p % CAP) * stride_rt, x.to(RING.dtype.element_ty))
