"""The FP4 block formats' operands in the Hopper decode kernels (NVFP4 and MXFP4, ``Sm90Config.fp4_block``): FP16 A
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

**MXFP4** (``Sm90Config.fp4_mx``): an E8M0 scale ``2^(e - 127)`` spans more than FP16 holds, so each token's
block scales are taken relative to its largest, ``2^(E - 127)`` (:func:`mx_token_max`): a code's operand is
``v 2^-14`` times the FP16 ``2^(15 - (E - e))`` (:func:`mx_scale_bits`, the same ``mul.rn.f16x2``), i.e.
``v 2^(1 - E + e)``, exact while ``E - e <= 24`` (below, the FP16 product rounds; from 30 on it is 0: values
``2^-24`` of the token's largest block or less), at most 12. The token's ``2^(E - 128)`` is its row's ``s'``
(:func:`mx_row_scale`; NaN for the NaN byte 255, 0 where every block is ``2^-127``), carried by the token-wise
folds as a per-row ``s'``: K's acc-fold scales the scores, V's operand-fold puts it on ``P'`` under the
running power-of-two units ``sigma``. K's registers are built by the thread that owns the row; V^T's
registers hold other threads' rows, so the scale bits of every (token, block) of the tile are published in
shared memory first (:func:`publish_v_scale_bits`, two buffers by tile parity) and read as FP16 pairs, one
32-bit load a register pair (:func:`build_vt_registers_mx`).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from .config import THREADS, TILE
from .fragment import k_register_source, v_register_source
from .operands_e4m3 import row_scales
from .ptx import asm

#: the E2M1 codes of a register placed under FP16 (both halves): the magnitude at bits 9-11, the sign at bit 15
_PLACED = 0x8E008E00
#: lop3 LUT of ``(a & c) | (b & ~c)``
_SELECT = 0xE4


@dsl_user_op
def scale_pair(a: Int32, b: Int32, selector: Int32, *, loc=None, ip=None) -> Uint32:
    """The FP16 pair ``(s_lo, s_hi)`` of the E4M3 bytes that ``prmt(a, b, selector)`` puts in bytes 0 and 1
    (``s_lo`` from byte 0; the NaN byte a NaN)."""
    return asm(Uint32, [Int32(x) for x in (a, b, selector)],
               ".reg .b32 t;\n\t.reg .b16 h;\n\tprmt.b32 t, $1, $2, $3;\n\tcvt.u16.u32 h, t;\n\t"
               "cvt.rn.f16x2.e4m3x2 $0, h;", loc=loc, ip=ip)


@dsl_user_op
def gathered_codes(w: Uint32, *, loc=None, ip=None) -> tuple[Uint32, Uint32]:
    """A word's eight E2M1 codes gathered two registers at a time: ``(y08, y412)``, the codes of fields 0 and 8
    (``y08``), 4 and 12 (``y412``) of both 16-bit halves with each code's magnitude at bits ``1-3`` (fields 0, 4)
    or ``9-11`` (8, 12) of its half and its sign 6 bits above (:func:`place_scaled` takes them from there):
    ``lop3(w << 1, w << 4, 0x0E0E0E0E)`` and ``lop3(w >> 3, w, 0x0E0E0E0E)``, other bits don't-cares."""
    w = Uint32(w)
    return (asm(Uint32, [w], ".reg .b32 a, b;\n\tshl.b32 a, $1, 1;\n\tshl.b32 b, $1, 4;\n\t"
                f"lop3.b32 $0, a, b, 0x0E0E0E0E, {_SELECT};", loc=loc, ip=ip),
            asm(Uint32, [w], f".reg .b32 a;\n\tshr.b32 a, $1, 3;\n\tlop3.b32 $0, a, $1, 0x0E0E0E0E, {_SELECT};",
                loc=loc, ip=ip))


@dsl_user_op
def place_scaled(y: Uint32, low: bool, pair: Uint32, *, loc=None, ip=None) -> Uint32:
    """The FP16 pair ``v s 2^-14`` of the codes gathered in ``y`` (:func:`gathered_codes`; ``low``: the codes
    at bits 1-3, fields 0 and 4) times the scale pair ``pair`` (:func:`scale_pair`): exact, as FP16
    subnormals where small (the product's lowest bit is at least ``2^-10 x 2^-14``, FP16's subnormal spacing)."""
    shift = "shl.b32 t, $1, 8;\n\t" if low else "mov.b32 t, $1;\n\t"
    return asm(Uint32, [Uint32(y), Uint32(pair)],
               ".reg .b32 t;\n\t" + shift + f"and.b32 t, t, {_PLACED};\n\tmul.rn.f16x2 $0, t, $2;", loc=loc, ip=ip)


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


# ------------------------------------------------------------------------------------------------
# MXFP4: E8M0 block scales relative to each token's largest
# ------------------------------------------------------------------------------------------------
#: the FP16 exponent field of the operand scale of a token's largest block (``2^15``)
MX_TOP = 30
#: ``prmt`` selectors taking bytes (0, 2) and (1, 3) of a word into the low bytes of its 16-bit halves
MX_PAIRS = (0x4240, 0x4341)


def _asm(args, body: str, loc=None, ip=None) -> Uint32:
    """One 32-bit result of the PTX ``body`` over 32-bit ``args`` (``$0`` the result, ``$1``... the args)."""
    return asm(Uint32, [Uint32(a) for a in args], body, loc=loc, ip=ip)


@dsl_user_op
def mx_token_max(w: Uint32, *, loc=None, ip=None) -> Uint32:
    """The largest of the four E8M0 bytes of ``w`` (a token's block scales, unused bytes 0): two ``prmt``, two
    ``max.u16x2``."""
    return _asm([w], ".reg .b32 a, b, c, d, z;\n\tmov.b32 z, 0;\n\t"
                f"prmt.b32 a, $1, z, {MX_PAIRS[0]};\n\tprmt.b32 b, $1, z, {MX_PAIRS[1]};\n\t"
                "max.u16x2 c, a, b;\n\tshr.b32 d, c, 16;\n\tmax.u16x2 c, c, d;\n\tand.b32 $0, c, 0xFF;",
                loc, ip)


@dsl_user_op
def mx_scale_bits(w: Uint32, top: Uint32, which: int, *, loc=None, ip=None) -> Uint32:
    """The FP16 operand scales ``2^(15 - (E - e))`` of two blocks of a token (``which`` 0: blocks 0 and 2 in the
    low and high half; 1: blocks 1 and 3) from its E8M0 bytes ``w`` and ``top = E`` (:func:`mx_token_max`):
    ``max(e + 30 - E, 0) << 10`` per half (0 where ``E - e >= 30``)."""
    return _asm([w, top], ".reg .b32 a, c, z;\n\tmov.b32 z, 0;\n\t"
                f"prmt.b32 a, $1, z, {MX_PAIRS[which]};\n\tsub.s32 c, {MX_TOP}, $2;\n\t"
                "prmt.b32 c, c, c, 0x1010;\n\tadd.s16x2 a, a, c;\n\t"
                "max.s16x2 a, a, z;\n\tshl.b32 $0, a, 10;", loc, ip)


@dsl_user_op
def mx_row_scale(top: Uint32, *, loc=None, ip=None) -> Float32:
    """A token row's ``s' = 2^(E - 128)`` (``top = E``; E8M0 byte 255: NaN; 0: 0)."""
    bits = _asm([top], ".reg .b32 t;\n\t.reg .f32 f;\n\t.reg .pred p;\n\tshl.b32 t, $1, 23;\n\t"
                "mov.b32 f, t;\n\tmul.rn.f32 f, f, 0f3F000000;\n\tmov.b32 t, f;\n\t"
                "setp.eq.u32 p, $1, 255;\n\tselp.b32 $0, 0x7FC00000, t, p;", loc, ip)
    return bits.bitcast(Float32)


@dsl_user_op
def dup_half(x: Uint32, high: bool, *, loc=None, ip=None) -> Uint32:
    """The low (or ``high``) 16-bit half of ``x`` in both halves."""
    return _asm([x], f"prmt.b32 $0, $1, $1, {0x3232 if high else 0x1010};", loc, ip)


def token_scales(cfg, s: cute.Tensor, t):
    """Token ``t``'s block-scale bytes of a stage (``s``: its Int32 words) as one word, unused bytes 0."""
    if cutlass.const_expr(cfg.fp4_blocks == 4):
        return Uint32(s[t])
    return (Uint32(s[t >> 1]) >> ((t & 1) << 4)) & Uint32(0xFFFF)  # two blocks: half a word a token


@cute.jit
def build_k_registers_mx(cfg, regs: cute.Tensor, kw: cute.Tensor, sK: cute.Tensor, row0):
    """MXFP4: K's FP16 A registers, as :func:`build_k_registers_fp4`'s with each block's scale relative to its
    token's largest (:func:`mx_scale_bits`, the same for both halves of a register)."""
    bits = []
    for h in cutlass.range_constexpr(2):
        w = token_scales(cfg, sK, row0 + 8 * h)
        top = mx_token_max(w)
        bits.append([mx_scale_bits(w, top, j) for j in range(2)])
    pairs, gathered = {}, {}
    for r in cutlass.range_constexpr(cute.size(regs)):
        h = r % 2
        blk = (r // 4) // 2
        if cutlass.const_expr((h, blk) not in pairs):
            pairs[(h, blk)] = dup_half(bits[h][blk % 2], blk >= 2)
        i, field = k_register_source(4, r)
        regs[r] = placed(gathered, i, kw[i], field, pairs[(h, blk)])


@cute.jit
def mx_row_params(cfg, par: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, row0):
    """MXFP4: the ``s'`` of this thread's two token rows (``row0``, ``row0 + 8`` of the stage's words ``sK``,
    ``sV``) into ``par`` (K's at 0 and 2, V's at ``k_par_words`` and 2 past; no offsets)."""
    for h in cutlass.range_constexpr(2):
        for o, s in ((0, sK), (cfg.k_par_words, sV)):
            par[o + 2 * h] = mx_row_scale(mx_token_max(token_scales(cfg, s, row0 + 8 * h)))
            par[o + 2 * h + 1] = Float32(0.0)


def mx_views(sMx: cute.Tensor):
    """The V scale bits' buffers ``sMx`` (Int32 words) as ``(Uint16 slots, Int32 words)``."""
    bits16 = cute.make_tensor(cute.recast_ptr(sMx.iterator, dtype=cutlass.Uint16), cute.make_layout(2 * cute.size(sMx)))
    return bits16, sMx


def mx_bits_index(cfg, buf, blk, t):
    """The 16-bit slot of token ``t`` (of the pass), block ``blk``, in buffer ``buf`` of the V scale bits."""
    return (buf * cfg.fp4_blocks + blk) * (TILE * cfg.tiles_per_pass) + t


@cute.jit
def publish_v_scale_bits(cfg, bits16: cute.Tensor, sV: cute.Tensor, sV_b: cute.Tensor, buf, tidx):
    """MXFP4: the FP16 operand scales of every (token, block) of the pass's V (``sV``: its stage's words; two
    tiles a pass: ``sV_b`` the second tile's, tokens from 64) into buffer ``buf`` of ``bits16`` (Uint16,
    :func:`mx_bits_index`). One tile: thread ``tidx`` takes token ``tidx % 64`` and blocks ``p``, ``p + 2``
    (``p = tidx // 64``); two: token ``tidx``, every block. Published by the barrier before the PV product."""
    nb = cfg.fp4_blocks
    if cutlass.const_expr(cfg.tiles_per_pass == 2):
        w = Uint32(0)
        if tidx < TILE:
            w = token_scales(cfg, sV, tidx)
        else:
            w = token_scales(cfg, sV_b, tidx - TILE)
        top = mx_token_max(w)
        for j in cutlass.range_constexpr(2):
            b = mx_scale_bits(w, top, j)
            bits16[mx_bits_index(cfg, buf, j, tidx)] = (b & Uint32(0xFFFF)).to(cutlass.Uint16)
            if cutlass.const_expr(nb == 4):
                bits16[mx_bits_index(cfg, buf, j + 2, tidx)] = (b >> 16).to(cutlass.Uint16)
    else:
        t = tidx % TILE
        p = tidx // TILE
        w = token_scales(cfg, sV, t)
        top = mx_token_max(w)
        b = mx_scale_bits(w, top, 0)
        if p == 1:
            b = mx_scale_bits(w, top, 1)
        bits16[mx_bits_index(cfg, buf, p, t)] = (b & Uint32(0xFFFF)).to(cutlass.Uint16)
        if cutlass.const_expr(nb == 4):
            bits16[mx_bits_index(cfg, buf, p + 2, t)] = (b >> 16).to(cutlass.Uint16)


@cute.jit
def build_vt_registers_mx(cfg, regs: cute.Tensor, vw: cute.Tensor, bits32: cute.Tensor, thr, buf, tok0):
    """MXFP4: V^T's FP16 A registers of the pass's tokens from ``tok0`` (0, or 64 for a pass's second tile), as
    :func:`build_vt_registers_fp4`'s, each register's scale pair one 32-bit load of the published bits
    (``bits32``: the Int32 view of :func:`publish_v_scale_bits`'s buffer; channel rows of m64 block ``mh`` in
    warp ``warp``'s 16 are block ``2 mh + warp // 2``). Tokens past the sequence need no mask: their scales are
    finite (at most ``2^15``) and their ``P'`` zero."""
    halves = cfg.mh
    pairs, gathered = {}, {}
    for r in cutlass.range_constexpr(cute.size(regs)):
        vb, mh, field = v_register_source(4, cfg.head_dim, r)
        kb = (r // 4) // halves
        th = (r % 4) // 2
        key = (mh, kb, th)
        if cutlass.const_expr(key not in pairs):
            t = tok0 + 16 * kb + 2 * thr.quad + 8 * th
            pairs[key] = Uint32(bits32[mx_bits_index(cfg, buf, 2 * mh + thr.warp // 2, t) >> 1])
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
