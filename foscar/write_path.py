"""The PyTorch write path: appending tokens to a :class:`~foscar.cache.QuantKVCache` on the host, the
reference that the GPU write kernels (:mod:`foscar.triton.write`) match bit for bit."""
from __future__ import annotations

import contextlib

import torch

from ._checks import check_finite, check_tensor
from .cache import QuantKVCache
from .errors import InvalidArgumentError
from .centring import keep_mean, keys_to_store
from .format import TOKEN, pack_codes, unpack_codes
from .rotation import rotate_given
from .quantize import DEFAULT_QUANTILE, FP4_QUANTIZERS, QUANTIZERS, check_quantizer, quantize_for


@contextlib.contextmanager
def tokens_to_store(cache: QuantKVCache, k_new: torch.Tensor, v_new: torch.Tensor):
    """``with tokens_to_store(cache, k, v) as (k, v): <write them>``: the tokens as every write path stores
    them, keys centred (:func:`foscar.centring.keys_to_store`) and then both rotated
    (:func:`foscar.rotation.rotate_given`); a mean taken from them becomes the cache's only if the write
    succeeds (:func:`foscar.centring.keep_mean`)."""
    k_new, mean = keys_to_store(cache, k_new)
    yield rotate_given(cache.fmt, k_new, v_new)
    keep_mean(cache, mean)


def append(cache: QuantKVCache, k_new: torch.Tensor, v_new: torch.Tensor, *, quantizer: str = "minmax",
           clip: float = DEFAULT_QUANTILE) -> None:
    """Append ``T`` tokens to every sequence: ``k_new, v_new [B, Hkv, T, D]`` (one decode step: ``T = 1``;
    a prefill: the prompt).

    Tokens fill the BF16 sink first; the rest go to the recent ring, and the ring's oldest tokens are
    quantized as soon as they leave the recent window: one at a time with token-wise groups on both
    tensors, a whole group of ``g`` tokens at a time otherwise (:attr:`KVFormat.flush`). Quantized
    tokens go to the sequence's pages through the page table (pages are the caller's: the table must
    already list enough of them). Everything is checked and computed before anything is written: a
    bad call raises and leaves the cache exactly as it was.
    """
    checked = check_append(cache, k_new, v_new, quantizer)
    if checked is None:
        return
    T, old, new, q0, q1 = checked
    fmt, D, H = cache.fmt, cache.head_dim, cache.num_kv_heads
    B = cache.batch_size
    sink, cap = fmt.sink, max(fmt.recent_capacity, 1)
    writes = []  # (destination tensor, index, value): applied only after everything is computed
    for b in range(B):
        L0, L1, a, z = int(old[b]), int(new[b]), int(q0[b]), int(q1[b])
        keep_from = int(fmt.ring_keep_from(L1))  # the ring keeps the new tokens from here
        P0 = max(0, L0 - sink)  # post-sink tokens before the call
        for tensor, x_new, win_sink, ring in (("k", k_new, cache.k_sink, cache.k_recent),
                                              ("v", v_new, cache.v_sink, cache.v_recent)):
            if z > a:  # post-sink tokens [a, z) leave the ring (or arrive past it) and are quantized
                p = torch.arange(a, z)
                from_ring = p < P0
                src = torch.empty(H, z - a, D, dtype=torch.float64, device=cache.device)
                if from_ring.any():
                    src[:, from_ring.to(cache.device)] = ring[b][:, (p[from_ring] % cap).to(cache.device)].double()
                if (~from_ring).any():  # arriving past the window: quantized as the ring would hold them
                    j = (sink + p[~from_ring] - L0).to(cache.device)
                    src[:, (~from_ring).to(cache.device)] = fmt.as_quantized(x_new[b][:, j], ring.dtype).double()
                codes, sp, zp = quantize_for(fmt, src, tensor, quantizer, clip, cache.tensor_scale(tensor),
                                             f"{tensor}_new", None if cache.k_weights is None else cache.k_weights[b])
                writes += _quantized_range_writes(cache, tensor, b, a, codes, sp, zp)
            i = torch.arange(L0, L1)
            in_sink = i < sink
            if in_sink.any():
                writes.append((win_sink, (b, slice(None), i[in_sink].to(cache.device)),
                               x_new[b][:, in_sink.nonzero().flatten().to(cache.device)].to(win_sink.dtype)))
            pp = i - sink
            keep = (~in_sink) & (pp >= keep_from)  # new tokens the BF16 ring keeps
            if keep.any():
                writes.append((ring, (b, slice(None), (pp[keep] % cap).to(cache.device)),
                               x_new[b][:, keep.nonzero().flatten().to(cache.device)].to(ring.dtype)))
    for dest, index, value in writes:
        dest[index] = value
    cache.seq_lens.add_(T)
    if fmt.recent_capacity:
        cache.advance_ring()

def check_append(cache: QuantKVCache, k_new: torch.Tensor, v_new: torch.Tensor, quantizer: str):
    """Everything :meth:`append` checks before writing (it reads lengths back: a host sync). Returns
    ``(T, old, new, q0, q1)``: lengths and quantized counts before and after, or ``None`` for T = 0."""
    fmt, D, H, page = cache.fmt, cache.head_dim, cache.num_kv_heads, cache.page_size
    B = cache.batch_size
    check_tensor("k_new", k_new, ndim=4, dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64),
                 device=cache.device)
    if k_new.shape[0] != B or k_new.shape[1] != H or k_new.shape[3] != D:
        raise InvalidArgumentError("k_new", f"shape ({B}, {H}, T, {D}) for this cache", tuple(k_new.shape))
    check_tensor("v_new", v_new, shape=tuple(k_new.shape), dtypes=(k_new.dtype,), device=cache.device)
    check_quantizer(quantizer, FP4_QUANTIZERS if fmt.is_fp4 else QUANTIZERS,
                    f" (scheme={fmt.scheme!r})" if fmt.is_fp4 else "")
    T = k_new.shape[2]
    if T == 0:
        return None
    check_finite("k_new", k_new)
    check_finite("v_new", v_new)
    old = cache.seq_lens.long().cpu()
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        for b in range(B):
            fmt.check_storable(name, x[b], cache.window_dtype, int(old[b]), (b,))
    new = old + T
    _, q0, _ = fmt.split_length(old)
    _, q1, _ = fmt.split_length(new)
    have = cache.page_table.num_pages.long().cpu()
    need = torch.div(q1 + page - 1, page, rounding_mode="floor")
    short = (need > have).nonzero()
    if short.numel():
        b = int(short[0])
        raise InvalidArgumentError("k_new", f"tokens that fit the pages of sequence {b} ({int(have[b])} pages of "
                                   f"{page}; {int(q1[b])} quantized tokens need {int(need[b])})",
                                   f"{T} more tokens after {int(old[b])}")
    cache._check_page_indices(need)
    return T, old, new, q0, q1

def _quantized_range_writes(cache: QuantKVCache, tensor: str, b: int, start: int, codes: torch.Tensor, sp: torch.Tensor,
                            zp: torch.Tensor) -> list:
    """The writes that put logical codes ``[H, n, D]`` and ``(s', z')`` of quantized tokens
    ``[start, start + n)`` of sequence ``b`` into its pages: whole pages of words re-packed (a word
    mixes tokens), parameter rows set. Returned, not applied."""
    fmt, page, D = cache.fmt, cache.page_size, cache.head_dim
    n = codes.shape[1]
    pages = cache.page_table.block_table[b].long()
    first, last = start // page, (start + n - 1) // page
    ids = pages[first: last + 1]
    words = cache._codes(tensor)[ids]  # [P, H, W]
    logical = unpack_codes(words, fmt.bits, tensor, D)  # [P, H, page, D]
    flat = logical.permute(1, 0, 2, 3).reshape(codes.shape[0], -1, D)  # [H, P*page, D]
    lo = start - first * page
    flat[:, lo: lo + n] = codes.to(flat.dtype).to(flat.device)
    new_words = pack_codes(flat.reshape(codes.shape[0], -1, page, D).permute(1, 0, 2, 3), fmt.bits, tensor)
    out = [(cache._codes(tensor), ids, new_words)]
    params = cache._params(tensor)
    if zp is None:  # an FP4 format: the block-scale bytes [H, rows, D/block]
        par = sp.to(device=cache.device, dtype=torch.uint8)
    else:
        par = torch.stack([sp, zp], dim=-1).to(torch.float32).to(cache.device)  # [H, rows, cols, 2]
    if fmt.axis(tensor) == TOKEN:  # one row per token
        for r, t in enumerate(range(start, start + n)):
            out.append((params, (pages[t // page], slice(None), t % page), par[:, r]))
    else:  # one row per token group; a page shorter than a group keeps its group's row as row 0
        g = fmt.group_size
        for r, t0 in enumerate(range(start, start + n, g)):
            for t in range(t0, t0 + g, page) if page < g else (t0,):
                out.append((params, (pages[t // page], slice(None), (t % page) // g if page >= g else 0),
                            par[:, r]))
    return out
