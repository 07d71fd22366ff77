"""Reading the packed cache in Triton: codes of a KV tile, in true token and channel order.

The words of a tile are loaded once, as an N-d tensor whose axes are the fragment coordinates of
``docs/layout.md`` (K block, lane row/column, word, ...), and every code field is pulled out by one
broadcast shift whose shift amounts form the remaining axes. Ordering those axes as the token and
channel digits of the true coordinates makes a plain ``reshape`` give ``[C, BLOCK_N, GC]``: ``C``
channel groups of ``GC`` channels (``C = 1`` unless a token-wise axis has groups smaller than the
head dim), tokens and channels in their natural order. Nothing is gathered or permuted.
"""
import triton
import triton.language as tl


@triton.jit
def _field_bits(BITS: tl.constexpr, NF: tl.constexpr):
    """Low bit of each register field of a word, ``[JR, F]`` with ``F = (ib, jc)``: register
    ``4*ib + 2*jc + jr`` of the word sits at ``BITS * register`` (its pair partner 16 bits higher)."""
    jr = tl.arange(0, 2)
    f = tl.arange(0, NF)
    return BITS * (4 * (f[None, :] // 2) + 2 * (f[None, :] % 2) + jr[:, None])


@triton.jit
def k_words(base, ok, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, C: tl.constexpr):
    """The words of ``BLOCK_N`` K tokens from pointer ``base`` (none read unless ``ok``), axes
    ``(C, NB, L4, PG, LC)``: K block, lane row ``l4``, the channel group's words of the lane, lane column
    ``lc`` (lane = ``4*l4 + lc``). Loading apart from decoding lets a kernel fetch the next tile early."""
    WPL: tl.constexpr = D * BITS // 64  # words per lane per K block
    PG: tl.constexpr = WPL // C  # words per lane per channel group
    NB: tl.constexpr = BLOCK_N // 16
    c = tl.arange(0, C)
    blk = tl.arange(0, NB)
    l4 = tl.arange(0, 8)
    pi = tl.arange(0, PG)
    lc = tl.arange(0, 4)
    offs = (blk[None, :, None, None, None] * (32 * WPL)
            + (4 * l4[None, None, :, None, None] + lc[None, None, None, None, :]) * WPL
            + c[:, None, None, None, None] * PG + pi[None, None, None, :, None])
    return tl.load(base + offs, mask=ok)


@triton.jit
def k_codes(w, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, C: tl.constexpr):
    """Codes of ``BLOCK_N`` K tokens from their words ``w`` (:func:`k_words`): int32 ``[C, BLOCK_N, D // C]``.

    A K block is 16 tokens; lane ``4*l4 + lc`` of it holds token ``l4 + 8*jr`` and channels
    ``16*b + 8*jc + 2*lc + h`` at bit ``BITS*(4*ib + 2*jc + jr) + 16*h`` of its word ``p``, where the
    k16 block is ``b = p*(4/BITS) + ib``.
    """
    h = tl.arange(0, 2)
    sh = _field_bits(BITS, 8 // BITS)[:, :, None] + 16 * h[None, None, :]  # (JR, F, H)
    # axes (C, NB, JR, L4, PG, F, LC, H): tokens (NB, JR, L4), channels (PG, F, LC, H)
    codes = (w[:, :, None, :, :, None, :, None] >> sh[None, None, :, None, None, :, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, (C, BLOCK_N, D // C))


@triton.jit
def v_words(base, ok, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, C: tl.constexpr):
    """The words of ``BLOCK_N`` V tokens from pointer ``base`` (none read unless ``ok``), axes
    ``(C, MG, L4, NB, LC)``: channel group, its 16-channel rows ``(mh, w)``, lane row ``l4``, V block,
    lane column ``lc``.

    A V block is ``64/BITS`` tokens and ``2*D`` words: thread ``32*w + 4*l4 + lc`` holds, in its word
    ``mh``, channel ``64*mh + 16*w + l4 + 8*jr`` and tokens ``16*ib + 8*jc + 2*lc + h`` at bit
    ``BITS*(4*ib + 2*jc + jr) + 16*h``.
    """
    NIB: tl.constexpr = 4 // BITS  # k16 blocks (of tokens) per word
    NB: tl.constexpr = BLOCK_N // (16 * NIB)
    MH: tl.constexpr = D // 64
    MG: tl.constexpr = D // 16 // C  # (mh, w) rows of 16 channels per channel group
    c = tl.arange(0, C)
    mi = tl.arange(0, MG)
    l4 = tl.arange(0, 8)
    blk = tl.arange(0, NB)
    lc = tl.arange(0, 4)
    m = c[:, None] * MG + mi[None, :]  # (C, MG): 16-channel row = 4*mh + w
    thread = 32 * (m % 4)[:, :, None, None, None] + 4 * l4[None, None, :, None, None] + lc[None, None, None, None, :]
    offs = blk[None, None, None, :, None] * (2 * D) + thread * MH + (m // 4)[:, :, None, None, None]
    return tl.load(base + offs, mask=ok)


@triton.jit
def v_codes(w, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, C: tl.constexpr):
    """Codes of ``BLOCK_N`` V tokens from their words ``w`` (:func:`v_words`): int32 ``[C, BLOCK_N, D // C]``."""
    NIB: tl.constexpr = 4 // BITS
    wt = tl.permute(w, (0, 3, 4, 1, 2))  # axes (C, NB, LC, MG, L4)
    f = tl.arange(0, 2 * NIB)  # (ib, jc)
    h = tl.arange(0, 2)
    jr = tl.arange(0, 2)
    sh = (BITS * (4 * (f[:, None, None] // 2) + 2 * (f[:, None, None] % 2) + jr[None, None, :])
          + 16 * h[None, :, None])
    # axes (C, NB, F, LC, H, MG, JR, L4): tokens (NB, F, LC, H), channels (MG, JR, L4)
    codes = (wt[:, :, None, :, None, :, None, :] >> sh[None, None, :, None, :, None, :, None]) & ((1 << BITS) - 1)
    return tl.reshape(codes, (C, BLOCK_N, D // C))


@triton.jit
def v_codes_t(w, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, C: tl.constexpr):
    """Codes of ``BLOCK_N`` V tokens from their words ``w`` (:func:`v_words`), transposed: int32
    ``[D, BLOCK_N]`` (channels of group ``c`` in rows ``c D/C ...``), with no permute of the registers: the
    shifts' axes are ordered as the true channel and token digits."""
    NIB: tl.constexpr = 4 // BITS
    f = tl.arange(0, 2 * NIB)  # (ib, jc)
    h = tl.arange(0, 2)
    jr = tl.arange(0, 2)
    sh = (BITS * (4 * (f[None, :, None] // 2) + 2 * (f[None, :, None] % 2) + jr[:, None, None])
          + 16 * h[None, None, :])  # (JR, F, H)
    # axes (C, MG, JR, L4, NB, F, LC, H): channels (C, MG, JR, L4), tokens (NB, F, LC, H)
    codes = (w[:, :, None, :, :, None, :, None] >> sh[None, None, :, None, None, :, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(codes, (D, BLOCK_N))


@triton.jit
def inject(codes, PATTERN: tl.constexpr, SHL: tl.constexpr, F16: tl.constexpr, INTERPRET: tl.constexpr):
    """Mantissa injection (:func:`foscar.format.injection`): ``PATTERN | (q << SHL)`` read as BF16
    (or FP16 when ``F16``) is ``q + beta``; float32 under the interpreter."""
    bits = ((codes << SHL) | PATTERN).to(tl.int16)
    if F16:
        y = bits.to(tl.float16, bitcast=True)
    else:
        y = bits.to(tl.bfloat16, bitcast=True)
    if INTERPRET:
        y = y.to(tl.float32)
    return y


@triton.jit
def _inject_pairs(w, rot, BITS: tl.constexpr, SHL: tl.constexpr, PATTERN: tl.constexpr, F16: tl.constexpr):
    """The paper's Hopper construction, one register per pair of codes: rotate the word so the pair's
    fields (16 bits apart) sit at bit ``SHL`` of each half, then one ``lop3`` keeps them and ORs in
    the exponent ``PATTERN`` of both halves. Returns the two operands joined on a new last axis
    (kept in one thread), ``[..., 2]``: low half first."""
    MASK: tl.constexpr = (((1 << BITS) - 1) << SHL) * 0x10001
    PAT2: tl.constexpr = PATTERN * 0x10001
    asm: tl.constexpr = (f"{{ .reg .b32 t; shf.r.wrap.b32 t, $2, $2, $3; lop3.b32 t, t, {MASK}, {PAT2}, 0xEA; "
                         "mov.b32 {$0, $1}, t; }")
    if F16:
        lo, hi = tl.inline_asm_elementwise(asm, "=h,=h,r,r", [w, rot], dtype=(tl.float16, tl.float16), is_pure=True,
                                           pack=1)
    else:
        lo, hi = tl.inline_asm_elementwise(asm, "=h,=h,r,r", [w, rot], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                           pack=1)
    return tl.join(lo, hi)


@triton.jit
def k_operand(w, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, C: tl.constexpr, SHL: tl.constexpr,
              PATTERN: tl.constexpr, INTERPRET: tl.constexpr):
    """The BF16 K operand ``[C, BLOCK_N, D // C]`` (``PATTERN | q << SHL``) from the words ``w``
    (:func:`k_words`), true token and channel order.

    On the GPU: one rotate and one ``lop3`` per pair of channels (the pair axis ``h`` is the last one,
    kept in-thread by ``tl.join``, so the tile reaches the MMA without a trip through shared memory).
    Under the interpreter (no inline assembly): per code, from :func:`k_codes`."""
    if INTERPRET:
        y = inject(k_codes(w, BLOCK_N, D, BITS, C), PATTERN, SHL, False, INTERPRET)
    else:  # w: axes (C, NB, L4, PG, LC)
        rot = (_field_bits(BITS, 8 // BITS) - SHL + 32) % 32  # (JR, F)
        w7 = w[:, :, None, :, :, None, :] + 0 * rot[None, None, :, None, None, :, None]
        rot7 = rot[None, None, :, None, None, :, None] + 0 * w7
        # axes (C, NB, JR, L4, PG, F, LC, H): tokens (NB, JR, L4), channels (PG, F, LC, H)
        y = tl.reshape(_inject_pairs(w7, rot7, BITS, SHL, PATTERN, False), (C, BLOCK_N, D // C))
    return y


@triton.jit
def v_operand_t(w, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, C: tl.constexpr,
                SHL: tl.constexpr, PATTERN: tl.constexpr, F16: tl.constexpr, INTERPRET: tl.constexpr):
    """The transposed V operand ``V^T [C, D // C, BLOCK_N]`` (BF16, or FP16 when ``F16``) from the words
    ``w`` (:func:`v_words`), true order.

    Transposed because a register holds two tokens of one channel: with tokens last (the pair axis
    in-thread), ``V^T`` is the A operand of ``O^T = V^T P^T`` straight from registers, as the paper's
    Hopper kernel uses it. Under the interpreter: from :func:`v_codes`."""
    if INTERPRET:
        y = tl.permute(inject(v_codes(w, BLOCK_N, D, BITS, C), PATTERN, SHL, F16, INTERPRET), (0, 2, 1))
    else:  # w: axes (C, MG, L4, NB, LC)
        NIB: tl.constexpr = 4 // BITS
        rot = (_field_bits(BITS, 2 * NIB) - SHL + 32) % 32  # (JR, F)
        w7 = w[:, :, None, :, :, None, :] + 0 * rot[None, None, :, None, None, :, None]
        rot7 = rot[None, None, :, None, None, :, None] + 0 * w7
        # axes (C, MG, JR, L4, NB, F, LC, H): channels (MG, JR, L4), tokens (NB, F, LC, H)
        y = tl.reshape(_inject_pairs(w7, rot7, BITS, SHL, PATTERN, F16), (C, D // C, BLOCK_N))
    return y
