"""Appending K/V tokens to a foscar cache on the GPU: the graph-safe write path, every axis
combination. One decode step's token per sequence: :func:`append_token_kernel` (one launch per
tensor); several tokens (a prefill, a speculative step): :func:`append_quantize_kernel` then
:func:`append_window_kernel`, parallel over flush units and tokens.

The single-token kernel: one program per (sequence, KV head, tensor). The new token goes to the BF16 sink while the sink is
filling, else to the recent ring; the ring tokens that leave the recent window (one with token-wise
groups on both tensors, a whole group of ``g`` otherwise; with ``recent = 0`` the last is the new token
itself) are quantized min-max (or with a clip preset's ratio, or the ``"mse"`` search), group by group,
in float64 exactly as :func:`foscar.quantize.quantize_groups` does, its codes written into the packed words of its page
(an atomic AND clears its bit fields, an atomic OR sets them: a word mixes tokens) and its ``(s', z')``
into the page's parameter rows. Lengths are read on the device: no host sync, no allocation, so a
CUDA graph captures it. :meth:`foscar.QuantKVCache.append` is the reference it matches bit for bit.
"""
import triton
import triton.language as tl

from ..quantize import MSE_STEP as _MSE_STEP
from ..quantize import MSE_STEPS as _MSE_STEPS
from .write_fp4 import quantize_blocks_fp4

MSE_STEP = tl.constexpr(_MSE_STEP)  #: the ``"mse"`` quantizer's ratios (foscar.quantize.MSE_RATIOS)
MSE_STEPS = tl.constexpr(_MSE_STEPS)


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
def _quantize_unit(src, t, b, h, BT, NP, CODES, PARAMS, TS, stride_btb, stride_cp, stride_ch, stride_pp, stride_ph,
                   BITS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
                   FLUSH: tl.constexpr, CHANNEL: tl.constexpr, BETA: tl.constexpr, TENSOR_V: tl.constexpr,
                   BLOCK_TOKENS: tl.constexpr, RATIO: tl.constexpr, FP4: tl.constexpr, E8M0: tl.constexpr,
                   SEARCH: tl.constexpr):
    """Quantize one flush unit, ``src [FLUSH, D]`` (float64) of post-sink tokens ``t [FLUSH]`` of sequence
    ``b``, head ``h``, min-max (``RATIO`` 1) or with the min-max range shrunk about its midpoint by
    ``RATIO`` (a clip preset), as :func:`foscar.quantize.quantize_groups` does, and write its codes into
    the packed words of its pages (an atomic AND clears the bit fields, an atomic OR sets them: a word
    mixes tokens) and its ``(s', z')`` into the pages' parameter rows. ``FP4``: an FP4 block format's unit,
    its blocks of ``GROUP`` channels (``SEARCH``: the two candidate scales; ``E8M0``: MXFP4's bytes; ``TS``:
    the cache's per-tensor scales) as :func:`foscar.fp4.quantize_blocks` makes them, the scale bytes into the
    pages' rows."""
    if FP4:  # E2M1 codes and block-scale bytes (foscar.triton.write_fp4), token-wise: FLUSH is 1
        q, sbytes = quantize_blocks_fp4(src, tl.load(TS + TENSOR_V).to(tl.float64), FLUSH, D, GROUP, E8M0, SEARCH)
        ok, page, off = _page_of(t, b, BT, NP, stride_btb, PAGE)
        _write_codes(q, ok, page, off, h, CODES, stride_cp, stride_ch, BITS, D, TENSOR_V, BLOCK_TOKENS)
        cb = tl.arange(0, D // GROUP)
        tl.store(PARAMS + page[:, None] * stride_pp + h * stride_ph + off[:, None] * (D // GROUP) + cb[None, :],
                 sbytes.to(tl.uint8), mask=ok[:, None] & (cb >= 0)[None, :])
    else:
        _quantize_affine(src, t, b, h, BT, NP, CODES, PARAMS, stride_btb, stride_cp, stride_ch, stride_pp, stride_ph,
                         BITS, D, GROUP, PAGE, FLUSH, CHANNEL, BETA, TENSOR_V, BLOCK_TOKENS, RATIO, SEARCH)


@triton.jit
def _page_of(t, b, BT, NP, stride_btb, PAGE: tl.constexpr):
    """``(ok, page, off)`` of post-sink tokens ``t``: written only where their page is the sequence's (checked
    on the host), the page's pool index and the token's row in it."""
    page_i = t // PAGE
    ok = page_i < tl.load(NP + b)
    page = tl.load(BT + b * stride_btb + page_i, mask=ok, other=0).to(tl.int64)
    return ok, page, t % PAGE


@triton.jit
def _write_codes(q, ok, page, off, h, CODES, stride_cp, stride_ch, BITS: tl.constexpr, D: tl.constexpr,
                 TENSOR_V: tl.constexpr, BLOCK_TOKENS: tl.constexpr):
    """Codes ``q [FLUSH, D]`` of tokens at rows ``off`` of pool pages ``page`` (:func:`_page_of`; written where
    ``ok``) into the packed words: an atomic AND clears the bit fields, an atomic OR sets them (a word mixes
    tokens)."""
    QMAX: tl.constexpr = (1 << BITS) - 1
    WPB: tl.constexpr = BLOCK_TOKENS * D * BITS // 32
    dd = tl.arange(0, D)
    word, shift = _field((off % BLOCK_TOKENS)[:, None], dd[None, :], TENSOR_V, BITS, D)
    wptr = (CODES + page[:, None] * stride_cp + h * stride_ch + (off // BLOCK_TOKENS)[:, None] * WPB + word)
    ok2 = ok[:, None] & (dd >= 0)[None, :]  # full shape: atomics do not broadcast their mask
    tl.atomic_and(wptr, ~(QMAX << shift), mask=ok2)
    tl.atomic_or(wptr, q << shift, mask=ok2)


@triton.jit
def _affine_codes(src, lo, hi, QMAX: tl.constexpr, BETA: tl.constexpr):
    """Codes of ``src`` for the range ``[lo, hi]`` (float64, spread over ``src``'s shape) against the stored
    constants, as :func:`foscar.quantize._codes_for` forms them: ``(q, s', z', s_eff, z_eff)``, ``q`` float64."""
    sp = ((hi - lo) / QMAX).to(tl.float32)  # s' = s (alpha = 1 for the BF16 mapping)
    # z' = z - beta s' from z rounded to FP32 (OperandMapping.fold; min-max's z already is), then one rounding
    zp = (lo.to(tl.float32).to(tl.float64) - BETA * sp.to(tl.float64)).to(tl.float32)
    s_eff = sp.to(tl.float64)
    z_eff = zp.to(tl.float64) + BETA * s_eff
    safe = tl.where(s_eff > 0, s_eff, 1.0)
    q = tl.where(s_eff > 0, (src - z_eff) / safe, 0.0)
    q = (q + 4503599627370496.0) - 4503599627370496.0  # round half to even (torch.round): 2^52 trick
    q = tl.minimum(tl.maximum(q, 0.0), QMAX)
    return q, sp, zp, s_eff, z_eff


@triton.jit
def _spread(r, FLUSH: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr):
    """A value per token-wise group, ``r [FLUSH, D / GROUP]``, over its ``GROUP`` channels: ``[FLUSH, D]``."""
    return tl.reshape(tl.broadcast_to(r[:, :, None], (FLUSH, D // GROUP, GROUP)), (FLUSH, D))


@triton.jit
def _group_sum(e, FLUSH: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, CHANNEL: tl.constexpr):
    """Each group's sum of ``e [FLUSH, D]`` (float64), spread back over the group's elements: along the tokens
    per channel (``CHANNEL``, ``[1, D]``) or along ``GROUP`` channels per token (``[FLUSH, D]``)."""
    if CHANNEL:
        return tl.sum(e, axis=0)[None, :]
    return _spread(tl.sum(tl.reshape(e, (FLUSH, D // GROUP, GROUP)), axis=2), FLUSH, D, GROUP)


@triton.jit
def _quantize_affine(src, t, b, h, BT, NP, CODES, PARAMS, stride_btb, stride_cp, stride_ch, stride_pp, stride_ph,
                     BITS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
                     FLUSH: tl.constexpr, CHANNEL: tl.constexpr, BETA: tl.constexpr, TENSOR_V: tl.constexpr,
                     BLOCK_TOKENS: tl.constexpr, RATIO: tl.constexpr, SEARCH: tl.constexpr):
    """The affine formats' part of :func:`_quantize_unit`: min-max (or clipped) groups, codes and ``(s', z')``;
    ``SEARCH`` (the ``"mse"`` quantizer): of the min-max range shrunk about its midpoint by each of
    :data:`foscar.quantize.MSE_RATIOS`, the one with the least squared reconstruction error a group (ties:
    the first), as :func:`foscar.quantize.quantize_groups` chooses."""
    QMAX: tl.constexpr = (1 << BITS) - 1
    dd = tl.arange(0, D)
    if CHANNEL:  # one group along the tokens per channel: (s', z') [D]
        lo = tl.min(src, axis=0)[None, :]
        hi = tl.max(src, axis=0)[None, :]
    else:  # groups of GROUP channels per token: (s', z') [FLUSH, D / GROUP], spread back to [FLUSH, D]
        src3 = tl.reshape(src, (FLUSH, D // GROUP, GROUP))
        lo = _spread(tl.min(src3, axis=2), FLUSH, D, GROUP)
        hi = _spread(tl.max(src3, axis=2), FLUSH, D, GROUP)
    if RATIO != 1.0:  # in float64, in quantize_groups' order (the launch turns FMA contraction off)
        mid = (lo + hi) / 2
        half = (hi - lo) / 2
        ratio = tl.full((), RATIO, tl.float64)  # the double: a bare float constant would be float32
        lo = mid - ratio * half
        hi = mid + ratio * half
    if SEARCH:
        mid = (lo + hi) / 2
        half = (hi - lo) / 2
        q = src * 0.0
        sp = (mid * 0.0).to(tl.float32)
        zp = sp
        best = mid * 0.0
        for i in tl.static_range(MSE_STEPS):
            ratio = tl.full((), 1.0 - MSE_STEP * i, tl.float64)  # the doubles of MSE_RATIOS
            q_r, sp_r, zp_r, s_r, z_r = _affine_codes(src, mid - ratio * half, mid + ratio * half, QMAX, BETA)
            d = s_r * q_r + z_r - src
            err = _group_sum(d * d, FLUSH, D, GROUP, CHANNEL)
            if i == 0:  # the first ratio (1.0, min-max) stands until a later one errs strictly less
                best = err
                q = q_r
                sp = sp_r
                zp = zp_r
            else:
                keep = err < best
                best = tl.where(keep, err, best)
                q = tl.where(keep, q_r, q)
                sp = tl.where(keep, sp_r, sp)
                zp = tl.where(keep, zp_r, zp)
    else:
        q, sp, zp, _, _ = _affine_codes(src, lo, hi, QMAX, BETA)
    q = q.to(tl.int32)  # [FLUSH, D]
    ok, page, off = _page_of(t, b, BT, NP, stride_btb, PAGE)
    _write_codes(q, ok, page, off, h, CODES, stride_cp, stride_ch, BITS, D, TENSOR_V, BLOCK_TOKENS)
    ok2 = ok[:, None] & (dd >= 0)[None, :]
    pbase = PARAMS + page[:, None] * stride_pp + h * stride_ph
    if CHANNEL:  # the group's row: (off // GROUP) in a page of >= GROUP tokens, else row 0 of every page
        row = (off // GROUP if PAGE >= GROUP else 0 * off)[:, None]
        pptr = pbase + (row * D + dd[None, :]) * 2
    else:  # one row per token, one column per channel group
        pptr = pbase + (off[:, None] * (D // GROUP) + dd[None, :] // GROUP) * 2
    tl.store(pptr, sp, mask=ok2)
    tl.store(pptr + 1, zp, mask=ok2)


@triton.jit
def append_token_kernel(
    X, SEQ, BT, NP, CODES, PARAMS, SINKW, RING, TS, RING_FROM,
    stride_xb, stride_xh,
    stride_btb,
    stride_cp, stride_ch,  # codes [pages, Hkv, W]
    stride_pp, stride_ph,  # params [pages, Hkv, rows, cols, 2]
    stride_sb, stride_sh, stride_st,  # sink [B, Hkv, sink, D]
    stride_rb, stride_rh, stride_rt,  # ring [B, Hkv, cap, D]
    BITS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr, SINK: tl.constexpr,
    RECENT: tl.constexpr, CAP: tl.constexpr, FLUSH: tl.constexpr, CHANNEL: tl.constexpr, BETA: tl.constexpr,
    TENSOR_V: tl.constexpr, BLOCK_TOKENS: tl.constexpr, PASS_WINDOW: tl.constexpr, RATIO: tl.constexpr,
    FP4: tl.constexpr, E8M0: tl.constexpr, SEARCH: tl.constexpr, ROLLBACK: tl.constexpr = 0,
    UPDATE_RING: tl.constexpr = False,
):
    """Program (sequence ``b``, KV head ``h``) of one tensor. ``FLUSH`` tokens are quantized together when
    the quantized count grows (1 when both tensors are token-wise, else a whole group); ``CHANNEL``: this
    tensor's groups run along tokens (one ``(s', z')`` per channel of the group) rather than channels;
    ``PASS_WINDOW``: the format has a recent ring, so a token is quantized from the ring's dtype
    (:meth:`foscar.KVFormat.as_quantized`) even when it never sat there; ``ROLLBACK``: the ring keeps every new
    token (:meth:`foscar.KVFormat.ring_keep_from`); ``UPDATE_RING`` (one tensor's launch of a format with a ring):
    head 0's program moves the sequence's ``RING_FROM`` on (:meth:`foscar.QuantKVCache.advance_ring`)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    dd = tl.arange(0, D)
    tok = tl.arange(0, FLUSH)
    i = tl.load(SEQ + b)  # the new token's index (the length before this append)
    x = tl.load(X + b * stride_xb + h * stride_xh + dd)  # [D], the input dtype
    if i < SINK:
        tl.store(SINKW + b * stride_sb + h * stride_sh + i * stride_st + dd, x.to(SINKW.dtype.element_ty))
    else:
        p = i - SINK  # post-sink index of the new token
        q0 = tl.maximum(p - RECENT, 0) // FLUSH * FLUSH  # quantized count before / after the append
        q1 = tl.maximum(p + 1 - RECENT, 0) // FLUSH * FLUSH
        ring = RING + b * stride_rb + h * stride_rh
        if q1 > q0:  # tokens [q0, q1) leave the ring (the last may be the new token itself)
            t = q0 + tok  # [FLUSH] post-sink indices
            from_ring = t < p
            src = tl.load(ring + (t % CAP)[:, None] * stride_rt + dd[None, :], mask=from_ring[:, None], other=0.0)
            xq = x.to(RING.dtype.element_ty) if PASS_WINDOW else x  # as the ring would hold it
            src = tl.where(from_ring[:, None], src.to(tl.float64), xq.to(tl.float64)[None, :])  # [FLUSH, D]
            _quantize_unit(src, t, b, h, BT, NP, CODES, PARAMS, TS, stride_btb, stride_cp, stride_ch, stride_pp,
                           stride_ph, BITS, D, GROUP, PAGE, FLUSH, CHANNEL, BETA, TENSOR_V, BLOCK_TOKENS, RATIO,
                           FP4, E8M0, SEARCH)
        if ROLLBACK > 0 or p >= q1:  # the ring keeps the new token; after the reads above, which may share its slot
            tl.debug_barrier()
            tl.store(ring + (p % CAP) * stride_rt + dd, x.to(RING.dtype.element_ty))
        if UPDATE_RING:
            if h == 0:
                keep = q1
                if ROLLBACK > 0:
                    keep = tl.maximum(p + 1 - CAP, 0)
                tl.store(RING_FROM + b, tl.maximum(tl.load(RING_FROM + b), keep))


@triton.jit
def _post_sink_counts(L, SINK: tl.constexpr, RECENT: tl.constexpr, FLUSH: tl.constexpr):
    """Post-sink tokens and quantized tokens of a sequence of ``L`` tokens."""
    p = tl.maximum(L - SINK, 0)
    return p, tl.maximum(p - RECENT, 0) // FLUSH * FLUSH


@triton.jit
def append_quantize_kernel(
    X, SEQ, BT, NP, CODES, PARAMS, RING, TS, T,
    stride_xb, stride_xh, stride_xt,
    stride_btb, stride_cp, stride_ch, stride_pp, stride_ph, stride_rb, stride_rh, stride_rt,
    BITS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr, SINK: tl.constexpr,
    RECENT: tl.constexpr, CAP: tl.constexpr, FLUSH: tl.constexpr, CHANNEL: tl.constexpr, BETA: tl.constexpr,
    TENSOR_V: tl.constexpr, BLOCK_TOKENS: tl.constexpr, PASS_WINDOW: tl.constexpr, RATIO: tl.constexpr,
    FP4: tl.constexpr, E8M0: tl.constexpr, SEARCH: tl.constexpr,
):
    """Appending ``T`` tokens, part 1 of 2: program (sequence ``b``, head ``h``, unit ``u``) quantizes the
    ``u``-th flush unit of the post-sink tokens that leave the recent window in this append, taken from
    the ring (those already there) or from the input (those that arrive past the window, as in a
    prefill). Units run in parallel; :func:`append_window_kernel`, launched after, overwrites ring slots."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    u = tl.program_id(2)
    dd = tl.arange(0, D)
    L0 = tl.load(SEQ + b)  # the length before the append
    p0, q0 = _post_sink_counts(L0, SINK, RECENT, FLUSH)
    _, q1 = _post_sink_counts(L0 + T, SINK, RECENT, FLUSH)
    t0 = q0 + u * FLUSH
    if t0 < q1:  # whole units: q0 and q1 are multiples of FLUSH
        t = t0 + tl.arange(0, FLUSH)
        from_ring = t < p0
        ring = RING + b * stride_rb + h * stride_rh
        old = tl.load(ring + (t % CAP)[:, None] * stride_rt + dd[None, :], mask=from_ring[:, None], other=0.0)
        j = t + SINK - L0  # the input token of a post-sink index past the old length
        new = tl.load(X + b * stride_xb + h * stride_xh + j[:, None] * stride_xt + dd[None, :],
                      mask=(~from_ring)[:, None], other=0.0)
        if PASS_WINDOW:  # arriving past the window: quantized as the ring would hold them
            new = new.to(RING.dtype.element_ty)
        src = tl.where(from_ring[:, None], old.to(tl.float64), new.to(tl.float64))
        _quantize_unit(src, t, b, h, BT, NP, CODES, PARAMS, TS, stride_btb, stride_cp, stride_ch, stride_pp,
                       stride_ph, BITS, D, GROUP, PAGE, FLUSH, CHANNEL, BETA, TENSOR_V, BLOCK_TOKENS, RATIO,
                       FP4, E8M0, SEARCH)


@triton.jit
def append_window_kernel(
    X, SEQ, SINKW, RING, T, RING_FROM,
    stride_xb, stride_xh, stride_xt,
    stride_sb, stride_sh, stride_st, stride_rb, stride_rh, stride_rt,
    D: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, CAP: tl.constexpr, FLUSH: tl.constexpr,
    BLOCK_T: tl.constexpr, ROLLBACK: tl.constexpr = 0, UPDATE_RING: tl.constexpr = False,
):
    """Appending ``T`` tokens, part 2 of 2: program (sequence, head, block of ``BLOCK_T`` input tokens)
    writes the tokens that go to the BF16 sink and those the recent ring keeps (after part 1 has read the ring
    tokens that left): the window's, or with ``ROLLBACK`` the last ``CAP`` (:meth:`foscar.KVFormat.ring_keep_from`);
    ``UPDATE_RING``: the sequence's first program moves its ``RING_FROM`` on there
    (:meth:`foscar.QuantKVCache.advance_ring`)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    jj = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    dd = tl.arange(0, D)
    L0 = tl.load(SEQ + b)
    p1, keep = _post_sink_counts(L0 + T, SINK, RECENT, FLUSH)
    if ROLLBACK > 0:
        keep = tl.maximum(p1 - CAP, 0)
    i = L0 + jj  # the tokens' indices in the sequence
    live = jj < T
    x = tl.load(X + b * stride_xb + h * stride_xh + jj[:, None] * stride_xt + dd[None, :], mask=live[:, None],
                other=0.0)
    in_sink = live & (i < SINK)
    tl.store(SINKW + b * stride_sb + h * stride_sh + i[:, None] * stride_st + dd[None, :],
             x.to(SINKW.dtype.element_ty), mask=in_sink[:, None])
    p = i - SINK
    stay = live & (i >= SINK) & (p >= keep)
    if UPDATE_RING:
        if (h == 0) & (tl.program_id(2) == 0):
            tl.store(RING_FROM + b, tl.maximum(tl.load(RING_FROM + b), keep))
    tl.store(RING + b * stride_rb + h * stride_rh + (p % CAP)[:, None] * stride_rt + dd[None, :],
             x.to(RING.dtype.element_ty), mask=stay[:, None])
