"""Inline PTX for the instructions the DSL does not reach (FP16 pairs, the barrier's reduction, byte permutes,
opaque moves): one helper that every block goes through, its constraints read off the operands' types."""
from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

#: each DSL scalar type a block takes or returns: its LLVM type and its register constraint
_KINDS = {Uint32: (T.i32, "r"), Int32: (T.i32, "r"), Int64: (T.i64, "l"), Float32: (T.f32, "f")}


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
