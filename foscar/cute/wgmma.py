"""The register-A wgmma issued by the kernel's own PTX, with B descriptors formed once (``Sm90Config.own_wgmma``,
:data:`~foscar.cute.config.OWN_WGMMA_BITS`: two-tile passes, and 32-column steps on three consumers).

CuTe DSL forms a wgmma's shared-memory B descriptor at each use from the shared-memory base (which reaches the
kernel through a warp shuffle, so ptxas cannot fold it), and where registers are short ptxas rebuilds every one of
them every pass: about 50 uniform instructions a pass of two tiles at two CTAs an SM. Here the first descriptors of
Q^T and of the consumer's P' are formed once, before the tile loop (:func:`pass_descriptors`), each through a PTX
move that neither LLVM nor ptxas sinks back into the loop (:func:`opaque`), so that they stay in uniform registers,
and each k-step's is one 64-bit add; each MMA is one ``wgmma.mma_async`` with A from registers (:func:`mma_rs`),
with the same A registers and accumulators, in the same order, as the tiled MMAs of
:func:`foscar.cute.operands.mmas_and_layouts` (``tests/test_cute_wgmma.py``).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .ptx import asm

#: Descriptor bits (layout type at 62-63, stride byte offset at 32-45, leading byte offset at 16-29, in 16-byte
#: units) as CuTe DSL forms them: Q^T (K-major, 128-byte swizzle; beyond 8 columns its 8-row groups 1024 bytes
#: apart), P' K-major (one 8-row group) and P' MN-major as 32 columns lay it out (64-byte swizzle, 512 bytes between
#: groups; 8 and 16 columns' MN-major atoms differ: their passes take the tiled MMA, ``config_for``)
Q_BITS = {False: (1 << 62) | (1 << 16), True: (1 << 62) | (64 << 32) | (1 << 16)}
P_BITS = {False: (1 << 62) | (1 << 16), True: (2 << 62) | (32 << 32)}
K_STEP = 2  #: a K-major B's start address (16-byte units) advanced by a k-step: 32 bytes of a row
Q_ATOM = 256  #: Q^T's next 128 contraction bytes (stacked terms): the next swizzle atom of 32 rows
#: P''s k16 step: 32 bytes of K-major rows, 16 tokens of MN-major columns (1024 bytes); and tile B's 64 tokens on
P_STEP = {False: 2, True: 64}
TILE_B = 64


@cute.jit
def descriptor(ptr: cute.Pointer, bits: cutlass.Constexpr) -> Int64:
    """The B descriptor of a 1024-byte-aligned buffer at ``ptr`` (``bits``: :data:`Q_BITS`, :data:`P_BITS`), through
    :func:`opaque`."""
    field = (Uint32(ptr.toint()) >> 4) & 0x3FC0
    return opaque(Int64(field) + bits)


@dsl_user_op
def opaque(x, *, loc=None, ip=None):
    """``x`` (an ``Int64`` or a ``Uint32``) through a PTX move the compilers neither sink into a loop nor
    rematerialize there."""
    kind, width = (Int64, 64) if isinstance(x, Int64) else (Uint32, 32)
    return asm(kind, [kind(x)], f"mov.b{width} $0, $1;", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def mma_rs(shape: str, acc: list, a: list, desc: Int64, accumulate: bool, trans_b: bool = False, *, loc=None,
           ip=None) -> list:
    """``acc (+)= A B``: one ``wgmma.mma_async.sync.aligned.<shape>`` (``m64nNk16.f32.f16.f16`` or
    ``m64nNk32.f32.e4m3.e4m3``), A's four registers ``a``, B by ``desc`` (``trans_b``: MN-major, FP16 only), ``N / 2``
    accumulators ``acc``; ``accumulate`` False overwrites them. Returns the accumulators (written asynchronously:
    read them after the group's wait)."""
    n = len(acc)
    d = ", ".join(f"${i}" for i in range(n))
    a_regs = ", ".join(f"${n + n + i}" for i in range(4))
    tail = f", {int(trans_b)}" if "f16" in shape else ""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * n),
        [Float32(x).ir_value(loc=loc, ip=ip) for x in acc] + [Uint32(x).ir_value(loc=loc, ip=ip) for x in a]
        + [Int64(desc).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p;\nsetp.ne.b32 p, %d, 0;\n" % int(accumulate)
        + f"wgmma.mma_async.sync.aligned.{shape} {{{d}}}, {{{a_regs}}}, ${2 * n + 4}, p, 1, 1{tail};\n}}",
        ",".join(["=f"] * n + [str(i) for i in range(n)] + ["r"] * 4 + ["l"]),
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n)]


@cute.jit
def mma_rs_into(kind: str, acc: cute.Tensor, a: cute.Tensor, desc: Int64, accumulate, trans_b: bool = False):
    """:func:`mma_rs` of shape ``m64nN<kind>`` (``N`` twice ``acc``'s elements) on the accumulators ``acc`` (a C
    fragment or a view of one m64 block of it), A's four registers ``a`` (32-bit), written back into ``acc``."""
    n = cute.size(acc)
    d = mma_rs(f"m64n{2 * n}{kind}", [acc[i] for i in range(n)], [a[i] for i in range(4)], desc, accumulate, trans_b)
    for i in cutlass.range_constexpr(n):
        acc[i] = d[i]


@cute.jit
def pass_descriptors(cfg, smem):
    """``(q, p)``: the first B descriptors of Q^T and of the consumer's P', formed once (:func:`descriptor`; the
    others one 64-bit add each in the loop: :func:`qk_mma`, :func:`pv_mma`); None without ``cfg.own_wgmma``. Two
    kept across the loop where more displace a register into local memory (two-tile passes at two CTAs an SM: INT2
    180.1 instructions a tile, no spill; Q's four kept, 174.9 and two reloads a pass)."""
    if cutlass.const_expr(not cfg.own_wgmma):
        return None
    q = smem.sQk if cutlass.const_expr(cfg.k_channel) else smem.sQ  # channel-wise K: Q''s first buffer
    return (descriptor(q.iterator, Q_BITS[cfg.cols > 8]),
            descriptor(smem.sP[0].iterator, P_BITS[cfg.p_column_major]))


@cute.jit
def qk_mma(wg, mma, acc: cute.Tensor, tSrK: cute.Tensor, tSrK_u32: cute.Tensor, ka, q_frag, kb, q_units=None):
    """One k-step of ``S^T = K Q^T`` into ``acc`` (K's k-block ``ka``, Q's ``kb``; channel-wise K: ``Q'``'s buffer
    ``q_units`` 16-byte units past the first): by :func:`mma_rs` where the warpgroup holds the descriptors
    (``wg.descs``), else by the tiled MMA ``mma``; ``mma`` the warpgroup's zeroing one (``wg.qk_mma0``), the
    accumulator's first MMA, which overwrites it."""
    if cutlass.const_expr(wg.descs is not None):
        desc = wg.descs[0] + (K_STEP * (kb % 4) + Q_ATOM * (kb // 4))
        if cutlass.const_expr(q_units is not None):
            desc = desc + Int64(q_units)
        mma_rs_into("k32.f32.e4m3.e4m3", acc, tSrK_u32[None, None, ka], desc, mma is not wg.qk_mma0)
    else:
        cute.gemm(mma, acc, tSrK[None, None, ka], q_frag, acc)


def p_descriptor(cfg, wg, kb, kb0) -> Int64:
    """The B descriptor of ``P'``'s k16 step ``kb0 + kb`` (``kb0`` 0 or 4: tile A's or B's tokens) from the
    warpgroup's first (:func:`pass_descriptors`)."""
    return wg.descs[1] + (P_STEP[cfg.p_column_major] * kb + (kb0 // 4) * TILE_B)


@cute.jit
def pv_mma(cfg, wg, accO: cute.Tensor, tOrV: cute.Tensor, tOrP: cute.Tensor, kb, kb0,
           overwrite: cutlass.Constexpr = False):
    """One k16 step of ``O^T += V^T P'^T`` (V^T's k-block ``kb``, P''s ``kb0 + kb``; ``kb0`` 0 or 4, tile A's or
    B's tokens): each m64 block by :func:`mma_rs` where the warpgroup holds the descriptors (``cfg.p_column_major``:
    P' MN-major), else by its tiled MMA (``overwrite``: ``O^T = V^T P'^T``, the accumulator's first step: either
    way nothing is read from it)."""
    if cutlass.const_expr(wg.descs is not None):
        desc = p_descriptor(cfg, wg, kb, kb0)
        for mh in cutlass.range_constexpr(cute.size(tOrV, mode=[1])):
            mma_rs_into("k16.f32.f16.f16", accO[None, mh, None], wg.frags.tOrV_u32[None, mh, kb], desc, not overwrite,
                        cfg.p_column_major)
    else:
        tiled_pv_mma(cfg, wg, accO, tOrV[None, None, kb], tOrP[None, None, kb0 + kb], overwrite)


@cute.jit
def tiled_pv_mma(cfg, wg, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, overwrite: cutlass.Constexpr = False):
    """``acc (+)= a b`` by the O^T product's tiled MMA (``overwrite``: its zeroing one, an accumulator's first step)."""
    mma = wg.pv_mma
    if cutlass.const_expr(overwrite):
        from .operands import zeroing_mma
        mma = zeroing_mma(cfg, 1)
    cute.gemm(mma, acc, a, b, acc)
