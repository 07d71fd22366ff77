"""Stage 2: merge the partial outputs of the KV splits (and of the BF16 sink/recent windows) by LSE.

One merge, :func:`merge_parts`, in two places: the standalone kernel :func:`combine_stage2` (one
program per batch entry and query head, after any stage 1), and the epilogue of the folded stage 1
(:mod:`foscar.triton.decode`, ``FUSED_COMBINE``), where the last split of a KV head to finish merges
its query heads' partials, so a decode is one launch.
"""
import triton
import triton.language as tl

from .common import walsh_hadamard

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)  # a global a kernel may read: a constexpr


@triton.jit
def merge_parts(OP, LP, O, LSE, hh, hmask, n_parts,
                stride_oph, stride_ops, stride_lph, stride_oh, stride_lh, ROT,
                CHUNK: tl.constexpr, D: tl.constexpr, WRITE_LSE: tl.constexpr, CACHED: tl.constexpr,
                ROTATE: tl.constexpr):
    """``O[h] = sum_i 2^(lse_i - m) o_i / sum_i 2^(lse_i - m)`` for the heads ``hh`` (masked by ``hmask``)
    of one batch entry (``OP, LP, O, LSE`` point at its rows), over ``n_parts`` partials taken
    ``CHUNK`` at a time with a running maximum (one pass; the loads of a chunk do not wait on each
    other).

    Partial LSEs are base 2 (of the scaled scores); the written LSE is natural log, like
    :func:`foscar.decode_exact`. Empty partials (``lse = -inf``) weigh 0 whatever their output holds;
    all empty (a sequence of length 0): ``O = 0``, ``LSE = -inf``. A NaN LSE (a broken partial) makes
    ``O`` and ``LSE`` NaN, never a merge of the others. ``CACHED=False`` reads the partials
    past the L1 (``.cg``): the fused epilogue reads what other SMs just wrote. ``ROTATE``: the partials
    are in a rotated cache's space, ``O`` is not: ``O (H) f`` (``ROT``: the factors ``f``,
    :func:`foscar.rotation.rotation_factors`).
    """
    cc = tl.arange(0, CHUNK)
    dd = tl.arange(0, D)
    m = tl.full(hh.shape, float("-inf"), tl.float32)
    total = tl.zeros(hh.shape, tl.float32)
    acc = tl.zeros((hh.shape[0], D), tl.float32)
    for c0 in range(0, n_parts, CHUNK):
        pm = hmask[:, None] & (c0 + cc < n_parts)[None, :]
        lp = LP + hh[:, None] * stride_lph + c0 + cc[None, :]
        op = OP + (hh[:, None, None] * stride_oph + (c0 + cc)[None, :, None] * stride_ops + dd[None, None, :])
        if CACHED:
            lse = tl.load(lp, mask=pm, other=float("-inf"))
            o = tl.load(op, mask=pm[:, :, None], other=0.0)
        else:
            lse = tl.load(lp, mask=pm, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(op, mask=pm[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=1))  # a NaN may be skipped here: its weight below is NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp2(m - m_safe)  # 0 while nothing was seen
        w = tl.exp2(lse - m_safe[:, None])  # [H, CHUNK]; empty partials weigh 0
        total = total * scale + tl.sum(w, axis=1)
        acc = acc * scale[:, None] + tl.sum(tl.where(w[:, :, None] > 0, o, 0.0) * w[:, :, None], axis=1)
        m = m_new
    empty = total == 0  # NaN != 0: a NaN total divides and stays NaN
    out = acc / tl.where(empty, 1.0, total)[:, None]
    if ROTATE:
        out = walsh_hadamard(out, D) * tl.load(ROT + dd)[None, :]
    tl.store(O + hh[:, None] * stride_oh + dd[None, :], out.to(O.dtype.element_ty), mask=hmask[:, None])
    if WRITE_LSE:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        lse_out = tl.where(empty, float("-inf"), (m_safe + tl.log2(tl.where(empty, 1.0, total))) * LN2)
        tl.store(LSE + hh * stride_lh, lse_out, mask=hmask)


@triton.jit
def combine_stage2(
    OP, LP, O, LSE, ROT,
    stride_opb, stride_oph, stride_ops,
    stride_lpb, stride_lph,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr, D: tl.constexpr, WRITE_LSE: tl.constexpr,
    ROTATE: tl.constexpr,
):
    """One program per (batch entry, query head): :func:`merge_parts` over all partials in one chunk."""
    b = tl.program_id(0)
    hh = tl.program_id(1) + tl.arange(0, 1)
    merge_parts(OP + b * stride_opb, LP + b * stride_lpb, O + b * stride_ob, LSE + b * stride_lb, hh, hh >= 0,
                NUM_PARTS, stride_oph, stride_ops, stride_lph, stride_oh, stride_lh, ROT,
                CHUNK=PARTS_PAD, D=D, WRITE_LSE=WRITE_LSE, CACHED=True, ROTATE=ROTATE)
