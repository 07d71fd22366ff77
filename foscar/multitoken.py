"""Decode steps of several query tokens per sequence (speculative verification, multi-token prediction):
``q [B, q_len, Hq, D]``, the step's ``q_len`` tokens appended to the cache first, as serving engines do, and
token ``j`` of a step attending to the cache up to itself: the first ``L - q_len + 1 + j`` of the
sequence's ``L`` tokens (causal among the new tokens).

A backend whose ``steps`` says so takes the step as it is (:func:`step_problem`: a problem of the step's
rows ``[B q_len, ...]`` over the cache, ``q_len`` set): the Triton kernel, each program taking all of a KV
head's step tokens as rows, for caches without BF16 windows. Elsewhere the step runs as one decode of
``B * q_len`` single-token rows over a view of the cache (:func:`causal_view`): row ``(b, j)`` is sequence
``b`` cut at ``L_b - q_len + 1 + j`` tokens, its pages the same pages (no code is copied). Every backend
serves that as it serves one token, and a CUDA graph captures it (the view's lengths and page table are
made on the device); it reads the cache once per token of the step. A cache whose BF16 recent ring is not
empty (``KVFormat.recent_capacity``: a recent window, or the tokens of a channel-wise group not yet
complete) is refused there: its ring holds the newest tokens of the full length only.
"""
from __future__ import annotations

import copy
import math

import torch

from ._checks import check_tensor
from .cache import PageTable, QuantKVCache
from .errors import InvalidArgumentError, UnsupportedError


class SequenceStep:
    """A step of ``q_len`` tokens of sequence ``b`` as the folded specs take it (:func:`foscar.fold.folded`): the
    step's query rows of a KV head, ``[Hkv, q_len G, D]`` with row ``j G + g`` query head ``kvh G + g`` of step
    token ``j``, over the cache as it is. Row ``j`` sees the first ``L - q_len + 1 + j`` tokens of the sequence's
    ``L``, each as the cache holds it: of the quantized tokens (positions ``n_sink ..``) the first
    :attr:`quantized_seen`, of the BF16 windows (the sink, then the ring's tokens in order) a prefix,
    :attr:`window_seen`."""

    def __init__(self, cache: QuantKVCache, b: int, q_len: int, G: int):
        n_sink, n_quant, n_recent = (int(x[b]) for x in cache.split())
        self.q_len, self.G, self.Hkv = q_len, G, cache.num_kv_heads
        limit = int(cache.seq_lens[b]) - (q_len - 1) + torch.arange(q_len)  # tokens each step token sees
        #: quantized tokens each row sees, ``[q_len G]``
        self.quantized_seen = (limit - n_sink).repeat_interleave(G).to(cache.device)
        #: window tokens each step token sees (a prefix of the sink and the ring, which hold positions in order)
        self.window_seen = [min(int(n), n_sink) + min(max(int(n) - n_sink - n_quant, 0), n_recent) for n in limit]

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

    def attend_windows(self, wq: torch.Tensor, kw: torch.Tensor, vw: torch.Tensor, sm_scale: float):
        """Attention of the rows ``wq [Hkv, q_len G, D]`` over the windows' ``kw, vw [Hkv, n, D]``, each step
        token over the prefix it sees: ``(out, lse)``."""
        from .reference import attend
        G = self.G
        parts = [attend(wq[:, j * G:(j + 1) * G], kw[:, :n], vw[:, :n], sm_scale)
                 for j, n in enumerate(self.window_seen)]
        return torch.cat([o for o, _ in parts], 1), torch.cat([s for _, s in parts], 1)


def causal_view(cache: QuantKVCache, q_len: int) -> QuantKVCache:
    """``cache`` as ``B * q_len`` sequences, row ``b * q_len + j`` sequence ``b`` cut at ``L_b - q_len + 1 + j``
    tokens (at least 0), on the same pools and pages."""
    if cache.fmt.recent_capacity:
        raise UnsupportedError(f"q_len={q_len} with recent={cache.fmt.recent}, flush={cache.fmt.flush}",
                               "decode steps of several tokens take caches without a BF16 recent ring "
                               "(token-wise K and V, recent=0) for now")
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
