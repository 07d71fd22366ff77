"""The register-A wgmma of two-tile passes issued by the kernel's own PTX, with B descriptors formed once
(``Sm90Config.own_wgmma``, :data:`~foscar.cute.config.OWN_WGMMA_BITS`).

CuTe DSL forms a wgmma's shared-memory B descriptor at each use from the shared-memory base (which reaches the
kernel through a warp shuffle, so ptxas cannot fold it), and at two CTAs an SM ptxas rebuilds all twelve of a pass
every pass: about 50 uniform instructions. Here the descriptors of Q's k-steps and of the consumer's P' k-steps are
formed once, before the tile loop (:func:`pass_descriptors`), each through a PTX move that neither LLVM nor ptxas
sinks back into the loop (:func:`opaque`), so that they stay in uniform registers; each MMA is one
``wgmma.mma_async`` with A from registers (:func:`mma_rs`), with the same A registers and accumulators, in the same
order, as the tiled MMAs of :func:`foscar.cute.operands.mmas_and_layouts` (``tests/test_cute_wgmma.py``).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

#: A 128-byte-swizzled, K-major B operand in one 8-row group: leading byte offset 1 (16 B), layout type 1 (bits 62-63)
SW128_K = (1 << 62) | (1 << 16)
#: The instruction of each operand kind, ``m64n8`` with FP32 accumulators.
SHAPES = {"f16": "m64n8k16.f32.f16.f16", "e4m3": "m64n8k32.f32.e4m3.e4m3"}
K_STEP = 2  #: a descriptor's start address (16-byte units) advanced by one k-step: 32 bytes of a K-major B row
TILE_B = 64  #: the same for P''s second tile: 64 FP16 tokens on, the next 1024-byte swizzle atom

@cute.jit
def descriptor(ptr: cute.Pointer, offset_units: cutlass.Constexpr = 0) -> Int64:
    """The B descriptor of a 1024-byte-aligned, 128-byte-swizzled K-major buffer at ``ptr``, advanced by
    ``offset_units`` 16-byte units along K (a k-step: 2; the next 64 FP16 tokens: 64)."""
    addr = ptr.toint()
    field = (Uint32(addr) >> 4) & 0x3FC0
    return opaque(Int64(field) + (SW128_K + offset_units))


@dsl_user_op
def opaque(x: Int64, *, loc=None, ip=None) -> Int64:
    """``x`` through a PTX move the compilers neither sink into a loop nor rematerialize there."""
    return Int64(llvm.inline_asm(T.i64(), [Int64(x).ir_value(loc=loc, ip=ip)], "mov.b64 $0, $1;", "=l,l",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))


@dsl_user_op
def mma_rs(kind: str, acc: list, a: list, desc: Int64, accumulate: bool, *, loc=None, ip=None) -> list:
    """``acc (+)= A B``: one ``wgmma.mma_async`` of ``kind`` (:data:`SHAPES`), A's four registers ``a``, B by
    ``desc``; ``accumulate`` False overwrites ``acc``. Returns the four accumulators (written asynchronously: read
    them after the group's wait)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        [Float32(x).ir_value(loc=loc, ip=ip) for x in acc] + [Uint32(x).ir_value(loc=loc, ip=ip) for x in a]
        + [Int64(desc).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p;\nsetp.ne.b32 p, %d, 0;\n" % int(accumulate)
        + f"wgmma.mma_async.sync.aligned.{SHAPES[kind]} {{$0, $1, $2, $3}}, {{$8, $9, $10, $11}}, $12, p, 1, 1"
        + (", 0;\n}" if kind == "f16" else ";\n}"),
        "=f,=f,=f,=f,0,1,2,3,r,r,r,r,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@cute.jit
def pass_descriptors(cfg, smem):
    """``(q, p)``: the B descriptors of Q's k-steps and the first of the consumer's P', formed once
    (:func:`descriptor`); P''s other k-steps (tile B's from :data:`TILE_B` on) one 64-bit add each in the loop; None
    without ``cfg.own_wgmma``. Two descriptors kept across the loop where four or more displace a register into
    local memory (two CTAs an SM: INT2 180.1 instructions a tile, no spill; Q's four kept, 174.9 and two reloads a
    pass)."""
    if cutlass.const_expr(not cfg.own_wgmma):
        return None
    n_q = cfg.head_dim // 32  # E4M3 K: k32 steps over the head dim
    q0 = descriptor(smem.sQ.iterator)
    q = [q0 + K_STEP * k for k in range(n_q)]
    return q, [descriptor(smem.sP[0].iterator)]


@cute.jit
def qk_mma(wg, mma, acc: cute.Tensor, tSrK: cute.Tensor, tSrK_u32: cute.Tensor, ka, q_frag, kb, first):
    """One k-step of ``S^T = K Q^T`` into ``acc`` (K's k-block ``ka``, Q's ``kb``; ``first``: overwrite ``acc``):
    by :func:`mma_rs` where the warpgroup holds the descriptors (``wg.descs``), else by the tiled MMA ``mma``."""
    if cutlass.const_expr(wg.descs is not None):
        a = tSrK_u32[None, None, ka]
        d = mma_rs("e4m3", [acc[i] for i in range(4)], [a[i] for i in range(4)], wg.descs[0][kb], not first)
        for i in cutlass.range_constexpr(4):
            acc[i] = d[i]
    else:
        cute.gemm(mma, acc, tSrK[None, None, ka], q_frag, acc)


@cute.jit
def pv_mma(wg, accO: cute.Tensor, tOrV: cute.Tensor, tOrP: cute.Tensor, kb, kb0):
    """One k16 step of ``O^T += V^T P'^T`` (V^T's k-block ``kb``, P''s ``kb0 + kb``; ``kb0`` 0 or 4, tile A's or
    B's tokens): both m64 blocks by :func:`mma_rs` where the warpgroup holds the descriptors, else by its tiled MMA."""
    if cutlass.const_expr(wg.descs is not None):
        tOrV_u32 = wg.frags.tOrV_u32
        for mh in cutlass.range_constexpr(cute.size(tOrV, mode=[1])):
            a = tOrV_u32[None, mh, kb]
            c = accO[None, mh, None]
            d = mma_rs("f16", [c[i] for i in range(4)], [a[i] for i in range(4)],
                       wg.descs[1][0] + (K_STEP * kb + (kb0 // 4) * TILE_B), True)
            for i in cutlass.range_constexpr(4):
                c[i] = d[i]
    else:
        cute.gemm(wg.pv_mma, accO, tOrV[None, None, kb], tOrP[None, None, kb0 + kb], accO)
