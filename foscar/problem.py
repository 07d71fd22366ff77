"""One decode call, validated once: :class:`DecodeProblem`.

:func:`foscar.decode`, :func:`foscar.plan` and the backends' own entry points build it with
:meth:`DecodeProblem.build` (every argument checked, in foscar's words); a backend's ``run`` then takes it
as it is and checks nothing again. Its checks are :func:`foscar._checks.check_decode_inputs` and
:func:`foscar._checks.decode_out_buffers`, which the oracle and the folded spec share.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_decode_inputs, check_num_splits, decode_out_buffers
from .backends.base import ProblemKey
from .cache import QuantKVCache


@dataclass(frozen=True)
class DecodeProblem:
    """A validated decode of ``q [B, Hq, D]`` over ``cache`` into ``out`` (and ``lse`` when wanted)."""

    q: torch.Tensor
    cache: QuantKVCache
    out: torch.Tensor
    lse: torch.Tensor | None
    sm_scale: float
    num_splits: int | None
    gqa: int  # query heads per KV head
    #: a step of q_len tokens per sequence (:mod:`foscar.multitoken`): ``q``, ``out`` and ``lse`` are its rows
    #: ``[B q_len, ...]``, over the cache as it is (for a backend whose ``steps`` says it takes them)
    q_len: int = 1

    @classmethod
    def build(cls, q: torch.Tensor, cache: QuantKVCache, *, sm_scale: float | None = None,
              out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
              num_splits: int | None = None) -> DecodeProblem:
        gqa, sm_scale = check_decode_inputs(q, cache, sm_scale)
        num_splits = check_num_splits(num_splits)
        out, lse = decode_out_buffers(q, out, lse, return_lse)
        return cls(q, cache, out, lse, sm_scale, num_splits, gqa)

    @property
    def fmt(self):
        return self.cache.fmt

    def in_cache_space(self) -> DecodeProblem:
        """The problem the backends solve: with a rotation (:attr:`foscar.KVFormat.rotation`) the query
        rotated as the cache's K and V are (``q R``) into a new output in that space (the LSE is the same:
        ``q R (k R)^T = q k^T``); without one, this problem. :meth:`finish` then rotates the output back."""
        if self.cache.fmt.rotation is None:
            return self
        from .rotation import rotate
        work = torch.float64 if self.q.dtype == torch.float64 else torch.float32
        return DecodeProblem(rotate(self.q, self.cache.fmt, work=work), self.cache, torch.empty_like(self.out),
                             self.lse, self.sm_scale, self.num_splits, self.gqa, self.q_len)

    def finish(self, solved: DecodeProblem, lse_wanted: bool = True) -> None:
        """This problem's output from the one :meth:`in_cache_space` gave, once solved (``out R^T``), and
        for centred keys (:mod:`foscar.centring`) the LSE corrected by ``sm_scale q mu`` where the caller
        takes it (``lse_wanted``)."""
        if solved is not self:
            from .rotation import rotate
            work = torch.float64 if self.out.dtype == torch.float64 else torch.float32
            self.out.copy_(rotate(solved.out, self.cache.fmt, inverse=True, work=work))
        if lse_wanted and self.lse is not None and self.cache.k_mean is not None:
            from .centring import add_lse_correction
            mean = self.cache.k_mean if self.q_len == 1 else self.cache.k_mean.repeat_interleave(self.q_len, 0)
            add_lse_correction(self.lse, self.q, mean, self.sm_scale)

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def q_heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.cache.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.q.shape[2]

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def key(self) -> ProblemKey:
        return ProblemKey(self.q.device, self.cache.fmt, self.gqa, self.cache.page_size)
