"""The FP4 block formats' tensor-core operands in Triton, built from the packed words (the E2M1 codes sit where
INT4 codes do, ``docs/layout.md``), the block scales multiplied in as FP16 pairs.

On the GPU, one register per pair of codes (the pair's two fields 16 bits apart, as
:func:`foscar.triton.tiles._inject_pairs` takes them): a rotate puts both nibbles at bit 9 of their halves,
an ``and`` keeps the exponent and mantissa bits (9-11), a shift and a ``lop3`` move the sign to bit 15: the
FP16 value ``v 2^-14`` (the codes of magnitude 0 and 0.5 are FP16 subnormals, exact); then one ``mul.f16x2`` by
the register's pair of scales ``c``: the operands ``v c 2^-14``. Under the interpreter (no inline assembly): per
code, the same placement read back in float32.

The scales are FP16 pairs (``int32``, the low half the first code's): each register's two codes share one
scale in the K operand (two channels of a token, one block) and have one each in the transposed V operand (two
tokens of a channel). A product of an E2M1 value (2 significant bits) and a scale of at most 4 is exact in FP16
wherever it is normal. The callers pass ``c = 2^15 s / 2^E`` (``2^E`` a power of two at or above the scales of a
token, or of a tile's channel block: ``c <= 2^15``), so the operand ``2 v s / 2^E`` is at most 12 and exact
down to ``s / 2^E >= 2^-14``; a smaller scale's products round at FP16's subnormal spacing, ``2^-24``: at most
``2^-27`` of the largest operand of that token or block. :func:`block_scales` reads the scale bytes (the decode
kernel's, and the write kernels' candidates).
"""
import triton
import triton.language as tl

from .tiles import _field_bits, k_codes, v_codes_t

_PLACE_SCALE = tl.constexpr("{ .reg .b32 t, u; shf.r.wrap.b32 t, $2, $2, $3; shl.b32 u, t, 3; "
                             "and.b32 t, t, 0x0E000E00; lop3.b32 t, u, 0x80008000, t, 0xEA; mul.rn.f16x2 t, t, $4; "
                             "mov.b32 {$0, $1}, t; }")


@triton.jit
def _placed_pairs(w, rot, scale):
    """The two FP16 operands ``v s`` of each register's pair of codes (see the module): ``[..., 2]``, low first."""
    lo, hi = tl.inline_asm_elementwise(_PLACE_SCALE, "=h,=h,r,r,r", [w, rot, scale], dtype=(tl.float16, tl.float16),
                                       is_pure=True, pack=1)
    return tl.join(lo, hi)


@triton.jit
def placed_f32(codes):
    """E2M1 codes (int32) by the same placement, read back in float32: the value times ``2^-14``, exact."""
    bits = (((codes & 8) << 12) | ((codes & 7) << 9)).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _half_bits(x):
    """FP16 bits of ``x`` (float32, rounded to FP16) in the low 16 bits of an int32."""
    return x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def k_operand_fp4(w, scale, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """The K operand ``[BLOCK_N, D]`` (FP16; float32 under the interpreter), ``v s 2^-14`` per value, from the words
    ``w`` (:func:`foscar.triton.tiles.k_words` with one channel group) and ``scale [BLOCK_N, D / BLOCK]``
    (float32, rounded to FP16 here)."""
    NBLK: tl.constexpr = D // BLOCK
    if INTERPRET:
        s = tl.reshape(tl.broadcast_to(scale.to(tl.float16).to(tl.float32)[:, :, None], (BLOCK_N, NBLK, BLOCK)),
                       (BLOCK_N, D))
        y = placed_f32(tl.reshape(k_codes(w, BLOCK_N, D, 4, 1), (BLOCK_N, D))) * s
    else:  # w: axes (1, NB, L4, PG, LC); word p of a lane holds channels 16p .. 16p + 15
        NB: tl.constexpr = BLOCK_N // 16
        PG: tl.constexpr = D // 16
        sb = _half_bits(scale) * 0x10001  # both halves: a register's two channels share the block
        sb = tl.reshape(tl.broadcast_to(tl.reshape(sb, (NB, 2, 8, NBLK))[:, :, :, :, None], (NB, 2, 8, NBLK, PG // NBLK)),
                        (NB, 2, 8, PG))  # tokens (NB, JR, L4), words
        rot = (_field_bits(4, 2) - 9 + 32) % 32  # (JR, F)
        w7 = w[:, :, None, :, :, None, :] + 0 * rot[None, None, :, None, None, :, None]
        rot7 = rot[None, None, :, None, None, :, None] + 0 * w7
        s7 = sb[None, :, :, :, :, None, None] + 0 * w7
        # axes (1, NB, JR, L4, PG, F, LC, H): tokens (NB, JR, L4), channels (PG, F, LC, H)
        y = tl.reshape(_placed_pairs(w7, rot7, s7), (BLOCK_N, D))
    return y


@triton.jit
def v_operand_t_fp4(w, scale, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """The transposed V operand ``V^T [D, BLOCK_N]`` (FP16; float32 under the interpreter), ``v s 2^-14`` per value,
    from the words ``w`` (:func:`foscar.triton.tiles.v_words` with one channel group) and ``scale [D / BLOCK,
    BLOCK_N]`` (float32, rounded to FP16 here)."""
    NBLK: tl.constexpr = D // BLOCK
    if INTERPRET:
        s = tl.reshape(tl.broadcast_to(scale.to(tl.float16).to(tl.float32)[:, None, :], (NBLK, BLOCK, BLOCK_N)),
                       (D, BLOCK_N))
        y = placed_f32(v_codes_t(w, BLOCK_N, D, 4, 1)) * s
    else:  # w: axes (1, MG, L4, NB, LC); row mg of a lane holds channels 16 mg .. 16 mg + 15
        NB: tl.constexpr = BLOCK_N // 16
        MG: tl.constexpr = D // 16
        lo, hi = tl.split(tl.reshape(_half_bits(scale), (NBLK, NB, 2, 4, 2)))  # tokens (NB, F, LC, H)
        sb = lo | (hi << 16)  # a register's two tokens
        sb = tl.reshape(tl.broadcast_to(sb[:, None, :, :, :], (NBLK, MG // NBLK, NB, 2, 4)), (MG, NB, 2, 4))
        rot = (_field_bits(4, 2) - 9 + 32) % 32  # (JR, F)
        w7 = w[:, :, None, :, :, None, :] + 0 * rot[None, None, :, None, None, :, None]
        rot7 = rot[None, None, :, None, None, :, None] + 0 * w7
        s7 = sb[None, :, None, None, :, :, :] + 0 * w7
        # axes (1, MG, JR, L4, NB, F, LC, H): channels (MG, JR, L4), tokens (NB, F, LC, H)
        y = tl.reshape(_placed_pairs(w7, rot7, s7), (D, BLOCK_N))
    return y


@triton.jit
def block_scales(byte, E8M0: tl.constexpr):
    """Block-scale bytes (int32) as float32: E4M3 (the byte ``0x7F``/``0xFF`` NaN) or E8M0 (``2^(b - 127)``,
    255 NaN), as :func:`foscar.fp4.decode_scale` reads them."""
    if E8M0:
        v = tl.where(byte == 0, 5.877471754111438e-39, (byte << 23).to(tl.float32, bitcast=True))
        v = tl.where(byte == 255, float("nan"), v)
    else:
        e = (byte >> 3) & 15
        m = byte & 7
        v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True))
        v = tl.where((byte & 0x7F) == 0x7F, float("nan"), tl.where((byte & 0x80) != 0, -v, v))
    return v
