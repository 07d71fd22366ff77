"""The FP4 block formats' operands in the Hopper decode kernels (NVFP4, ``Sm90Config.fp4_block``): FP16 A
registers built from the E2M1 codes in the INT4 words (``docs/layout.md``) and multiplied by their block
scales, and the query as an FP16 B operand.

- **Placement** (:func:`gathered_codes`, :func:`place_scaled`): a register's two codes (the same field of both
  16-bit halves of a word, :func:`foscar.cute.fragment.k_register_source` /
  :func:`~foscar.cute.fragment.v_register_source`) get their exponent and mantissa bits under FP16's exponent
  (bits 9-11) and their sign at bit 15: the FP16 value ``v 2^-14`` of every code (0 and 0.5 FP16 subnormals,
  exact). The codes of two fields are gathered at once (a shift pair and a ``lop3`` select for fields 0 and 8,
  one shift and a select for 4 and 12), then each register takes a mask (and a shift for fields 0 and 4):
  about 2.75 instructions a register; then one ``mul.rn.f16x2`` by its pair of block scales.
- **Scale pairs** (:func:`scale_pair`): two E4M3 block-scale bytes (one ``prmt``) converted to FP16 by
  ``cvt.rn.f16x2.e4m3x2`` (exact; the NaN byte a NaN). An operand is ``v s 2^-14``, exact for every code and
  scale, FP16 subnormals included (:data:`~foscar.cute.config_fp4.FP4_UNIT_SHIFT`). A K register's two codes
  are two channels of one token, one block: the pair ``(s, s)``; a V^T register's are one channel of two
  tokens: the pair of their scales of the channel's block.
- The query (:func:`load_q_f16`): FP16, each row times the power of two of :func:`row_scales` (its largest
  ``|q|`` to at most 448), the ``2^-e`` in ``sQinv`` for the scores.

The factor ``T 2^14`` (``T`` the tensor's scale) is the ``s'`` of every token row (no offset), so the
token-wise folds of the affine kernels carry it: K's acc-fold multiplies the scores by it, V's operand-fold
puts it on ``P'`` (:func:`foscar.cute.folds.k_acc_fold`, :func:`foscar.cute.folds.v_operand_fold`).
The block-scale bytes of a tile are read from its stage in shared memory while the operands are built; the
consumer frees the stage after V^T's registers (:meth:`foscar.cute.kernel_v1.FoldDecodeSm90WS._consume_tile`).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .config import THREADS, TILE
from .fragment import k_register_source, v_register_source
from .operands_e4m3 import row_scales

#: the E2M1 codes of a register placed under FP16 (both halves): the magnitude at bits 9-11, the sign at bit 15
_PLACED = 0x8E008E00
#: lop3 LUT of ``(a & c) | (b & ~c)``
_SELECT = 0xE4


@dsl_user_op
def scale_pair(a: Int32, b: Int32, selector: Int32, *, loc=None, ip=None) -> Uint32:
    """The FP16 pair ``(s_lo, s_hi)`` of the E4M3 bytes that ``prmt(a, b, selector)`` puts in bytes 0 and 1
    (``s_lo`` from byte 0; the NaN byte a NaN)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Int32(x).ir_value(loc=loc, ip=ip) for x in (a, b, selector)],
        "{\n\t.reg .b32 t;\n\t.reg .b16 h;\n\tprmt.b32 t, $1, $2, $3;\n\tcvt.u16.u32 h, t;\n\t"
        "cvt.rn.f16x2.e4m3x2 $0, h;\n\t}",
        "=r,r,r,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def gathered_codes(w: Uint32, *, loc=None, ip=None) -> tuple[Uint32, Uint32]:
    """A word's eight E2M1 codes gathered two registers at a time: ``(y08, y412)``, the codes of fields 0 and 8
    (``y08``), 4 and 12 (``y412``) of both 16-bit halves with each code's magnitude at bits ``1-3`` (fields 0, 4)
    or ``9-11`` (8, 12) of its half and its sign 6 bits above (:func:`place_scaled` takes them from there):
    ``lop3(w << 1, w << 4, 0x0E0E0E0E)`` and ``lop3(w >> 3, w, 0x0E0E0E0E)``, other bits don't-cares."""
    wv = Uint32(w).ir_value(loc=loc, ip=ip)
    out = []
    for asm in ("{\n\t.reg .b32 a, b;\n\tshl.b32 a, $1, 1;\n\tshl.b32 b, $1, 4;\n\t"
                f"lop3.b32 $0, a, b, 0x0E0E0E0E, {_SELECT};\n\t}}",
                "{\n\t.reg .b32 a;\n\tshr.b32 a, $1, 3;\n\t"
                f"lop3.b32 $0, a, $1, 0x0E0E0E0E, {_SELECT};\n\t}}"):
        out.append(Uint32(llvm.inline_asm(T.i32(), [wv], asm, "=r,r", has_side_effects=False, is_align_stack=False,
                                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)))
    return out[0], out[1]


@dsl_user_op
def place_scaled(y: Uint32, low: bool, pair: Uint32, *, loc=None, ip=None) -> Uint32:
    """The FP16 pair ``v s 2^-14`` of the codes gathered in ``y`` (:func:`gathered_codes`; ``low``: the codes
    at bits 1-3, fields 0 and 4) times the scale pair ``pair`` (:func:`scale_pair`): exact, as FP16
    subnormals where small (the product's lowest bit is at least ``2^-10 x 2^-14``, FP16's subnormal spacing)."""
    shift = "shl.b32 t, $1, 8;\n\t" if low else "mov.b32 t, $1;\n\t"
    return Uint32(llvm.inline_asm(
        T.i32(), [Uint32(y).ir_value(loc=loc, ip=ip), Uint32(pair).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .b32 t;\n\t" + shift + f"and.b32 t, t, {_PLACED};\n\tmul.rn.f16x2 $0, t, $2;\n\t}}",
        "=r,r,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


def placed(gathered: dict, key, w, field: int, pair: Uint32) -> Uint32:
    """:func:`place_scaled` of the codes at ``field`` of word ``w`` (``gathered``: the words' gathered codes by
    ``key``, filled on first use)."""
    if key not in gathered:
        gathered[key] = gathered_codes(Uint32(w))
    y08, y412 = gathered[key]
    return place_scaled(y08 if field in (0, 8) else y412, field in (0, 4), pair)


def dup_selector(byte: int) -> int:
    """The ``prmt`` selector putting byte ``byte`` of its first source in bytes 0 and 1."""
    return byte | byte << 4


@cute.jit
def build_k_registers_fp4(cfg, regs: cute.Tensor, kw: cute.Tensor, sK: cute.Tensor, row0):
    """K's FP16 A registers (``regs``: the Uint32 view of the S^T product's A fragment) from this thread's words
    (``kw``, as :func:`foscar.cute.operands.build_k_registers` reads them) and the tile's block-scale bytes
    ``sK`` (Int32 words of its stage: token ``t``'s ``fp4_blocks`` bytes from byte ``t fp4_blocks``). Register
    ``r``: k16 block ``r // 4`` (one NVFP4 block), token row ``row0 + 8 (r % 2)``."""
    nbw = cfg.fp4_blocks // 4  # words of a token's scale bytes
    words = [[sK[(row0 + 8 * h) * nbw + j] for j in range(nbw)] for h in range(2)]
    pairs, gathered = {}, {}
    for r in cutlass.range_constexpr(cute.size(regs)):
        h = r % 2
        blk = (r // 4) * 16 // cfg.fp4_block
        if cutlass.const_expr((h, blk) not in pairs):
            w = words[h][blk // 4]
            pairs[(h, blk)] = scale_pair(w, w, Int32(dup_selector(blk % 4)))
        i, field = k_register_source(4, r)
        regs[r] = placed(gathered, i, kw[i], field, pairs[(h, blk)])


@cute.jit
def build_vt_registers_fp4(cfg, regs: cute.Tensor, vw: cute.Tensor, sV: cute.Tensor, thr, valid_tokens):
    """V^T's FP16 A registers (``regs``: the Uint32 view of the O^T product's A fragment) from this thread's words
    (``vw[mh, vb]``, as :func:`foscar.cute.operands.build_vt_registers` reads them) and the tile's block-scale
    bytes ``sV`` (as :func:`build_k_registers_fp4`'s). Register ``r`` (fragment order ``((2, 2, 2), m64 blocks,
    k16 blocks)``): channel rows of m64 block ``mh`` in warp ``warp``'s 16 (one NVFP4 block, byte ``warp`` of
    each token's word ``mh``), tokens ``16 kb + 2 quad + 8 ((r % 4) // 2)`` and the next. Tokens at or past
    ``valid_tokens`` (the tile's tokens inside the sequence) get scale 0: whatever their bytes hold, NaN
    included, never reaches the product (a tile's last: a branch of its own, uniform over the warpgroup)."""
    if valid_tokens >= TILE:
        _vt_registers(cfg, regs, vw, sV, thr, None)
    else:
        _vt_registers(cfg, regs, vw, sV, thr, valid_tokens)


def _vt_registers(cfg, regs: cute.Tensor, vw: cute.Tensor, sV: cute.Tensor, thr, valid_tokens):
    """:func:`build_vt_registers_fp4`'s registers (traced twice: ``valid_tokens`` None for a whole tile)."""
    nbw = cfg.fp4_blocks // 4
    warp = thr.warp
    sel = warp | ((warp + 4) << 4)  # byte `warp` of the first token's word, then of the second's
    halves = cfg.mh
    pairs, gathered = {}, {}
    for r in range(cute.size(regs)):
        vb, mh, field = v_register_source(4, cfg.head_dim, r)
        kb = (r // 4) // halves
        th = (r % 4) // 2
        key = (mh, kb, th)
        if key not in pairs:
            t = 16 * kb + 2 * thr.quad + 8 * th
            wa = sV[t * nbw + mh]
            wb = sV[(t + 1) * nbw + mh]
            if valid_tokens is not None:
                wa = cutlass.select_(t < valid_tokens, wa, Int32(0))
                wb = cutlass.select_(t + 1 < valid_tokens, wb, Int32(0))
            pairs[key] = scale_pair(wa, wb, sel)
        regs[r] = placed(gathered, (mh, vb), vw[mh, vb], field, pairs[key])


@cute.jit
def load_q_f16(cfg, mQ: cute.Tensor, b, query_row, sQ: cute.Tensor, sQinv: cute.Tensor, sQred: cute.Tensor, tidx,
               bar_id: cutlass.Constexpr):
    """Q^T of the query rows (column ``c``: row ``query_row(c)`` of ``mQ``) into ``sQ`` as FP16, each row times its
    power of two ``2^e`` (:func:`~foscar.cute.operands_e4m3.row_scales`: its largest ``|q| 2^e`` at most 448),
    ``sQinv[c]`` its ``2^-e``; padded columns zero. By one warpgroup (named barrier ``bar_id``)."""
    D = cfg.head_dim
    row_scales(D, cfg.rows, cfg.cols, mQ, b, query_row, sQred, sQinv, tidx, bar_id)
    for h in cutlass.range_constexpr(cfg.cols):
        for d0 in cutlass.range_constexpr(D // THREADS if D >= THREADS else 1):
            d = d0 * THREADS + tidx
            if d < D:
                val = Float16(0.0)
                if cutlass.const_expr(h < cfg.rows):
                    val = (Float32(mQ[b, query_row(h), d]) * sQred[0, h]).to(Float16)
                sQ[h, d] = val
