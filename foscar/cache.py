"""Quantized KV-cache containers: paged (block table or CSR, like FlashInfer/vLLM) and contiguous.

Each sequence of ``L`` tokens is stored in three parts (``KVFormat.split_length``)::

    [ sink: BF16 | quantized: packed codes + (s', z') in pages | recent: BF16 ring ]

The quantized part lives in a pool of pages shared by the batch: codes ``[pages, Hkv, W]`` (int32
words, ``W = page_size*D*bits/32``, layout ``LAYOUT_TAG``) and parameters
``[pages, Hkv, rows, cols, 2]`` (FP32 ``(s', z')`` pairs, rows/cols from ``KVFormat.param_shape``); an FP4
format (:mod:`foscar.fp4`) stores E2M1 codes in the same words and its block-scale bytes as the parameters,
uint8 ``[pages, Hkv, page_size, D/block]``, with the per-tensor FP32 scales of K and V in ``tensor_scales
[2]`` (NVFP4; 1 otherwise).
Page ``j`` of a sequence holds its quantized tokens ``[j*page_size, (j+1)*page_size)``. A contiguous
cache is the same thing with one page per sequence (``page_size`` = capacity, identity table).

The BF16 windows are per sequence: ``sink [B, Hkv, sink, D]`` holds the first tokens and
``recent [B, Hkv, recent_capacity, D]`` is a ring: the token at position ``n_sink + r`` sits in slot
``r % recent_capacity``.
"""
from __future__ import annotations

import math

import torch

from ._checks import check_finite, check_int, check_tensor, same_device
from .errors import InvalidArgumentError, UnsupportedError
from .centring import check_key_mean
from .format import CHANNEL, TOKEN, KVFormat, pack_codes, unpack_codes
from .pagetable import INDEX_DTYPES, PageTable
from .quantize import DEFAULT_QUANTILE
from .rotation import rotate

WINDOW_DTYPES = (torch.bfloat16, torch.float16)
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
#: A contiguous cache's capacity is a multiple of this (and of the format's alignment): whole 64-token
#: tiles, the unit the CuTe kernels copy (one TMA box per tile), so every backend reads it.
CONTIGUOUS_TILE = 64


def _contiguous_alignment(fmt: KVFormat) -> int:
    """A contiguous cache's capacity step: whole pack blocks, whole channel-wise groups, whole
    :data:`CONTIGUOUS_TILE` tiles."""
    align = math.lcm(fmt.token_alignment, CONTIGUOUS_TILE)
    return math.lcm(align, fmt.group_size) if CHANNEL in (fmt.k_axis, fmt.v_axis) else align


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class QuantKVCache:
    """A quantized K/V cache (one attention layer). Build it with :func:`quantize_kv` or
    :meth:`from_quantized`; read it with :meth:`dequantize`, :meth:`export` or a decode call.
    ``k_mean``: the keys' centring mean (:mod:`foscar.centring`; ``None``: not centred), pending until
    the first append when ``k_mean_pending``. ``k_weights``: the weights of the keys' query-weighted rounding
    (:mod:`foscar.key_weights`, ``[B, Hkv, D, D]`` in the stored space; ``None``: round to nearest)."""

    k_mean: torch.Tensor | None = None
    k_mean_pending: bool = False
    k_weights: torch.Tensor | None = None
    ring_from: torch.Tensor | None = None  # set by the constructor (a cache a compiled graph rebuilds: unknown)

    def __init__(self, fmt: KVFormat, *, k_codes, k_params, v_codes, v_params, seq_lens, page_table: PageTable,
                 k_sink, v_sink, k_recent, v_recent, contiguous: bool = False, tensor_scales=None):
        if not isinstance(fmt, KVFormat):
            raise InvalidArgumentError("fmt", "a foscar.KVFormat", type(fmt).__name__)
        if not isinstance(page_table, PageTable):
            raise InvalidArgumentError("page_table", "a foscar.PageTable", type(page_table).__name__)
        self.fmt = fmt
        D = fmt.head_dim
        check_tensor("k_codes", k_codes, ndim=3, dtypes=(torch.int32,), contiguous=True)
        P, H, W = k_codes.shape
        dev = k_codes.device
        page_size = W * 32 // (D * fmt.bits)
        if page_size * D * fmt.bits != W * 32 or page_size == 0:
            raise InvalidArgumentError("k_codes", f"a last dim that is page_size*{D}*{fmt.bits}/32", W)
        fmt.check_page_size(page_size, name="k_codes page_size")
        check_tensor("v_codes", v_codes, shape=(P, H, W), dtypes=(torch.int32,), device=dev, contiguous=True)
        for name, t, tensor in (("k_params", k_params, "k"), ("v_params", v_params, "v")):
            rows, cols = fmt.param_shape(tensor, page_size)
            shape, dtype = ((P, H, rows, cols), torch.uint8) if fmt.is_fp4 else ((P, H, rows, cols, 2), torch.float32)
            check_tensor(name, t, shape=shape, dtypes=(dtype,), device=dev, contiguous=True)
        if tensor_scales is None:
            tensor_scales = torch.ones(2, dtype=torch.float32, device=dev)
        check_tensor("tensor_scales", tensor_scales, shape=(2,), dtypes=(torch.float32,), device=dev)
        check_finite("tensor_scales", tensor_scales)
        if not bool((tensor_scales > 0).all()) or (not fmt.fp4_spec or not fmt.fp4_spec.tensor_scale) and bool(
                (tensor_scales != 1).any()):
            raise InvalidArgumentError("tensor_scales", "positive per-tensor scales of K and V (1 unless NVFP4)",
                                       tensor_scales.tolist())
        check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=dev)
        B = seq_lens.shape[0]
        if B and int(seq_lens.min()) < 0:
            raise InvalidArgumentError("seq_lens", "lengths >= 0", seq_lens.tolist())
        if page_table.batch_size != B:
            raise InvalidArgumentError("page_table", f"{B} sequences (len(seq_lens))", page_table.batch_size)
        if not same_device(page_table.block_table.device, dev):
            raise InvalidArgumentError("page_table", f"tensors on {dev}", f"tensors on {page_table.block_table.device}")
        for name, t, n in (("k_sink", k_sink, fmt.sink), ("v_sink", v_sink, fmt.sink),
                           ("k_recent", k_recent, fmt.recent_capacity), ("v_recent", v_recent, fmt.recent_capacity)):
            check_tensor(name, t, shape=(B, H, n, D), dtypes=WINDOW_DTYPES, device=dev)
        for name, t in (("v_sink", v_sink), ("k_recent", k_recent), ("v_recent", v_recent)):
            if t.dtype != k_sink.dtype:
                raise InvalidArgumentError(name, f"the dtype of k_sink ({k_sink.dtype})", t.dtype)
        self.k_codes, self.v_codes = k_codes, v_codes
        self.k_params, self.v_params = k_params, v_params
        self.tensor_scales = tensor_scales
        self.k_sink, self.v_sink, self.k_recent, self.v_recent = k_sink, v_sink, k_recent, v_recent
        self.seq_lens = seq_lens.to(torch.int32)
        self.page_table = page_table
        self.page_size = page_size
        self.contiguous = contiguous
        self._check_pages()
        #: per sequence, the oldest post-sink position whose BF16 value the recent ring still holds (the window's
        #: start as built; appends move it on, :meth:`advance_ring`): how far :meth:`rewind` can go back
        self.ring_from = fmt.split_length(self.seq_lens)[1].to(torch.int32)

    # ---- shape facts -----------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def table_capacity(self) -> int:
        """Quantized tokens per sequence the block table can address (its width times the page size): a
        host fact, what launch configs and tuned-config buckets are chosen from."""
        return self.page_table.block_table.shape[1] * self.page_size

    @property
    def num_kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def num_pool_pages(self) -> int:
        return self.k_codes.shape[0]

    @property
    def head_dim(self) -> int:
        return self.fmt.head_dim

    @property
    def device(self) -> torch.device:
        return self.k_codes.device

    @property
    def window_dtype(self) -> torch.dtype:
        return self.k_sink.dtype

    def split(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(n_sink, n_quant, n_recent)``, int64 tensors of shape ``[B]``."""
        return self.fmt.split_length(self.seq_lens.long())

    def _check_pages(self) -> None:
        pt = self.page_table
        _, n_quant, _ = self.split()
        if pt.page_size is not None and pt.page_size != self.page_size:
            raise InvalidArgumentError("page_table", f"page_size {self.page_size} (the cache's)", pt.page_size)
        if pt.quantized_lens is not None and not torch.equal(pt.quantized_lens.long().cpu(), n_quant.cpu()):
            raise InvalidArgumentError("page_table", "last_page_len consistent with seq_lens (quantized lengths "
                                       f"{n_quant.tolist()})", pt.quantized_lens.tolist())
        need = torch.div(n_quant + self.page_size - 1, self.page_size, rounding_mode="floor").cpu()
        have = pt.num_pages.long().cpu()
        short = (need > have).nonzero()
        if short.numel():
            b = int(short[0])
            raise InvalidArgumentError(
                "seq_lens", f"lengths that fit the pages given (sequence {b}: {int(need[b])} pages of "
                f"{self.page_size} for {int(n_quant[b])} quantized tokens)", f"{int(have[b])} pages")
        self._check_page_indices(need)

    def _check_page_indices(self, need: torch.Tensor) -> None:
        """The first ``need[b]`` page-table entries of every sequence ``b`` index the pool."""
        table = self.page_table.block_table.long().cpu()
        valid = torch.arange(table.shape[1])[None, :] < need[:, None]
        bad = valid & ((table < 0) | (table >= self.num_pool_pages))
        if bad.any():
            b, j = bad.nonzero()[0].tolist()
            raise InvalidArgumentError("page_table", f"page indices in [0, {self.num_pool_pages})",
                                       f"{int(table[b, j])} at sequence {b}, page {j}")

    # ---- reading the quantized part ----------------------------------------------------------
    def _codes(self, tensor: str) -> torch.Tensor:
        return self.k_codes if tensor == "k" else self.v_codes

    def _params(self, tensor: str) -> torch.Tensor:
        return self.k_params if tensor == "k" else self.v_params

    def quantized_pages(self, b: int) -> torch.Tensor:
        """Pool indices of the pages sequence ``b``'s quantized tokens occupy, in token order."""
        n_quant = int(self.split()[1][b])
        return self.page_table.pages_of(b)[: -(-n_quant // self.page_size)]

    def quantized_words(self, tensor: str, b: int) -> torch.Tensor:
        """Packed words of sequence ``b``'s quantized tokens, pages concatenated: ``[Hkv, n_pages*W]``."""
        pages = self.quantized_pages(b)
        words = self._codes(tensor)[pages]  # [n, H, W]
        return words.permute(1, 0, 2).reshape(self.num_kv_heads, -1)

    def quantized_params(self, tensor: str, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 ``(s', z')`` of sequence ``b``: ``[Hkv, n_quant, D/g]`` (token-wise) or ``[Hkv, n_quant/g, D]``;
        an FP4 format's block scales times the tensor's scale (float64, exact) and zeros."""
        fmt, page = self.fmt, self.page_size
        n_quant = int(self.split()[1][b])
        pages = self.quantized_pages(b)
        if fmt.is_fp4:
            from .fp4 import decode_scale
            s = decode_scale(self.quantized_scales(tensor, b), fmt.fp4_spec) * self.tensor_scale(tensor)
            return s, torch.zeros_like(s)
        par = self._params(tensor)[pages].permute(1, 0, 2, 3, 4)  # [H, n, rows, cols, 2]
        H = self.num_kv_heads
        if fmt.axis(tensor) == TOKEN:
            par = par.reshape(H, -1, par.shape[-2], 2)[:, :n_quant]
        else:
            g = fmt.group_size
            if page < g:  # one replicated row per page: take each group's first page
                par = par[:, :: g // page]
            par = par.reshape(H, -1, par.shape[-2], 2)[:, : n_quant // g]
        return par[..., 0], par[..., 1]

    def quantized_scales(self, tensor: str, b: int) -> torch.Tensor:
        """An FP4 format's block-scale bytes of sequence ``b``: uint8 ``[Hkv, n_quant, D/block]``."""
        n_quant = int(self.split()[1][b])
        par = self._params(tensor)[self.quantized_pages(b)]  # [n, H, page, D/block]
        return par.permute(1, 0, 2, 3).reshape(self.num_kv_heads, -1, par.shape[-1])[:, :n_quant]

    def tensor_scale(self, tensor: str) -> float:
        """The per-tensor scale of ``tensor`` (NVFP4's FP32 scale; 1 for the other formats)."""
        return float(self.tensor_scales[int(tensor == "v")])

    def quantized_codes(self, tensor: str, b: int) -> torch.Tensor:
        """Logical codes of sequence ``b``'s quantized tokens: int32 ``[Hkv, n_quant, D]``."""
        n_quant = int(self.split()[1][b])
        return unpack_codes(self.quantized_words(tensor, b), self.fmt.bits, tensor, self.head_dim)[:, :n_quant]

    def windows(self, tensor: str, b: int) -> torch.Tensor:
        """The BF16 tokens of sequence ``b`` (sink then recent, in token order): ``[Hkv, n, D]``."""
        n_sink, n_quant, n_recent = (int(x[b]) for x in self.split())
        sink = (self.k_sink if tensor == "k" else self.v_sink)[b, :, :n_sink]
        ring = self.k_recent if tensor == "k" else self.v_recent
        cap = self.fmt.recent_capacity
        slots = (n_quant + torch.arange(n_recent, device=self.device)) % max(cap, 1)
        return torch.cat([sink, ring[b][:, slots]], dim=1)

    # ---- whole-cache views -------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``K, V [B, Hkv, max_len, D]`` in token order (zeros past each length).

        A quantized value is ``s' * y + z'`` with ``y`` the operand built from its code, evaluated in
        float64 (exact for FP32 ``s', z'``), then cast to ``dtype``. With a rotation the values are
        rotated back (``x_stored R^T``, in float64) and centred keys get their mean back
        (:mod:`foscar.centring`): the values as they were given.
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidArgumentError("dtype", "a floating-point torch.dtype", dtype)
        B, H, D = self.batch_size, self.num_kv_heads, self.head_dim
        L = int(self.seq_lens.max()) if B else 0
        out = []
        for tensor in ("k", "v"):
            dense = torch.zeros(B, H, L, D, dtype=torch.float64, device=self.device)
            for b in range(B):
                n_sink, n_quant, n_recent = (int(x[b]) for x in self.split())
                win = self.windows(tensor, b).double()
                dense[b, :, :n_sink] = win[:, :n_sink]
                dense[b, :, n_sink + n_quant: n_sink + n_quant + n_recent] = win[:, n_sink:]
                if n_quant:
                    dense[b, :, n_sink: n_sink + n_quant] = self._dequantize_seq(tensor, b)
            dense = rotate(dense, self.fmt, inverse=True)
            if tensor == "k" and self.k_mean is not None:  # centred keys: the mean back (within each length)
                n = self.seq_lens.long()
                valid = (torch.arange(L, device=self.device)[None, :] < n[:, None]).double()[:, None, :, None]
                dense = dense + valid * self.k_mean.double()[:, :, None, :]
            out.append(dense.to(dtype))
        return out[0], out[1]

    def _dequantize_seq(self, tensor: str, b: int) -> torch.Tensor:
        fmt = self.fmt
        y = fmt.values(self.quantized_codes(tensor, b))  # [H, n, D], float64
        sp, zp = self.quantized_params(tensor, b)
        g = fmt.group_size
        sp, zp = sp.double(), zp.double()
        if fmt.axis(tensor) == TOKEN:
            sp, zp = sp.repeat_interleave(g, dim=-1), zp.repeat_interleave(g, dim=-1)
        else:
            sp, zp = sp.repeat_interleave(g, dim=-2), zp.repeat_interleave(g, dim=-2)
        return sp * y + zp

    def export(self) -> dict:
        """Logical contents for interop, nothing lost (:func:`foscar.cache_io.export`)."""
        from .cache_io import export
        return export(self)

    # ---- building ----------------------------------------------------------------------------
    @classmethod
    def _allocate(cls, fmt: KVFormat, *, seq_lens: torch.Tensor, num_kv_heads: int, page_size: int | None,
                  page_table: PageTable | None, num_pages: int | None, window_dtype: torch.dtype,
                  device: torch.device, size_name: str = "seq_lens", tensor_scales=None) -> QuantKVCache:
        """An all-zero cache with room for ``seq_lens``; the quantized parts are then written. An allocation
        the device refuses is an error naming ``size_name``, the argument that sized it. ``tensor_scales``:
        NVFP4's per-tensor scales of K and V (floats; default 1)."""
        B, H, D = seq_lens.shape[0], num_kv_heads, fmt.head_dim
        _, n_quant, _ = fmt.split_length(seq_lens.long())
        max_q = int(n_quant.max()) if B else 0
        contiguous = page_size is None
        if contiguous:
            if page_table is not None or num_pages is not None:
                raise InvalidArgumentError("page_table/num_pages", "None for a contiguous cache (page_size=None)",
                                           f"page_table={type(page_table).__name__}, num_pages={num_pages!r}")
            page_size = _round_up(max(max_q, 1), _contiguous_alignment(fmt))
            page_table = PageTable.from_block_table(torch.arange(B, dtype=torch.int32, device=device)[:, None])
            num_pages = B
        else:
            fmt.check_page_size(page_size)
            need = [-(-int(n) // page_size) for n in n_quant.tolist()]
            if page_table is None:
                starts = torch.tensor([0] + need, dtype=torch.int64).cumsum(0)
                width = max(need + [1])
                table = torch.zeros(B, width, dtype=torch.int32)
                for b in range(B):
                    table[b, : need[b]] = torch.arange(int(starts[b]), int(starts[b + 1]), dtype=torch.int32)
                page_table = PageTable.from_block_table(table.to(device), torch.tensor(need, dtype=torch.int32,
                                                                                          device=device))
                num_pages = max(int(starts[-1]), 1) if num_pages is None else num_pages
            elif num_pages is None:
                raise InvalidArgumentError("num_pages", "the size of the page pool when a page_table is given", None)
            if page_table.batch_size != B:
                raise InvalidArgumentError("page_table", f"{B} sequences (len(seq_lens))", page_table.batch_size)
            if not same_device(page_table.block_table.device, device):
                raise InvalidArgumentError("page_table", f"tensors on {device}",
                                           f"tensors on {page_table.block_table.device}")
            check_int("num_pages", num_pages, minimum=1)
            used = torch.cat([page_table.pages_of(b)[: need[b]].cpu() for b in range(B)]) if B else torch.zeros(0)
            if used.numel() != torch.unique(used).numel():
                raise InvalidArgumentError("page_table", "distinct pages for the quantized tokens being written",
                                           "a page used twice")
        W = fmt.words_per_page("k", page_size)
        par_dtype = torch.uint8 if fmt.is_fp4 else torch.float32  # FP4: block-scale bytes
        rk, ck = fmt.param_shape("k", page_size)
        rv, cv = fmt.param_shape("v", page_size)
        shapes = {"k_codes": ((num_pages, H, W), torch.int32), "v_codes": ((num_pages, H, W), torch.int32),
                  "k_params": ((num_pages, H, rk, ck) if fmt.is_fp4 else (num_pages, H, rk, ck, 2), par_dtype),
                  "v_params": ((num_pages, H, rv, cv) if fmt.is_fp4 else (num_pages, H, rv, cv, 2), par_dtype),
                  "k_sink": ((B, H, fmt.sink, D), window_dtype), "v_sink": ((B, H, fmt.sink, D), window_dtype),
                  "k_recent": ((B, H, fmt.recent_capacity, D), window_dtype),
                  "v_recent": ((B, H, fmt.recent_capacity, D), window_dtype)}
        try:
            tensors = {n: torch.zeros(shape, dtype=dt, device=device) for n, (shape, dt) in shapes.items()}
        except (torch.OutOfMemoryError, RuntimeError) as e:  # the allocator's refusal, said by the argument
            need = sum(math.prod(shape) * dt.itemsize for shape, dt in shapes.values())
            raise InvalidArgumentError(size_name, f"a cache that {device} can allocate",
                                       f"{need / 2 ** 30:.3g} GiB ({num_pages} pages of {page_size} tokens, "
                                       f"{H} KV heads): {type(e).__name__}") from None
        scales = torch.tensor([1.0, 1.0] if tensor_scales is None else [float(x) for x in tensor_scales],
                              dtype=torch.float32, device=device)
        return cls(fmt, **tensors, seq_lens=seq_lens.to(device=device, dtype=torch.int32), page_table=page_table,
                   tensor_scales=scales,
                   contiguous=contiguous)

    def _store_quantized(self, tensor: str, b: int, codes: torch.Tensor, sp: torch.Tensor,
                         zp: torch.Tensor | None) -> None:
        """Write logical codes ``[H, n_quant, D]`` and FP32 ``s', z'`` of sequence ``b`` into its pages (an FP4
        format: its block-scale bytes ``sp [H, n_quant, D/block]``, ``zp`` None)."""
        fmt, page, H, D = self.fmt, self.page_size, self.num_kv_heads, self.head_dim
        pages = self.quantized_pages(b)
        n = pages.numel()
        if n == 0:
            return
        pad = n * page - codes.shape[1]
        codes = torch.nn.functional.pad(codes.to(torch.int32), (0, 0, 0, pad))
        words = pack_codes(codes.reshape(H, n, page, D), fmt.bits, tensor)  # [H, n, W]
        self._codes(tensor)[pages] = words.permute(1, 0, 2)
        if fmt.is_fp4:
            sb = torch.nn.functional.pad(sp.to(torch.uint8), (0, 0, 0, pad))
            self._params(tensor)[pages] = sb.reshape(H, n, page, -1).permute(1, 0, 2, 3)
            return
        par = torch.stack([sp, zp], dim=-1).to(torch.float32)  # [H, rows_total, cols, 2]
        rows, _ = fmt.param_shape(tensor, page)
        if fmt.axis(tensor) == CHANNEL and page < fmt.group_size:
            par = par.repeat_interleave(fmt.group_size // page, dim=1)  # each page keeps its group's row
        par = torch.nn.functional.pad(par, (0, 0, 0, 0, 0, n * rows - par.shape[1]))
        self._params(tensor)[pages] = par.reshape(H, n, rows, -1, 2).permute(1, 0, 2, 3, 4)

    def _store_windows(self, b: int, k_win: torch.Tensor, v_win: torch.Tensor) -> None:
        """Write sequence ``b``'s BF16 tokens (sink then recent, token order, ``[H, n, D]``)."""
        n_sink, n_quant, n_recent = (int(x[b]) for x in self.split())
        cap = max(self.fmt.recent_capacity, 1)
        slots = (n_quant + torch.arange(n_recent, device=self.device)) % cap
        for win, sink, ring in ((k_win, self.k_sink, self.k_recent), (v_win, self.v_sink, self.v_recent)):
            sink[b, :, :n_sink] = win[:, :n_sink].to(sink.dtype)
            ring[b][:, slots] = win[:, n_sink:].to(ring.dtype)

    @classmethod
    def empty(cls, fmt: KVFormat, batch: int, num_kv_heads: int, *, max_len: int | None = None,
              page_size: int | None = 64, page_table: PageTable | None = None, num_pages: int | None = None,
              window_dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
              key_mean=None, tensor_scales=None, key_weights=None) -> QuantKVCache:
        """A cache of ``batch`` empty sequences to :meth:`append` to. Paged (``page_size``): the caller's
        ``page_table`` and pool size ``num_pages``, or, given ``max_len``, ``ceil(max_len / page_size)``
        pages per sequence. Contiguous (``page_size=None``): room for ``max_len`` tokens per sequence.
        ``key_mean``: key centring (:mod:`foscar.centring`): ``None``, ``"prefill"`` (the first append's
        mean per sequence) or a ``[batch, num_kv_heads, head_dim]`` tensor. ``tensor_scales``: NVFP4's
        per-tensor scales ``(k, v)`` (calibrated, as serving engines take them; default 1), fixed for the
        cache's life: a value beyond what they let the E4M3 block scales hold is refused when appended.
        ``key_weights``: ``[batch, num_kv_heads, head_dim, head_dim]``, the keys' codes rounded for the error
        they weigh (:mod:`foscar.key_weights`: the second moments of the queries that will read them; an
        affine format), or ``None`` (round to nearest); :meth:`set_key_weights` sets them later."""
        key_mean = check_key_mean(key_mean, batch, num_kv_heads, fmt.head_dim, torch.device(device))
        cache = cls._empty(fmt, batch, num_kv_heads, max_len=max_len, page_size=page_size, page_table=page_table,
                           num_pages=num_pages, window_dtype=window_dtype, device=device)
        if tensor_scales is not None:
            from .fp4 import check_tensor_scales
            cache.tensor_scales.copy_(check_tensor_scales(fmt, tensor_scales, cache.device))
        cache.k_mean_pending = isinstance(key_mean, str)
        cache.k_mean = None if key_mean is None or isinstance(key_mean, str) else key_mean
        cache.set_key_weights(key_weights)
        return cache

    def set_key_weights(self, weights: torch.Tensor | None) -> None:
        """The weights of the keys' query-weighted rounding from now on (:mod:`foscar.key_weights`): ``[B, Hkv,
        D, D]`` in the caller's space (rotated here for a rotated format), or ``None`` (round to nearest). Codes
        already written stay as they are. Refused for an FP4 block format (its codes are not on an affine
        grid)."""
        from .key_weights import check_key_weights, stored_weights
        weights = check_key_weights(weights, self.batch_size, self.num_kv_heads, self.head_dim, self.device)
        if weights is not None and self.fmt.is_fp4:
            raise UnsupportedError(f"key_weights with scheme={self.fmt.scheme!r}", "query-weighted rounding takes "
                                   "the affine formats' grids")
        stored = None if weights is None else stored_weights(self.fmt, weights)
        if stored is not None and not bool(torch.isfinite(stored).all()):
            raise InvalidArgumentError("key_weights", "values whose rotation stays within float32's range",
                                       f"largest magnitude {float(weights.double().abs().max()):.3g}")
        self.k_weights = stored

    @classmethod
    def _empty(cls, fmt: KVFormat, batch: int, num_kv_heads: int, *, max_len, page_size, page_table, num_pages,
               window_dtype, device) -> QuantKVCache:
        check_int("batch", batch, minimum=0)
        check_int("num_kv_heads", num_kv_heads, minimum=1)
        if window_dtype not in WINDOW_DTYPES:
            raise InvalidArgumentError("window_dtype", f"one of {WINDOW_DTYPES}", window_dtype)
        device = torch.device(device)
        seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        size_name = "num_pages" if page_table is not None else "max_len"
        if page_table is None:
            if max_len is None:
                raise InvalidArgumentError("max_len", "the tokens per sequence to make room for (no page_table given)",
                                           None)
            check_int("max_len", max_len, minimum=1)
            if page_size is None:  # contiguous: one page per sequence, max_len rounded up to the alignment
                cap = _round_up(max_len, _contiguous_alignment(fmt))
                cache = cls._allocate(fmt, seq_lens=seq_lens, num_kv_heads=num_kv_heads, page_size=cap,
                                      page_table=PageTable.from_block_table(
                                          torch.arange(batch, dtype=torch.int32, device=device)[:, None]),
                                      num_pages=max(batch, 1), window_dtype=window_dtype, device=device,
                                      size_name="max_len")
                cache.contiguous = True
                return cache
            check_int("page_size", page_size, minimum=1)
            per = -(-max_len // page_size)
            if batch * per >= 2 ** 31:
                raise InvalidArgumentError("max_len", f"at most {2 ** 31 - 1} pages in all (int32 page indices)",
                                           f"{max_len} tokens x {batch} sequences in pages of {page_size}")
            try:
                table = torch.arange(batch * per, dtype=torch.int32, device=device).reshape(batch, per)
            except (torch.OutOfMemoryError, RuntimeError):
                raise InvalidArgumentError("max_len", f"a page table that {device} can allocate",
                                           f"{batch} x {per} pages") from None
            page_table, num_pages = PageTable.from_block_table(table), max(batch * per, 1)
        return cls._allocate(fmt, seq_lens=seq_lens, num_kv_heads=num_kv_heads, page_size=page_size,
                             page_table=page_table, num_pages=num_pages, window_dtype=window_dtype, device=device,
                             size_name=size_name)

    # ---- appending (the write path: foscar.write_path) ------------------------------------------------
    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, *, quantizer: str = "minmax",
               clip: float = DEFAULT_QUANTILE) -> None:
        """Append ``T`` tokens to every sequence, ``k_new, v_new [B, Hkv, T, D]`` (:func:`foscar.write_path.append`,
        PyTorch, host-driven: the reference of the GPU write kernels), rotated first when the format
        names a rotation, and centred before that when the cache centres its keys."""
        from .write_path import append, tokens_to_store
        with tokens_to_store(self, k_new, v_new) as (k_new, v_new):
            append(self, k_new, v_new, quantizer=quantizer, clip=clip)

    def advance_ring(self) -> None:
        """After an append to a cache with a ring (the PyTorch write path; the Triton append kernels do it
        themselves): :attr:`ring_from` moved on, on the device and in place, to where the append's ring writes
        start (:meth:`foscar.KVFormat.ring_keep_from`), the older slots written over."""
        torch.maximum(self.ring_from, self.fmt.ring_keep_from(self.seq_lens).to(torch.int32), out=self.ring_from)

    def rewind(self, tokens, *, check: bool = True) -> None:
        """Take the last ``tokens`` tokens of every sequence back (an int, or an int tensor ``[B]`` of counts): the
        lengths go back and the next appends write over them (speculative decoding's rejected drafts). A cache
        with a BF16 recent ring takes back the tokens whose window it still holds in BF16: up to
        :attr:`foscar.KVFormat.rollback` after appends of that many (its ring keeps that many more slots);
        without a ring, any. The checks read the lengths back (a host sync); a refused call leaves the cache as it
        was. ``check=False`` (inside a CUDA graph, as ``foscar.triton.append``'s): the lengths go back on the
        device, unchecked (the caller keeps within the contract above)."""
        B = self.batch_size
        if isinstance(tokens, bool) or not isinstance(tokens, (int, torch.Tensor)):
            raise InvalidArgumentError("tokens", "an int or an int tensor of counts per sequence",
                                       type(tokens).__name__)
        if isinstance(tokens, torch.Tensor):
            check_tensor("tokens", tokens, shape=(B,), dtypes=INDEX_DTYPES + (torch.int16, torch.uint8),
                         device=None if check else self.device)
            if not check:
                self.seq_lens.sub_(tokens.to(torch.int32))
                return
            n = tokens.long().cpu()
        else:
            if not check:
                check_int("tokens", tokens, minimum=0)  # a host int: checked without a sync
                self.seq_lens.sub_(tokens)
                return
            n = torch.full((B,), tokens, dtype=torch.long)
        lens = self.seq_lens.long().cpu()
        bad = ((n < 0) | (n > lens)).nonzero()
        if bad.numel():
            b = int(bad[0])
            raise InvalidArgumentError("tokens", f"a count in [0, {int(lens[b])}] for sequence {b} (its length)",
                                       int(n[b]))
        if self.fmt.recent_capacity:
            held = self.ring_from.long().cpu()
            n_quant = self.fmt.split_length(lens - n)[1]
            bad = (n_quant < held).nonzero()
            if bad.numel():
                b = int(bad[0])
                back = torch.arange(int(lens[b]) + 1)
                most = int(back[self.fmt.split_length(lens[b] - back)[1] >= held[b]].max())
                raise InvalidArgumentError(
                    "tokens", f"at most {most} for sequence {b}: the tokens its BF16 ring still holds back to "
                    f"(rollback={self.fmt.rollback} slots more than the window; KVFormat.rollback)", int(n[b]))
        self.seq_lens.sub_(n.to(device=self.seq_lens.device, dtype=torch.int32))

    def _check_append(self, k_new: torch.Tensor, v_new: torch.Tensor, quantizer: str):
        from .write_path import check_append
        return check_append(self, k_new, v_new, quantizer)

    @classmethod
    def from_quantized(cls, fmt: KVFormat, **tensors) -> QuantKVCache:
        """Build a cache from existing logical codes and their group constants (:func:`foscar.cache_io.from_quantized`)."""
        from .cache_io import from_quantized
        return from_quantized(fmt, **tensors)
