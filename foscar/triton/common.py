"""Pieces shared by the Triton stage-1 kernels: split ranges, online softmax, operand handling.

Under the interpreter (``INTERPRET``) operands stay in float32: its bf16 dot returns garbage and its
float32 -> bf16 cast truncates (``../shared/docs/triton-notes.md``). Helpers have one ``return``
each: Triton 3.6 rejects constexpr branches that return different types.
"""
import triton
import triton.language as tl


@triton.jit
def split_range(n, BLOCK_N: tl.constexpr):
    """Tiles ``[t_lo, t_hi)`` of this program's split (grid axis 2; the split count is the grid's size
    there, so it costs no recompile) over ``n`` tokens: contiguous runs of equal length."""
    n_tiles = tl.cdiv(n, BLOCK_N)
    per = tl.cdiv(n_tiles, tl.num_programs(2))
    t_lo = tl.program_id(2) * per
    return t_lo, tl.minimum(t_lo + per, n_tiles)


@triton.jit
def split_of(L, SINK: tl.constexpr, RECENT: tl.constexpr, FLUSH: tl.constexpr):
    """``(n_sink, n_quant, n_recent)`` of a sequence of ``L`` tokens, on the device: what
    :meth:`foscar.KVFormat.split_length` computes on the host (so a launch reads lengths, not splits)."""
    n_sink = tl.minimum(L, SINK)
    n_quant = tl.maximum(L - n_sink - RECENT, 0) // FLUSH * FLUSH
    return n_sink, n_quant, L - n_sink - n_quant


@triton.jit
def online_softmax(m_i, l_i, s, GUARD: tl.constexpr = False):
    """One tile of base-2 online softmax over scores ``s [H, N]``: ``(m_new, alpha, p, l_new)``; the caller
    rescales its accumulator by ``alpha`` and adds ``p``'s contribution. ``GUARD``: a row may have seen no
    token yet (every score ``-inf``); its P and rescale stay 0."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = m_new
    if GUARD:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def masked_scores(st, valid, t0, tt, row_seen, STEP: tl.constexpr):
    """Scores ``S^T [BLOCK_N, BLOCK_H]`` with ``-inf`` on tokens past the quantized ones (``valid`` false) and, for a
    step of ``STEP`` tokens, past each row's causal limit (row ``hh`` sees the first ``row_seen[hh]`` quantized
    tokens, :func:`step_seen`)."""
    if STEP == 1:
        st = tl.where(valid[:, None], st, float("-inf"))
    else:
        st = tl.where(valid[:, None] & ((t0 + tt)[:, None] < row_seen[None, :]), st, float("-inf"))
    return st


@triton.jit
def causal_softmax_step(st, valid, t0, tt, row_seen, m_i, l_el, STEP: tl.constexpr):
    """One KV tile of the stage-1 kernels' base-2 online softmax over scores ``S^T [BLOCK_N, BLOCK_H]``, masked
    (:func:`masked_scores`). A row may see no token of a tile, or of the whole split: its P and rescale stay 0.
    Returns ``(m_new, alpha, p, l_el)``: the running maxima, the rescale of what came before, ``P^T``, the
    per-element sums."""
    st = masked_scores(st, valid, t0, tt, row_seen, STEP)
    m_new = tl.maximum(m_i, tl.max(st, axis=0))
    m_use = m_new
    if STEP > 1:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(st - m_use[None, :])
    return m_new, alpha, p, l_el * alpha[None, :] + p


@triton.jit
def past_headroom(st, m_ref, HEADROOM: tl.constexpr):
    """Whether any score of ``S^T`` passes its row's running maximum by more than ``HEADROOM`` (base 2), or is
    finite where the row has seen no score yet: a count of such scores, 0 when none. ``m_ref``: the maxima, with
    -3e38 where a row has seen none (:func:`lazy_references`). A NaN score passes no comparison (its P is NaN
    either way); counted, not maximised, so that a NaN never hides another score (the interpreter's maximum
    propagates NaN)."""
    return tl.sum(tl.sum(((st - m_ref[None, :]) > HEADROOM).to(tl.int32), axis=1), axis=0)


@triton.jit
def lazy_references(m_i):
    """``(m_use, m_ref)`` of the running maxima ``m_i``: the maxima the exponentials subtract (0 where a row has
    seen no score, so that its masked scores give 0) and those :func:`past_headroom` compares with (-3e38 there,
    so that any finite score of such a row passes)."""
    seen = m_i != float("-inf")
    return tl.where(seen, m_i, 0.0), tl.where(seen, m_i, -3.0e38)


@triton.jit
def step_seen(L, n_quant, hh, G: tl.constexpr, STEP: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
              FLUSH: tl.constexpr, WINDOWS: tl.constexpr):
    """The quantized tokens each row of a step sees (row ``hh``: step token ``hh // G``, of length
    ``L - STEP + 1 + hh // G``): the quantized count at that length, which a BF16 window makes smaller than the
    length (the row reads the rest from the ring, as a one-token decode at that length); without windows
    ``n_quant - STEP + 1 + hh // G``."""
    if WINDOWS == 0:
        seen = n_quant - (STEP - 1) + hh // G
    else:
        _, seen, _ = split_of(L - (STEP - 1) + hh // G, SINK, RECENT, FLUSH)
    return seen


@triton.jit
def partial_result(m_i, l_i):
    """``(denominator, lse)`` of a split: ``lse = m + log2(l)``, ``-inf`` (and denominator 1) when empty.
    A NaN sum (a NaN or infinite score) is not empty: the LSE is NaN, and so is every merge it joins."""
    empty = l_i == 0
    den = tl.where(empty, 1.0, l_i)
    return den, tl.where(empty, float("-inf"), m_i + tl.log2(den))


@triton.jit
def round_operand(x, INTERPRET: tl.constexpr):
    """A BF16 tensor-core operand (float32 under the interpreter)."""
    y = x
    if not INTERPRET:
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def dot_acc(a, b, acc, INTERPRET: tl.constexpr):
    """``acc + a @ b``, the MMA accumulating into ``acc`` (float32; operands upcast under the interpreter)."""
    if INTERPRET:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc)
    return r


@triton.jit
def dot(a, b, INTERPRET: tl.constexpr):
    """``a @ b`` with fp32 accumulation (operands upcast to exact float32 under the interpreter)."""
    if INTERPRET:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def walsh_hadamard(x, D: tl.constexpr):
    """``x [H, D] H_D`` (Sylvester's unnormalized Hadamard matrix, ``D`` a power of two) of a float32 block:
    ``log2(D)`` butterfly rounds, each pairing the elements ``span`` apart (reshapes, no memory). What a
    rotated cache's query and output go through (:func:`foscar.rotation.rotation_matrix`:
    ``R = diag(s) H / sqrt(D)``)."""
    H: tl.constexpr = x.shape[0]
    for stage in tl.static_range(12):  # head dims up to 4096; the span of a round is 1 << stage
        if (1 << stage) < D:
            y = tl.permute(tl.reshape(x, (H, D // (2 << stage), 2, 1 << stage)), (0, 1, 3, 2))
            a, c = tl.split(y)
            x = tl.reshape(tl.permute(tl.join(a + c, a - c), (0, 1, 3, 2)), (H, D))
    return x
