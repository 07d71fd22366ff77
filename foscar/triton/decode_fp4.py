"""Triton split-KV decode of the FP4 block formats (NVFP4, MXFP4): stage 1.

The tiling is the affine kernel's (:mod:`foscar.triton.decode`): both products transposed, ``S^T = K Q^T``
and ``O^T = V^T P^T``, a KV tile's ``BLOCK_N`` tokens along M, the ``G`` query heads (times a step's
tokens) along N, the operands built in registers from the packed words (the E2M1 codes sit in the INT4
words, ``docs/layout.md``). A stored value is ``x = T v s`` (``v`` the E2M1 value, ``s`` its block's
scale, ``T`` the tensor's scale). Per tile:

- **The block scales in the operands** (:mod:`foscar.triton.tiles_fp4`): each E2M1 code placed under the FP16
  exponent and multiplied by its block's scale as an FP16 pair, one ``mul.f16x2`` a register. K: the scales
  over ``2^E_t``, a power of two at or above the token's block scales, which the token's scores take back
  (with ``T_K`` and the softmax scale: one multiply a score); V: over ``2^E_b``, at or above the tile's scales
  of channel block ``b``, which the product's rows of that block take back as they join the accumulator
  (``T_V`` on the output). An operand is ``2 v s / 2^E``, at most 12, exact down to ``s / 2^E = 2^-14``
  (below, rounded at FP16's subnormal spacing: ``2^-27`` of the largest operand of that token or block).
  K's acc-fold over block-local partials (:func:`foscar.fold_fp4.folded_fp4`, the CuTe plan's) costs more in
  Triton as first built (codes placed one by one, eight ``k16`` products a tile as a batched dot and their
  reduction): 1,325 SASS instructions a tile against 886 here (``benchmarks/sass_stats.py --scheme nvfp4``,
  ``docs/fp4-plan.md``).
- The query is an FP16 operand scaled per row by a power of two (``|Q| <= 2^8``), undone on the scores; P an
  FP16 operand (at most 1, under the running maximum); the softmax sums take the unrounded P.

No offsets: no offset correction. Under the interpreter the operands stay in float32 (the same
placement, read back exactly), so the kernel is held to the float32 bound of the fold. The partials,
the fused merge and the step rows (``STEP``, causal among a step's tokens) are the affine kernel's.
"""
import triton
import triton.language as tl

from .common import causal_softmax_step, dot, partial_result, split_of, split_range, step_seen
from .decode import finish_split
from .tiles import k_words, v_words
from .tiles_fp4 import block_scales, k_operand_fp4, v_operand_t_fp4


@triton.jit
def _pow2_bits(x):
    """The float32 bits of the power of two at or above ``x >= 0``, at least ``2^-100`` (so ``2^13`` over it stays
    finite; a NaN ``x`` gives ``2^-100``: its NaN reaches the operand through the scale itself). Integer ops only."""
    return tl.maximum((x.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000, 27 << 23)


@triton.jit
def _pow2(bits, SHIFT: tl.constexpr):
    """``2^SHIFT`` times the power of two whose float32 bits are ``bits`` (exact, integer ops)."""
    return (bits + (SHIFT << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_over(bits, SHIFT: tl.constexpr):
    """``2^SHIFT`` over the power of two whose float32 bits are ``bits`` (exact, integer ops)."""
    return (((127 + SHIFT) << 23) - (bits - (127 << 23))).to(tl.float32, bitcast=True)


@triton.jit
def _load_tile(KC, VC, KS, VS, page, kvh, tile, t_hi, n_quant, tt, cc,
               stride_cp, stride_ch, stride_kpp, stride_kph, stride_vpp, stride_vph,
               D: tl.constexpr, NB: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Issue the loads of KV tile ``tile`` (on ``page``): the K and V words and the block-scale bytes
    ``[NB, BLOCK_N]`` (0 for tokens past the sequence: their operands are 0, never NaN)."""
    ok = tile < t_hi
    t0 = tile * BLOCK_N
    off = t0 % PAGE
    WPT: tl.constexpr = D * 4 // 32  # words per token
    kw = k_words(KC + page * stride_cp + kvh * stride_ch + off * WPT, ok, BLOCK_N, D, 4, 1)
    vw = v_words(VC + page * stride_cp + kvh * stride_ch + off * WPT, ok, BLOCK_N, D, 4, 1)
    valid = (t0 + tt < n_quant) & ok
    o = (off + tt)[None, :] * NB + cc[:, None]
    kb = tl.load(KS + page * stride_kpp + kvh * stride_kph + (off + tt)[:, None] * NB + cc[None, :],
                 mask=valid[:, None], other=0)  # [BLOCK_N, NB]
    vb = tl.load(VS + page * stride_vpp + kvh * stride_vph + o, mask=valid[None, :], other=0)
    return kw, vw, kb, vb


@triton.jit
def fp4_decode_stage1(
    Q, KC, VC, KS, VS, BT, SEQ, TS, OP, LP, O, LSE, SEM,
    qk_scale,  # sm_scale * log2(e)
    stride_qb, stride_qh,
    stride_cp, stride_ch,  # codes pool [pages, Hkv, W]
    stride_kpp, stride_kph,  # block-scale bytes [pages, Hkv, page, NB] (the last two contiguous)
    stride_vpp, stride_vph,
    stride_btb,
    stride_opb, stride_oph, stride_ops,  # partial outputs [B, Hq, S, D]
    stride_lpb, stride_lph,  # partial LSE [B, Hq, S]
    stride_ob, stride_oh, stride_lb, stride_lh,  # output [B, Hq, D] and LSE [B, Hq] (FUSED_COMBINE)
    D: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    BLOCK: tl.constexpr, E8M0: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr, FLUSH: tl.constexpr,
    INTERPRET: tl.constexpr, FUSED_COMBINE: tl.constexpr, WINDOWS: tl.constexpr, MERGE_H: tl.constexpr,
    CHUNK: tl.constexpr, WRITE_LSE: tl.constexpr, STEP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    NB: tl.constexpr = D // BLOCK  # blocks per token

    L = tl.load(SEQ + b)
    _, n_quant, _ = split_of(L, SINK, RECENT, FLUSH)
    t_lo, t_hi = split_range(n_quant, BLOCK_N)

    hh = tl.arange(0, BLOCK_H)
    dd = tl.arange(0, D)
    tt = tl.arange(0, BLOCK_N)
    cc = tl.arange(0, NB)
    hmask = hh < G * STEP
    row_seen = step_seen(L, n_quant, hh, G, STEP, SINK, RECENT, FLUSH, WINDOWS)  # a step's causal limits
    step_row = hh // G if STEP > 1 else 0  # row hh: head kvh G + hh % G of the step's token hh // G
    head = kvh * G + (hh % G if STEP > 1 else hh)
    row_off = (b * STEP + step_row) * stride_qb + head * stride_qh
    op_off = (b * STEP + step_row) * stride_opb + head * stride_oph
    lp_off = (b * STEP + step_row) * stride_lpb + head * stride_lph

    # Q as an FP16 operand, each row scaled by a power of two to |Q| <= 2^8 (undone with the block scales)
    qf = tl.load(Q + row_off[:, None] + dd[None, :], mask=hmask[:, None], other=0.0).to(tl.float32)
    q_top = _pow2_bits(tl.max(tl.abs(qf), axis=1))  # [BLOCK_H]
    q_mul = _pow2_over(q_top, 8)
    q16 = qf * q_mul[:, None]
    if not INTERPRET:
        q16 = q16.to(tl.float16)
    q2t = tl.trans(q16)  # [D, BLOCK_H]
    k_fac = tl.load(TS) * qk_scale  # T_K and the softmax scale
    row_fac = _pow2(q_top, -8)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_el = tl.zeros((BLOCK_N, BLOCK_H), tl.float32)  # the softmax denominator, reduced after the loop
    acc = tl.zeros((D, BLOCK_H), tl.float32)  # O^T

    # the affine kernel's software pipeline (one tile in flight, the page two tiles ahead)
    bt_row = BT + b * stride_btb
    page = tl.load(bt_row + (t_lo * BLOCK_N) // PAGE, mask=t_lo < t_hi, other=0).to(tl.int64)
    kw, vw, kb, vb = _load_tile(KC, VC, KS, VS, page, kvh, t_lo, t_hi, n_quant, tt, cc, stride_cp, stride_ch,
                                stride_kpp, stride_kph, stride_vpp, stride_vph, D, NB, BLOCK_N, PAGE)
    page = tl.load(bt_row + ((t_lo + 1) * BLOCK_N) // PAGE, mask=t_lo + 1 < t_hi, other=0).to(tl.int64)
    for tile in range(t_lo, t_hi):
        t0 = tile * BLOCK_N
        valid = t0 + tt < n_quant
        kw_n, vw_n, kb_n, vb_n = _load_tile(KC, VC, KS, VS, page, kvh, tile + 1, t_hi, n_quant, tt, cc, stride_cp,
                                            stride_ch, stride_kpp, stride_kph, stride_vpp, stride_vph, D, NB,
                                            BLOCK_N, PAGE)
        page = tl.load(bt_row + ((tile + 2) * BLOCK_N) // PAGE, mask=tile + 2 < t_hi, other=0).to(tl.int64)
        # ---- S^T = K Q^T: the block scales in K's operand, the token's power of two on its scores -------
        ks = block_scales(kb.to(tl.int32), E8M0)  # [BLOCK_N, NB]
        k_top = _pow2_bits(tl.max(ks, axis=1))  # [BLOCK_N]: 2^E_t at or above the token's block scales
        yk = k_operand_fp4(kw, ks * _pow2_over(k_top, 15)[:, None], BLOCK_N, D, BLOCK, INTERPRET)  # 2 v s / 2^E_t
        st = dot(yk, q2t, INTERPRET) * (_pow2(k_top, -1) * k_fac)[:, None] * row_fac[None, :]
        # ---- online softmax (base 2) over the token axis, masked (causal among a step's tokens) -------
        m_i, alpha, p, l_el = causal_softmax_step(st, valid, t0, tt, row_seen, m_i, l_el, STEP)  # p: P^T
        # ---- O^T += V^T P^T: the scale in the A operand, a power of two per block on the product -------
        vs = block_scales(vb.to(tl.int32), E8M0)  # [NB, BLOCK_N]
        top = _pow2_bits(tl.max(vs, axis=1))  # [NB]: 2^E_b at or above the tile's scales of block b
        a = v_operand_t_fp4(vw, vs * _pow2_over(top, 15)[:, None], BLOCK_N, D, BLOCK, INTERPRET)  # 2 v s / 2^E_b
        pb = p
        if not INTERPRET:
            pb = p.to(tl.float16)
        row_pow = tl.reshape(tl.broadcast_to(_pow2(top, -1)[:, None], (NB, BLOCK)), (D,))  # 2^(E_b - 1)
        acc = acc * alpha[None, :] + dot(a, pb, INTERPRET) * row_pow[:, None]
        kw, vw, kb, vb = kw_n, vw_n, kb_n, vb_n

    # ---- partial output and LSE of this split ---------------------------------------------------------
    den, lse = partial_result(m_i, tl.sum(l_el, axis=0))
    out = acc * (tl.load(TS + 1) / den)[None, :]  # T_V
    finish_split(out, lse, OP, LP, O, LSE, SEM, op_off, lp_off, split, b, kvh, hmask, dd, stride_ops, stride_opb,
                 stride_lpb, stride_oph, stride_lph, stride_ob, stride_lb, stride_oh, stride_lh,
                 G=G, D=D, STEP=STEP, FUSED_COMBINE=FUSED_COMBINE, WINDOWS=WINDOWS, MERGE_H=MERGE_H, CHUNK=CHUNK,
                 WRITE_LSE=WRITE_LSE, ROTATE=False, ROT=LP)
