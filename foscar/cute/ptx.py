"""Inline PTX for the instructions the DSL does not reach (FP16 pairs, the barrier's reduction, byte permutes,
opaque moves): one helper that every block goes through, its constraints read off the operands' types."""
from __future__ import annotations

import struct

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

#: each DSL scalar type a block takes or returns: its LLVM type and its register constraint
_KINDS = {Uint32: (T.i32, "r"), Int32: (T.i32, "r"), Int64: (T.i64, "l"), Float32: (T.f32, "f")}


def f16_pair_word(x: float) -> int:
    """A constant 32-bit word of two FP16 halves, each ``x`` (which FP16 must hold exactly), as ``f16x2``
    instructions and a wgmma's A registers take it."""
    bits = struct.unpack("<H", struct.pack("<e", x))[0]
    assert struct.unpack("<e", struct.pack("<H", bits))[0] == x, x
    return bits * 0x00010001


def asm(result: type, args: list, body: str, *, side_effects: bool = False, memory: bool = False, loc=None,
        ip=None):
    """The value (of the DSL type ``result``) of the PTX ``body`` over ``args`` (DSL scalars, each of the type it
    is passed as: ``$0`` the result, ``$1``... the args), its registers scoped to the block. ``side_effects``: kept
    where it is and never merged with another (a barrier, a move the compilers must not rematerialize);
    ``memory``: orders memory too (a barrier that publishes stores)."""
    ir_type, out = _KINDS[result]
    constraints = "=" + out + "".join("," + _KINDS[type(a)][1] for a in args) + (",~{memory}" if memory else "")
    return result(llvm.inline_asm(ir_type(), [a.ir_value(loc=loc, ip=ip) for a in args], "{\n\t" + body + "\n\t}",
                                  constraints, has_side_effects=side_effects or memory, is_align_stack=False,
                                  asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def f16_pair(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """``lo`` and ``hi`` rounded to FP16 (to nearest), the low and high halves of one word (``cvt.rn.f16x2.f32``)."""
    return asm(Uint32, [Float32(lo), Float32(hi)], "cvt.rn.f16x2.f32 $0, $2, $1;", loc=loc, ip=ip)


@dsl_user_op
def mul_f16_pairs(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """The halves of ``a`` times those of ``b``, FP16 pairs, rounded to nearest (``mul.rn.f16x2``)."""
    return asm(Uint32, [Uint32(a), Uint32(b)], "mul.rn.f16x2 $0, $1, $2;", loc=loc, ip=ip)


@dsl_user_op
def e4m3_word(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """The FP16 pairs ``a`` and ``b`` as four E4M3 bytes (``a``'s halves the low two), rounded to nearest and
    saturated (``cvt.rn.satfinite.e4m3x2.f16x2``)."""
    return asm(Uint32, [a, b], ".reg .b16 l, h;\n\tcvt.rn.satfinite.e4m3x2.f16x2 l, $1;\n\t"
               "cvt.rn.satfinite.e4m3x2.f16x2 h, $2;\n\tmov.b32 $0, {l, h};", loc=loc, ip=ip)


@dsl_user_op
def e4m3_half(w: Uint32, half: int, *, loc=None, ip=None) -> Uint32:
    """Bytes ``2 half`` and ``2 half + 1`` of ``w`` (E4M3) as an FP16 pair, exactly (``cvt.rn.f16x2.e4m3x2``)."""
    pick = "l" if half == 0 else "h"
    return asm(Uint32, [w], f".reg .b16 l, h;\n\tmov.b32 {{l, h}}, $1;\n\tcvt.rn.f16x2.e4m3x2 $0, {pick};",
               loc=loc, ip=ip)


@dsl_user_op
def residual16(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """``(a - b) 16`` of FP16 pairs (``sub.rn.f16x2``, ``mul.rn.f16x2``)."""
    return asm(Uint32, [a, b], ".reg .b32 t, s;\n\tsub.rn.f16x2 t, $1, $2;\n\tmov.b32 s, 0x4C004C00;\n\t"
               "mul.rn.f16x2 $0, t, s;", loc=loc, ip=ip)


@dsl_user_op
def fma_f16_pairs(a: Uint32, b: Uint32, c: Uint32, *, loc=None, ip=None) -> Uint32:
    """``a b + c`` of FP16 pairs, rounded once (``fma.rn.f16x2``)."""
    return asm(Uint32, [a, b, c], "fma.rn.f16x2 $0, $1, $2, $3;", loc=loc, ip=ip)


@dsl_user_op
def f16_half(w: Uint32, half: int, *, loc=None, ip=None) -> Float32:
    """Half ``half`` of the FP16 pair ``w`` as FP32 (exact)."""
    pick = "l" if half == 0 else "h"
    return asm(Float32, [w], f".reg .b16 l, h;\n\tmov.b32 {{l, h}}, $1;\n\tcvt.f32.f16 $0, {pick};", loc=loc, ip=ip)
