"""Which pages of the pool hold each sequence's quantized tokens: a vLLM-style block table or FlashInfer-style
CSR ``indptr/indices`` (with ``last_page_len``), one :class:`PageTable` either way."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_int, check_tensor
from .errors import InvalidArgumentError

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class PageTable:
    """Pages of each sequence: ``block_table[b, :num_pages[b]]`` are indices into the page pool."""

    block_table: torch.Tensor  # int32 [B, max_pages]
    num_pages: torch.Tensor  # int32 [B]
    #: FlashInfer's ``page_size*(pages-1) + last_page_len`` when given: the caller's quantized lengths,
    #: checked against ``KVFormat.split_length(seq_lens)`` by the cache.
    quantized_lens: torch.Tensor | None = None
    page_size: int | None = None

    def __post_init__(self):
        check_tensor("block_table", self.block_table, ndim=2, dtypes=INDEX_DTYPES)
        check_tensor("num_pages", self.num_pages, shape=(self.block_table.shape[0],), dtypes=INDEX_DTYPES,
                     device=self.block_table.device)

    @classmethod
    def from_block_table(cls, block_table: torch.Tensor, num_pages: torch.Tensor | None = None) -> PageTable:
        """vLLM-style block table ``[B, max_pages]``; ``num_pages[b]`` valid entries (default: all)."""
        check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES)
        B = block_table.shape[0]
        if num_pages is None:
            num_pages = torch.full((B,), block_table.shape[1], dtype=torch.int32, device=block_table.device)
        check_tensor("num_pages", num_pages, shape=(B,), dtypes=INDEX_DTYPES, device=block_table.device)
        if B and (int(num_pages.min()) < 0 or int(num_pages.max()) > block_table.shape[1]):
            raise InvalidArgumentError("num_pages", f"counts in [0, {block_table.shape[1]}]", num_pages.tolist())
        return cls(block_table.to(torch.int32), num_pages.to(torch.int32))

    @classmethod
    def from_csr(cls, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor | None = None,
                 page_size: int | None = None) -> PageTable:
        """FlashInfer-style CSR: pages of sequence ``b`` are ``indices[indptr[b]:indptr[b+1]]``.

        With ``last_page_len`` (and ``page_size``), the quantized length of sequence ``b`` is
        ``page_size*(pages - 1) + last_page_len[b]`` as in FlashInfer; the cache checks it against the
        lengths it is given (with no BF16 windows and token-wise axes it equals ``seq_lens``).
        """
        check_tensor("indptr", indptr, ndim=1, dtypes=INDEX_DTYPES)
        check_tensor("indices", indices, ndim=1, dtypes=INDEX_DTYPES, device=indptr.device)
        if indptr.numel() < 1:
            raise InvalidArgumentError("indptr", "a tensor of B+1 offsets", "an empty tensor")
        ip = indptr.long().cpu()
        if int(ip[0]) != 0 or bool((ip[1:] < ip[:-1]).any()) or int(ip[-1]) > indices.numel():
            raise InvalidArgumentError("indptr", f"non-decreasing offsets from 0 to at most len(indices)={indices.numel()}",
                                       ip.tolist())
        counts = ip[1:] - ip[:-1]
        B = counts.numel()
        width = max(1, int(counts.max()) if B else 1)
        col = torch.arange(width)
        valid = col[None, :] < counts[:, None]
        src = (ip[:-1, None] + col[None, :]).clamp(max=max(indices.numel() - 1, 0))
        table = torch.where(valid, indices.long().cpu()[src] if indices.numel() else torch.zeros_like(src),
                            torch.zeros_like(src))
        dev = indptr.device
        qlens = None
        if last_page_len is not None:
            check_int("page_size", page_size, minimum=1)
            check_tensor("last_page_len", last_page_len, shape=(B,), dtypes=INDEX_DTYPES, device=dev)
            lp = last_page_len.long().cpu()
            bad = ((counts > 0) & ((lp < 1) | (lp > page_size))) | ((counts == 0) & (lp != 0))
            if bad.any():
                b = int(bad.nonzero()[0])
                raise InvalidArgumentError("last_page_len", f"values in [1, page_size={page_size}] (0 for a "
                                           "sequence without pages)", f"{int(lp[b])} for sequence {b}")
            qlens = torch.where(counts > 0, page_size * (counts - 1) + lp, 0).to(torch.int32).to(dev)
        elif page_size is not None:
            raise InvalidArgumentError("page_size", "None unless last_page_len is given", page_size)
        return cls(table.to(torch.int32).to(dev), counts.to(torch.int32).to(dev), qlens, page_size)

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    def pages_of(self, b: int) -> torch.Tensor:
        return self.block_table[b, : int(self.num_pages[b])].long()
