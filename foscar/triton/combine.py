"""Stage 2: merge the partial outputs of the KV splits (and of the BF16 sink/recent windows) by LSE."""
import triton
import triton.language as tl


@triton.jit
def combine_stage2(
    OP, LP, O, LSE,
    stride_opb, stride_oph, stride_ops,
    stride_lpb, stride_lph,
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr, D: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """One program per (batch entry, query head): ``O = sum_i 2^(lse_i - max) o_i / sum_i 2^(lse_i - max)``.

    Partial LSEs are base 2 (of the scaled scores); the written LSE is natural log, like
    :func:`foscar.decode_exact`. All partials empty (a sequence of length 0): ``O = 0``, ``LSE = -inf``.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    ss = tl.arange(0, PARTS_PAD)
    dd = tl.arange(0, D)
    smask = ss < NUM_PARTS
    lse = tl.load(LP + b * stride_lpb + h * stride_lph + ss, mask=smask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # empty partials weigh 0
    total = tl.sum(w, axis=0)
    o = tl.load(OP + b * stride_opb + h * stride_oph + ss[:, None] * stride_ops + dd[None, :],
                mask=smask[:, None] & (w > 0)[:, None], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(O + b * stride_ob + h * stride_oh + dd, out.to(O.dtype.element_ty))
    if WRITE_LSE:
        lse_out = tl.where(total > 0, (m_safe + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453,
                           float("-inf"))
        tl.store(LSE + b * stride_lb + h * stride_lh, lse_out)
