"""Decode steps of several query tokens per sequence (speculative verification, multi-token prediction):
``q [B, q_len, Hq, D]``, the step's ``q_len`` tokens appended to the cache first, as serving engines do, and
token ``j`` of a step attending to the cache up to itself: the first ``L - q_len + 1 + j`` of the
sequence's ``L`` tokens (causal among the new tokens), each as a one-token decode at that length reads it. A cache
with a BF16 recent ring (a recent window, or a channel-wise axis's incomplete group) holds the newest tokens in
BF16 and moves them on to the pages as the sequence grows; token ``j`` reads the window of its own length, which
the ring still holds where its format keeps ``q_len - 1`` slots more (``KVFormat.rollback``, :func:`check_ring`):
a step is then the one-token decodes of its tokens, and speculative decoding is plain decoding's.

A backend whose ``steps`` says so takes the step as it is (:func:`step_problem`: a problem of the step's
rows ``[B q_len, ...]`` over the cache, ``q_len`` set). Elsewhere the step runs as one decode of
``B * q_len`` single-token rows over a view of the cache (:func:`causal_view`): row ``(b, j)`` is sequence
``b`` cut at ``L_b - q_len + 1 + j`` tokens, its pages and ring the same (no code is copied). Every backend
serves that as it serves one token, and a CUDA graph captures it (the view's lengths and page table are
made on the device); it reads the cache once per token of the step.
"""
from __future__ import annotations

import copy
import math

import torch

from ._checks import check_tensor
from .cache import PageTable, QuantKVCache
from .errors import InvalidArgumentError, UnsupportedError


class SequenceStep:
    """A step of ``q_len`` tokens (one token: ``q_len`` 1) of sequence ``b`` as the folded specs take it
    (:func:`foscar.fold.folded`): the step's query rows of a KV head, ``[Hkv, q_len G, D]`` with row ``j G + g``
    query head ``kvh G + g`` of step token ``j``. Row ``j`` reads the cache at its length ``L_j = L - q_len + 1 + j``
    (``view``: the cache's :func:`causal_view`, made once for every sequence): of the quantized tokens (positions
    ``n_sink ..``) the first :attr:`quantized_seen`, ``n_quant(L_j)``, then the BF16 windows of that length
    (:meth:`window`: the sink, and the ring's tokens from ``n_quant(L_j)``)."""

    def __init__(self, view: QuantKVCache, b: int, q_len: int, G: int):
        self.q_len, self.G, self.Hkv = q_len, G, view.num_kv_heads
        self.view, self.rows0 = view, b * q_len  # row j: the view's row b q_len + j
        lengths = view.seq_lens[self.rows0:self.rows0 + q_len].long().cpu()
        #: quantized tokens each row sees, ``[q_len G]``
        self.quantized_seen = view.fmt.split_length(lengths)[1].repeat_interleave(G).to(view.device)

    def rows(self, q: torch.Tensor) -> torch.Tensor:
        """The step's queries ``q [q_len, Hq, D]`` as rows of their KV heads, ``[Hkv, q_len G, D]``."""
        T, _, D = q.shape
        return q.reshape(T, self.Hkv, self.G, D).transpose(0, 1).reshape(self.Hkv, T * self.G, D)

    def unrows(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``[Hkv, q_len G, ...]`` back as the step's ``[q_len, Hq, ...]``."""
        T, rest = self.q_len, x.shape[2:]
        return x.reshape(self.Hkv, T, self.G, *rest).transpose(0, 1).reshape(T, self.Hkv * self.G, *rest)

    def mask(self, s: torch.Tensor, t0: int) -> torch.Tensor:
        """Scores ``s [Hkv, q_len G, n]`` of the quantized tokens ``t0 ..`` with ``-inf`` where a row does not
        see the token."""
        seen = torch.arange(t0, t0 + s.shape[-1], device=s.device)[None, :] < self.quantized_seen[:, None]
        return s.masked_fill(~seen[None], -math.inf)

    def window(self, tensor: str, j: int) -> torch.Tensor:
        """Step token ``j``'s BF16 tokens of ``tensor`` (``"k"``, ``"v"``), ``[Hkv, n, D]``: its length's sink and
        ring (:meth:`foscar.QuantKVCache.windows` at that length)."""
        return self.view.windows(tensor, self.rows0 + j)

    def attend_windows(self, wq: torch.Tensor, sm_scale: float, dtype: torch.dtype):
        """Attention of the rows ``wq [Hkv, q_len G, D]`` over each step token's windows: ``(out, lse)``."""
        from .reference import attend
        G = self.G
        parts = [attend(wq[:, j * G:(j + 1) * G], self.window("k", j).to(dtype), self.window("v", j).to(dtype),
                        sm_scale) for j in range(self.q_len)]
        return torch.cat([o for o, _ in parts], 1), torch.cat([s for _, s in parts], 1)


def ring_serves(fmt, q_len: int) -> bool:
    """Whether ``fmt``'s BF16 recent ring keeps the windows of a step of ``q_len`` tokens (``q_len - 1`` slots
    beyond its window: ``KVFormat.rollback``); a format without a ring serves every step."""
    return q_len <= 1 or not fmt.recent_capacity or fmt.rollback >= q_len - 1


def check_ring(cache: QuantKVCache, q_len: int, read_lengths: bool = True) -> None:
    """That a step of ``q_len`` tokens can read each token's window from ``cache``'s BF16 recent ring (a cache without
    one: nothing to check): the format keeps ``q_len - 1`` slots more (``KVFormat.rollback``), and where
    ``read_lengths``, every sequence's ring still holds the window of the step's first token (``ring_from``: the
    step's tokens appended first, as every write path does; a cache built by ``from_quantized`` holds its window
    alone)."""
    fmt = cache.fmt
    if q_len <= 1 or not fmt.recent_capacity:
        return
    if not ring_serves(fmt, q_len):
        raise UnsupportedError(f"q_len={q_len} with recent={fmt.recent}, flush={fmt.flush}, rollback={fmt.rollback}",
                               "a step over a BF16 recent ring reads each token's window as it was at that token: "
                               f"the ring keeps them with KVFormat(rollback >= {q_len - 1})")
    if read_lengths and cache.ring_from is not None:
        first = fmt.split_length((cache.seq_lens.long() - (q_len - 1)).clamp_min(0).cpu())[1]
        bad = (first < cache.ring_from.long().cpu()).nonzero()
        if bad.numel():
            b = int(bad[0])
            raise InvalidArgumentError("cache", f"a ring that holds the windows of the step's tokens (appended "
                                       f"through foscar's write paths) at sequence {b}",
                                       f"its ring from post-sink position {int(cache.ring_from[b])}")


def causal_view(cache: QuantKVCache, q_len: int) -> QuantKVCache:
    """``cache`` as ``B * q_len`` sequences, row ``b * q_len + j`` sequence ``b`` cut at ``L_b - q_len + 1 + j``
    tokens (at least 0), on the same pools, pages and ring (:func:`check_ring`: the ring holds each row's window)."""
    check_ring(cache, q_len, read_lengths=cache.seq_lens.device.type == "cpu" and not torch.compiler.is_compiling())
    B, T = cache.batch_size, q_len
    dev = cache.seq_lens.device
    cut = torch.arange(1 - T, 1, device=dev, dtype=cache.seq_lens.dtype)  # -(T-1) ... 0
    lens = (cache.seq_lens.view(B, 1) + cut.view(1, T)).clamp_min(0).reshape(B * T)
    pt = cache.page_table
    view = copy.copy(cache)  # a validated cache's rows: no check again (the constructor reads lengths back)
    view.seq_lens = lens
    view.page_table = PageTable(pt.block_table.repeat_interleave(T, 0), pt.num_pages.repeat_interleave(T, 0))
    for name in ("k_sink", "v_sink", "k_recent", "v_recent"):
        setattr(view, name, getattr(cache, name).repeat_interleave(T, 0))
    if cache.ring_from is not None:
        view.ring_from = cache.ring_from.repeat_interleave(T, 0)
    if cache.k_mean is not None:
        view.k_mean = cache.k_mean.repeat_interleave(T, 0)
    return view


def flatten_step(q: torch.Tensor, cache: QuantKVCache, out: torch.Tensor | None, lse: torch.Tensor | None):
    """``(q_rows [B q_len, Hq, D], view, out_rows, lse_rows)`` of a step ``q [B, q_len, Hq, D]``: the rows of
    :func:`causal_view`, and the given ``out [B, q_len, Hq, D]`` / ``lse [B, q_len, Hq]`` as their rows
    (``None`` where not given). On the CPU the lengths are checked to hold the step's tokens."""
    check_step(q, cache)
    out_rows, lse_rows = step_rows(q, out, lse)
    return q.reshape(-1, *q.shape[2:]), causal_view(cache, q.shape[1]), out_rows, lse_rows


def check_step(q: torch.Tensor, cache: QuantKVCache, read_lengths: bool | None = None) -> None:
    """A step ``q [B, q_len, Hq, D]`` for ``cache`` (its other checks are a one-token decode's), and that the
    lengths hold the step's tokens where ``read_lengths`` (default: where they live on the host, outside a
    compiled graph; the oracle reads them anyway)."""
    if not isinstance(cache, QuantKVCache):
        raise InvalidArgumentError("cache", "a foscar.QuantKVCache", type(cache).__name__)
    check_tensor("q", q, ndim=4, device=cache.device)
    B, T, Hq, D = q.shape
    if B != cache.batch_size or T < 1:
        raise InvalidArgumentError("q", f"shape ({cache.batch_size}, q_len >= 1, Hq, D) for this cache",
                                   tuple(q.shape))
    if read_lengths is None:
        read_lengths = cache.seq_lens.device.type == "cpu" and not torch.compiler.is_compiling()
    if read_lengths:
        lens = cache.seq_lens.long().cpu()
        short = (lens < T).nonzero()
        if short.numel():
            b = int(short[0])
            raise InvalidArgumentError("cache.seq_lens", f"lengths >= q_len={T}: the step's tokens appended first",
                                       f"{int(lens[b])} at sequence {b}")
    check_ring(cache, T, read_lengths)


def step_rows(q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None):
    """The given ``out [B, q_len, Hq, D]`` and ``lse [B, q_len, Hq]`` of a step as rows (``None`` where not
    given)."""
    B, T, Hq, D = q.shape
    rows = []
    for name, t, shape in (("out", out, (B, T, Hq, D)), ("lse", lse, (B, T, Hq))):
        if t is None:
            rows.append(None)
            continue
        check_tensor(name, t, shape=shape, device=q.device)
        try:
            rows.append(t.view(B * T, *shape[2:]))
        except RuntimeError as e:
            raise InvalidArgumentError(name, "a tensor whose batch and q_len dims flatten into one (e.g. "
                                       "contiguous)", tuple(t.stride())) from e
    return rows[0], rows[1]


def unflatten(result, B: int, T: int):
    """A decode's ``out`` (or ``(out, lse)``) of the rows, shaped per step token."""
    if isinstance(result, tuple):
        out, lse = result
        return out.view(B, T, *out.shape[1:]), lse.view(B, T, lse.shape[1])
    return result.view(B, T, *result.shape[1:])


def step_problem(q: torch.Tensor, cache: QuantKVCache, *, sm_scale: float | None = None, out: torch.Tensor | None = None,
                 lse: torch.Tensor | None = None, return_lse: bool = False, num_splits: int | None = None):
    """The validated :class:`~foscar.problem.DecodeProblem` of a step ``q [B, q_len, Hq, D]`` over ``cache`` as
    it is (``q_len`` set: its ``q``, ``out`` and ``lse`` are the step's rows), for a backend that takes steps."""
    from ._checks import check_decode_inputs, check_finite, check_num_splits, decode_out_buffers
    from .problem import DecodeProblem
    check_step(q, cache)
    rows_out, rows_lse = step_rows(q, out, lse)
    gqa, sm_scale = check_decode_inputs(q[:, 0], cache, sm_scale)  # a token's checks
    if q.device.type == "cpu" and not torch.compiler.is_compiling():
        check_finite("q", q)  # every token's
    rows = q.reshape(-1, *q.shape[2:])
    out_, lse_ = decode_out_buffers(rows, rows_out, rows_lse, return_lse)
    return DecodeProblem(rows, cache, out_, lse_, sm_scale, check_num_splits(num_splits), gqa, q.shape[1])
