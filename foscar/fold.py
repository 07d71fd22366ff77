"""Affine-folded decode as the paper states it: the executable spec of every kernel.

Per sequence and KV head, the quantized tokens are walked in KV tiles of ``tile_tokens`` tokens,
grouped into ``num_splits`` contiguous splits (split-KV). Inside a tile nothing computes
``s*q + z`` per value. The tensor-core operands are built from the packed words by a bit trick,
``y = alpha*q + beta``. The kernels' injection puts ``q`` in the top mantissa bits:
``y = q + 2^bits`` (:func:`~foscar.format.operand_for`). The paper's is ``0x4300 | q`` = ``q + 128``;
the cache's constants are stored for it. The folded constants (paper eq. 5) are applied as in
paper Sec. 4.1-4.2 (Fig. 5). Every offset term is taken around the pivot ``c``, the operand of the
middle code: ``x = s' (y - c) + mid``, where ``mid = z' + (c - beta + beta_cache) s'`` is the
group's middle value (``z + s (2^bits - 1)/2``):

============  ===========  ====================================================================
cache         product      fold
============  ===========  ====================================================================
token-wise K  Q K^T (sum   **acc-fold**: per channel group, the group-local partial
              over D)      ``Q[:, G] . y[t, G]``; ``s'[t, G] (partial - c sum Q[:, G])`` plus the
                           offset correction ``mid[t, G] * sum(Q[:, G])``
channel-wise  Q K^T        **operand-fold**: per token group, ``Q' = Q * s'[group]`` is the operand;
K                          offset correction ``sum_c Q mid - c sum_c Q'``
token-wise V  P V (sum     **operand-fold**: per channel group, ``P' = P * s'[t, G]`` is the operand;
              over L)      offset correction ``sum_t P mid - c sum_t P'``
channel-wise  P V          **acc-fold**: per token group, the group-local partial ``P[:, group] .
V                          y[group]``; ``s' (partial - c sum P) + mid * sum(P[group])``
============  ===========  ====================================================================

Ordering: K corrections land before the softmax (before ``sm_scale`` and the running max); V
corrections land in the output accumulator, before the final division by the denominator. A
group-local partial never crosses a group boundary unscaled: when a group spans tiles, each tile's
piece is scaled before it joins the accumulator; when a tile spans groups, each group is separate.

Numerics of the constructed operands (``../shared/docs/triton-notes.md``): with ``operand_dtype``
(e.g. ``torch.bfloat16``) the operands the tensor core consumes (``Q``, ``Q'``, ``P'``, ``P``) are
rounded to it, and every offset correction is computed from the *rounded* operand: ``- c sum(A')``
cancels the ``c`` part of the product ``A' . y`` exactly, and the rounding error acts only on the
centred ``q - (2^bits - 1)/2``. A correction from the unrounded operand instead lets the injected
``beta = 128`` multiply the rounding error about a hundredfold. Centring also keeps the offset term
``mid * sum`` from cancelling a large ``z * sum`` for centred data. With float32 accumulation this,
the small injected offset and the single rounding of ``mid`` (formed in float64 here, by an FMA in
the kernels) keep every configuration within 1e-5 of the exact result.

E4M3 operands (``operand_dtype=torch.float8_e4m3fn``, :mod:`foscar.e4m3`): the K and V operands are
the codes placed in a byte, ``y = q 2^-9`` (``beta = 0``), and the cache's stored constants are
converted per group to that mapping, ``s_e = s' alpha/2^-9`` (``2^9 s'`` for ``bf16``) and the middle
value ``z' + s' (beta + alpha (2^bits - 1)/2)`` (float64, one rounding to FP32). The other operand
(``Q``, ``Q'``, ``P'``, ``P``) is split into ``operand_terms`` E4M3 terms with a power-of-two scale per
slice: per query row for ``Q``; per query row and token group for ``Q'`` (rounded to FP16 first, as the CuTe
kernels fold it: :data:`foscar.e4m3.Q_PRIME_FP16_FIRST`); per query row (and channel
group) and KV tile for ``P'`` and ``P``. Each term's tile product is exact E4M3 products summed in FP32
(:func:`foscar.e4m3.term_product`); the terms are added after the MMA. The offsets stay centred on
the pivot ``c = 2^-9 (2^bits - 1)/2`` with the corrections from the consumed operand (the sum of its
terms). With ``beta = 0`` nothing large cancels any more, but where the operand is folded (``Q'``,
``P'``) the split's residual error still multiplies ``y - c`` instead of the one-signed ``y``: 2-3x less
output error, measured (``tests/test_e4m3.py``). Where the scale is applied to partials (token-wise K,
channel-wise V) both forms are the same sum, ``sum A_r x`` of the consumed operand. One term (3
mantissa bits) is several percent of output error: a study option, never a kernel's numerics.

Each split ends with its partial output and LSE; the BF16 sink/recent tokens are one more partial
(plain attention, :meth:`_FoldedSequence.window_query`); an LSE combine merges them all.
"""
from __future__ import annotations

import math

import torch

from . import e4m3
from ._checks import check_decode_inputs, check_int
from .cache import QuantKVCache
from .errors import InvalidArgumentError, UnsupportedError
from .format import E4M3_PLACEMENT, TOKEN, operand_for, unpack_codes
from .multitoken import SequenceStep, causal_view
from .rotation import rotate
from .splitkv import split_ranges

E4M3 = torch.float8_e4m3fn
#: How token-wise K's query takes its E4M3 terms (:func:`decode_folded`'s ``q_terms``)
Q_TERMS = ("columns", "stacked", "stacked_kv_head", "digits")
OPERAND_DTYPES = (torch.bfloat16, torch.float16, torch.float32, E4M3)


def combine_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE combine of partial attentions ``out_i [..., D]`` with ``lse_i [...]`` (``-inf`` = empty).

    An empty partial weighs 0 whatever its output holds; all empty gives ``out = 0``, ``lse = -inf``. A NaN
    (or ``+inf``) LSE or a NaN output of a non-empty partial makes the merged output and LSE NaN: a broken
    partial is never dropped or zeroed."""
    if not isinstance(outs, (list, tuple)) or not outs:
        raise InvalidArgumentError("outs", "a non-empty list of tensors",
                                   outs if isinstance(outs, (list, tuple)) else type(outs).__name__)
    if not isinstance(lses, (list, tuple)) or len(lses) != len(outs):
        raise InvalidArgumentError("lses", f"a list of {len(outs)} tensors (one per out)",
                                   len(lses) if isinstance(lses, (list, tuple)) else type(lses).__name__)
    lse = torch.stack(lses)  # [S, ...]
    m = lse.max(dim=0).values
    m_safe = torch.where(m == -math.inf, torch.zeros_like(m), m)  # NaN and +inf stay: their weights are NaN
    w = torch.exp(lse - m_safe)  # empty partials weigh 0; a NaN LSE gives a NaN weight
    total = w.sum(0)
    num = sum(wi[..., None] * torch.where(wi[..., None] == 0, 0.0, oi) for wi, oi in zip(w, outs))
    empty = total == 0  # NaN != 0: a NaN total divides and stays NaN
    out = torch.where(empty[..., None], torch.zeros_like(num), num / torch.where(empty, 1, total)[..., None])
    return out, m_safe + torch.log(total)


class _Tile:
    """Operands and folded constants of one KV tile (``n`` valid tokens from quantized index ``t0``)."""

    def __init__(self, y_k, y_v, t0, n):
        self.y_k, self.y_v, self.t0, self.n = y_k, y_v, t0, n


class _FoldedSequence:
    """Folded decode of one sequence, all KV heads at once (``[H, G, ...]`` tensors)."""

    def __init__(self, cache: QuantKVCache, b: int, dtype: torch.dtype, operand_dtype: torch.dtype | None,
                 pv_operand_dtype: torch.dtype | None, operand_terms: int | None = None, q_terms: str = "columns"):
        self.cache, self.fmt, self.b, self.dtype = cache, cache.fmt, b, dtype
        self.operand_dtype, self.pv_operand_dtype = operand_dtype, pv_operand_dtype
        self.terms = operand_terms
        self.q_terms = q_terms  # how token-wise K's Q is split into E4M3 terms (decode_folded's q_terms)
        self.e4m3 = {"k": operand_dtype == E4M3, "v": pv_operand_dtype == E4M3}
        self.n_quant = int(cache.split()[1][b])
        self.words = {t: cache.quantized_words(t, b) for t in ("k", "v")}
        raw = {t: cache.quantized_params(t, b) for t in ("k", "v")}
        # The operands are built as the kernels build them: codes injected into the top mantissa bits
        # (y = q + 2^bits; FP16 for a PV product in FP16, BF16 otherwise) and the stored z' (made for
        # the cache's mapping) re-based to that offset. Caches for a mapping with alpha != 1 (E4M3,
        # E2M1 placement) use their own mapping.
        self.op = {"k": self.fmt.op, "v": self.fmt.op}
        if self.fmt.op.alpha == 1.0:
            self.op["k"] = operand_for(torch.bfloat16, self.fmt.bits)
            self.op["v"] = operand_for(pv_operand_dtype if pv_operand_dtype == torch.float16 else torch.bfloat16,
                                       self.fmt.bits)
        for t in ("k", "v"):
            if self.e4m3[t]:
                self.op[t] = E4M3_PLACEMENT  # q in a byte's low bits: q 2^-9
        self.pivot = {t: self.pivot_of(t) for t in ("k", "v")}
        # Every fold takes its offset term around the pivot c: x = s_o (y - c) + mid, with the operand's
        # scale s_o = s' alpha_cache / alpha_op and the group's middle value mid = z' + (beta_cache +
        # alpha_cache (c - beta_op) / alpha_op) s', formed from the stored FP32 constants in float64 and
        # rounded once to the compute dtype.
        self.params = {}
        for t in ("k", "v"):
            sp, zp = (x.double() for x in raw[t])
            op, ratio = self.op[t], self.fmt.op.alpha / self.op[t].alpha  # a power of two
            mid = zp + (self.fmt.op.beta + (self.pivot[t] - op.beta) * ratio) * sp
            self.params[t] = ((sp * ratio).to(dtype), mid.to(dtype))

    def pivot_of(self, tensor: str) -> float:
        """The operand value of the middle code, which every offset term is taken around."""
        return self.op[tensor].pivot(self.fmt.bits)

    def rnd(self, x: torch.Tensor, tensor: str = "k") -> torch.Tensor:
        """Round to the operand format the tensor core consumes (identity in exact mode; E4M3 operands are
        split per product: :meth:`split_operand`)."""
        dt = self.operand_dtype if tensor == "k" else self.pv_operand_dtype
        return x if dt is None or dt == E4M3 else x.to(dt).to(self.dtype)

    def window_query(self, Qt: torch.Tensor) -> torch.Tensor:
        """The query the BF16 sink/recent tokens are attended with: the rounded ``Qt`` of the quantized
        tokens; with E4M3 QK operands, two BF16 terms ``hi = bf16(Q)``, ``lo = bf16(Q - hi)`` (16 bits,
        finer than the E4M3 terms). A query rounded differently for the windows than for the quantized
        tokens shifts their scores apart by ``sum_c (error_c) k_c``, which a common offset of K makes
        large (``tests/test_e4m3.py``)."""
        if not self.e4m3["k"]:
            return Qt
        hi = Qt.to(torch.bfloat16).to(self.dtype)
        return hi + (Qt - hi).to(torch.bfloat16).to(self.dtype)

    def split_operand(self, x: torch.Tensor, dims: tuple[int, ...], in_place: bool = False, digits: bool = False,
                      fp16_first: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
        """E4M3 terms of the operand ``x`` (one scale per slice over ``dims``; ``in_place``, ``fp16_first``: as
        :func:`foscar.e4m3.split_terms` takes them; ``digits``: integer digits, :func:`foscar.e4m3.split_digits`)
        and the consumed operand, their sum (exact in FP32)."""
        if digits:
            terms = e4m3.split_digits(x, self.terms, dims)
        else:
            terms = e4m3.split_terms(x, self.terms, dims, in_place, fp16_first)
        return terms, sum(terms).to(self.dtype)

    def rnd_scaled(self, p: torch.Tensor, sp: torch.Tensor) -> torch.Tensor:
        """The PV operand ``P s'`` (``p [H, G, n]``, ``s' [H, n, C]`` -> ``[H, G, n, C]``). In FP16
        (5 exponent bits) it is rounded as ``P (s' 2^-e)`` with ``2^e`` the power of two at or above
        the tile's largest ``|s'|`` per channel group (``P <= 1``, so the operand is at most 1), then
        scaled back exactly."""
        x = p[..., None] * sp[:, None]
        if self.pv_operand_dtype != torch.float16:
            return self.rnd(x, "v")
        top = sp.abs().amax(dim=1, keepdim=True)[:, None]  # [H, 1, 1, C]
        scale = torch.exp2(torch.ceil(torch.log2(torch.where(top > 0, top, torch.ones_like(top)))))
        return self.rnd(x / scale, "v") * scale

    def tile(self, t0: int, tile_tokens: int) -> _Tile:
        fmt, D = self.fmt, self.fmt.head_dim
        n = min(tile_tokens, self.n_quant - t0)
        wpt = D * fmt.bits // 32  # words per token (tiles are whole pack blocks)
        y = {}
        for t in ("k", "v"):
            words = self.words[t][:, t0 * wpt: (t0 + tile_tokens) * wpt]
            codes = unpack_codes(words, fmt.bits, t, D)[:, :n]
            y[t] = self.op[t].construct(codes).to(self.dtype)  # the bit trick, decoded exactly
        return _Tile(y["k"], y["v"], t0, n)

    def group_segments(self, tile: _Tile):
        """``(group index, slice of the tile)`` for each token group (channel-wise axis) the tile touches."""
        g = self.fmt.group_size
        t = tile.t0
        while t < tile.t0 + tile.n:
            end = min((t // g + 1) * g, tile.t0 + tile.n)
            yield t // g, slice(t - tile.t0, end - tile.t0)
            t = end

    # ---- QK^T: scores with the K offset corrections (before softmax) -----------------------------
    def scores(self, Qt: torch.Tensor, tile: _Tile) -> torch.Tensor:
        H, G, D = Qt.shape
        g, yk = self.fmt.group_size, tile.y_k
        sp, mid = self.params["k"]
        c = self.pivot["k"]
        if self.fmt.k_axis == TOKEN:  # acc-fold over channel groups
            sp, mid = sp[:, tile.t0: tile.t0 + tile.n], mid[:, tile.t0: tile.t0 + tile.n]  # [H, n, C]
            C = D // g
            eq, yg = "hgcj,hncj->hgnc", yk.reshape(H, tile.n, C, g)
            if self.e4m3["k"]:  # Q split per query row (or per KV head: its rows together)
                dims = (-2, -1) if self.q_terms == "stacked_kv_head" else (-1,)
                terms, Qc = self.split_operand(Qt, dims, self.q_terms.startswith("stacked"), self.q_terms == "digits")
                partial = e4m3.term_product(eq, [t.reshape(H, G, C, g) for t in terms], yg, self.dtype)
            else:
                Qc = Qt
                partial = torch.einsum(eq, Qt.reshape(H, G, C, g), yg)
            q_sum = Qc.reshape(H, G, C, g).sum(-1)[:, :, None, :]  # sum of the consumed (rounded) Q per group
            return ((partial - c * q_sum) * sp[:, None] + mid[:, None] * q_sum).sum(-1)
        S = Qt.new_empty(H, G, tile.n)  # operand-fold into Q, per token group
        for gi, seg in self.group_segments(tile):
            if self.e4m3["k"]:  # Q' = Q s' split per query row of the group
                terms, Qp = self.split_operand(Qt * sp[:, gi][:, None, :], (-1,), fp16_first=e4m3.Q_PRIME_FP16_FIRST)
                prod = e4m3.term_product("hgd,hnd->hgn", terms, yk[:, seg], self.dtype)
            else:
                Qp = self.rnd(Qt * sp[:, gi][:, None, :])  # Q' = Q s', the operand
                prod = torch.einsum("hgd,hnd->hgn", Qp, yk[:, seg])
            corr = (Qt * mid[:, gi][:, None, :]).sum(-1) - c * Qp.sum(-1)
            S[..., seg] = prod + corr[..., None]
        return S

    # ---- PV: output contribution with the V offset corrections (before the division) -----------
    def values(self, p: torch.Tensor, tile: _Tile) -> torch.Tensor:
        H, G, n = p.shape
        D, g, yv = self.fmt.head_dim, self.fmt.group_size, tile.y_v
        sp, mid = self.params["v"]
        c = self.pivot["v"]
        if self.fmt.v_axis == TOKEN:  # operand-fold into P, per channel group
            sp, mid = sp[:, tile.t0: tile.t0 + n], mid[:, tile.t0: tile.t0 + n]  # [H, n, C]
            C = D // g
            eq, yg = "hgnc,hncj->hgcj", yv.reshape(H, n, C, g)
            if self.e4m3["v"]:  # P' split per query row and channel group, over the tile
                terms, Pp = self.split_operand(p[..., None] * sp[:, None], (2,))
                prod = e4m3.term_product(eq, terms, yg, self.dtype)
            else:
                Pp = self.rnd_scaled(p, sp)  # [H, G, n, C]: P' = P s', the operand
                prod = torch.einsum(eq, Pp, yg)
            corr = torch.einsum("hgn,hnc->hgc", p, mid) - c * Pp.sum(2)
            return (prod + corr[..., None]).reshape(H, G, D)
        out = p.new_zeros(H, G, D)  # acc-fold over token groups
        if self.e4m3["v"]:  # P split per query row, over the tile
            terms, Pt = self.split_operand(p, (-1,))
        else:
            Pt = self.rnd(p, "v")
        for gi, seg in self.group_segments(tile):
            if self.e4m3["v"]:
                partial = e4m3.term_product("hgn,hnd->hgd", [t[..., seg] for t in terms], yv[:, seg], self.dtype)
            else:
                partial = torch.einsum("hgn,hnd->hgd", Pt[..., seg], yv[:, seg])  # group-local partial
            p_sum = Pt[..., seg].sum(-1, keepdim=True)
            out += sp[:, gi][:, None] * (partial - c * p_sum) + mid[:, gi][:, None] * p_sum
        return out

    def split(self, Qt: torch.Tensor, tiles: range, tile_tokens: int, sm_scale: float, step: SequenceStep):
        """Online softmax over a run of tiles: ``(acc / l, m + log l)``; a row that sees no token of the split
        (``step``'s causal mask) ``(0, -inf)``."""
        H, G, D = Qt.shape
        m = Qt.new_full((H, G), -math.inf)
        l = Qt.new_zeros(H, G)
        acc = Qt.new_zeros(H, G, D)
        for i in tiles:
            tile = self.tile(i * tile_tokens, tile_tokens)
            s = step.mask(self.scores(Qt, tile) * sm_scale, tile.t0)  # K corrections already in
            m_new = torch.maximum(m, s.amax(-1))
            m_use = torch.where(m_new == -math.inf, 0.0, m_new)  # a row that has seen nothing yet weighs 0
            alpha = torch.exp(m - m_use)
            p = torch.exp(s - m_use[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + self.values(p, tile)  # V corrections inside, before / l
            m = m_new
        empty = l == 0  # NaN != 0: a NaN sum divides and stays NaN
        safe = torch.where(empty, 1.0, l)
        return acc / safe[..., None], torch.where(empty, -math.inf, m + torch.log(safe))


def decode_folded(q: torch.Tensor, cache: QuantKVCache, *, sm_scale: float | None = None, tile_tokens: int = 64,
                  num_splits: int = 1, dtype: torch.dtype = torch.float64, operand_dtype: torch.dtype | None = None,
                  pv_operand_dtype: torch.dtype | None = None, operand_terms: int | None = None,
                  q_terms: str = "columns", return_lse: bool = False):
    """Folded decode of ``q [B, Hq, D]`` over ``cache``: what every kernel computes.

    ``tile_tokens``: KV tile (a multiple of the format's pack block: 16, or 32 for INT2).
    ``num_splits``: split-KV count per sequence (tiles dealt out in contiguous runs; empty splits
    are allowed). ``dtype``: accumulation dtype (float64 or float32). ``operand_dtype``: round the
    tensor-core operands to this dtype (``torch.bfloat16`` emulates the Hopper/Triton kernels);
    ``None`` keeps them exact and builds them with the cache's mapping (``0x4300 | q`` = ``q + 128``).
    With a BF16/FP16 operand dtype the codes are injected as the kernels do it, into the top mantissa
    bits (``y = q + 2^bits``, :func:`foscar.format.operand_for`). ``pv_operand_dtype`` (default:
    ``operand_dtype``): the PV product's operands; ``torch.float16`` rounds ``P s'`` to FP16 after
    scaling it by a power of two per tile (the Triton kernel on the GPU: 8x finer than BF16).
    ``torch.float8_e4m3fn`` (for either product; it needs ``operand_terms``) emulates an FP8 wgmma
    kernel: codes placed as E4M3 ``q 2^-9``, the other operand split into ``operand_terms`` E4M3 terms
    (see the module docstring, :mod:`foscar.e4m3`): 3 terms measure below the error of BF16 operands, 2
    below BF16 attention's, and 1 is several percent of output error (a study option: never a kernel's
    numerics). ``q_terms``, how token-wise K's query takes its E4M3 terms: ``"columns"`` (a power of two per
    query row, each term scaled by ``16^k`` before its rounding, as the kernels with the terms in separate
    columns), ``"stacked"`` (each term rounded where it sits, :func:`foscar.e4m3.split_terms`'s ``in_place``:
    the terms stacked along the contraction, ``foscar.cute.config.STACKED_TERMS``), ``"stacked_kv_head"``
    (and one power of two per KV head, ``SHARED_Q_SCALE``) or ``"digits"`` (integer digits in base 16 in separate
    columns, :func:`foscar.e4m3.split_digits`: ``k_operand="e4m3d4"``'s four, each product exact in the FP8
    accumulation). The sink and recent windows are attended with BF16
    operands, the query as two BF16 terms.
    Returns ``out [B, Hq, D]`` (and ``lse [B, Hq]``, natural log). ``q [B, q_len, Hq, D]``: a step of ``q_len``
    tokens already in the cache, causal among them (:mod:`foscar.multitoken`), the KV head's rows its heads
    times the step's tokens (as the kernels take a step); ``out [B, q_len, Hq, D]``, ``lse [B, q_len, Hq]``.
    """
    T, step = 1, isinstance(q, torch.Tensor) and q.dim() == 4
    if step:  # its rows
        from .multitoken import check_step
        check_step(q, cache, read_lengths=True)
        B, T = q.shape[:2]
        q = q.reshape(B * T, *q.shape[2:])
    G, sm_scale = check_decode_inputs(q if T == 1 else q[::T], cache, sm_scale, dtype)
    if dtype is None:
        raise InvalidArgumentError("dtype", "torch.float64 or torch.float32", None)
    fmt = cache.fmt
    check_int("tile_tokens", tile_tokens, minimum=1, multiple_of=fmt.token_alignment)
    check_int("num_splits", num_splits, minimum=1)
    for name, dt in (("operand_dtype", operand_dtype), ("pv_operand_dtype", pv_operand_dtype)):
        if dt is not None and dt not in OPERAND_DTYPES or dt == E4M3 and operand_terms is None:
            raise InvalidArgumentError(name, "None, torch.bfloat16, torch.float16, torch.float32 or "
                                       "torch.float8_e4m3fn (with operand_terms)", dt)
    if pv_operand_dtype is None:
        pv_operand_dtype = operand_dtype
    if q_terms not in Q_TERMS or q_terms != "columns" and operand_dtype != E4M3:
        raise InvalidArgumentError("q_terms", f"one of {Q_TERMS} ('columns' without torch.float8_e4m3fn K operands)",
                                   q_terms)
    if operand_terms is not None:
        check_int("operand_terms", operand_terms, allowed=(1, 2, 3, 4))
        if E4M3 not in (operand_dtype, pv_operand_dtype):
            raise InvalidArgumentError("operand_terms", "None without a torch.float8_e4m3fn operand dtype",
                                       operand_terms)
    q_in = q if fmt.rotation is None else rotate(q.to(dtype), fmt)  # rotated in the accumulation dtype
    out, lse = folded(q_in, cache, G, sm_scale, tile_tokens=tile_tokens, num_splits=num_splits,
                      dtype=dtype, operand_dtype=operand_dtype, pv_operand_dtype=pv_operand_dtype,
                      operand_terms=operand_terms, q_terms=q_terms, q_len=T)
    out = rotate(out, fmt, inverse=True)  # a rotated cache: the query rotated in, the output back out
    if cache.k_mean is not None:  # centred keys: the scores' shift back into the LSE (foscar.centring)
        from .centring import lse_correction
        lse = lse + lse_correction(q, cache.k_mean.repeat_interleave(T, 0), sm_scale, lse.dtype)
    if step:
        out, lse = out.view(-1, T, *out.shape[1:]), lse.view(-1, T, lse.shape[1])
    return (out, lse) if return_lse else out


def folded(q: torch.Tensor, cache: QuantKVCache, G: int, sm_scale: float, *, tile_tokens: int = 64,
           num_splits: int = 1, dtype: torch.dtype = torch.float64, operand_dtype: torch.dtype | None = None,
           pv_operand_dtype: torch.dtype | None = None, operand_terms: int | None = None, q_terms: str = "columns",
           q_len: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_folded` of validated arguments (``G`` query heads per KV head) in the cache's space (a
    rotated cache's query already rotated, its output not rotated back): ``(out, lse)``. ``q_len > 1``: ``q``,
    ``out`` and ``lse`` are the rows ``[B q_len, ...]`` of steps of ``q_len`` tokens (:mod:`foscar.multitoken`).
    An FP4 block format: :func:`foscar.fold_fp4.folded_fp4`."""
    if cache.fmt.is_fp4:
        if E4M3 in (operand_dtype, pv_operand_dtype):
            raise UnsupportedError(f"operand_dtype={operand_dtype}, pv_operand_dtype={pv_operand_dtype}",
                                   f"the {cache.fmt.scheme} spec takes BF16, FP16, FP32 or exact operands")
        from .fold_fp4 import folded_fp4
        return folded_fp4(q, cache, G, sm_scale, tile_tokens=tile_tokens, num_splits=num_splits, dtype=dtype,
                          operand_dtype=operand_dtype, pv_operand_dtype=pv_operand_dtype, q_len=q_len)
    B, Hkv, D = cache.batch_size, cache.num_kv_heads, cache.head_dim
    T = q_len
    out = torch.empty(B * T, Hkv * G, D, dtype=dtype, device=q.device)
    lse = torch.empty(B * T, Hkv * G, dtype=dtype, device=q.device)
    view = causal_view(cache, T)  # each step token's cache (one token: the cache's)
    for b in range(B):
        seq = _FoldedSequence(cache, b, dtype, operand_dtype, pv_operand_dtype, operand_terms, q_terms)
        step = SequenceStep(view, b, T, G)
        Qt = seq.rnd(step.rows(q[b * T:(b + 1) * T].to(dtype)))
        n_tiles = -(-seq.n_quant // tile_tokens)
        outs, lses = [], []
        for tiles in split_ranges(n_tiles, num_splits):  # the split rule every kernel follows
            o, l_ = seq.split(Qt, tiles, tile_tokens, sm_scale, step)
            outs.append(o)
            lses.append(l_)
        o, l_ = step.attend_windows(seq.window_query(Qt), sm_scale, dtype)  # each token's BF16 sink + recent
        outs.append(o)
        lses.append(l_)
        o, l_ = combine_partials(outs, lses)
        out[b * T:(b + 1) * T], lse[b * T:(b + 1) * T] = step.unrows(o), step.unrows(l_)
    return out, lse
