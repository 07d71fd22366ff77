"""Building a :class:`~foscar.cache.QuantKVCache` from dense values (:func:`quantize_kv`) or from codes another
system quantized (:func:`from_quantized`), and its logical contents back out (:func:`export`): affine
``(s, z)`` groups, and the FP4 block formats (:mod:`foscar.fp4`: E2M1 codes, block-scale bytes, NVFP4's
per-tensor scale)."""
from __future__ import annotations

import torch

from ._checks import check_finite, check_tensor
from .cache import INPUT_DTYPES, WINDOW_DTYPES, QuantKVCache
from .centring import centre, check_key_mean, sequence_means
from .errors import InvalidArgumentError
from .format import TOKEN, KVFormat
from .pagetable import INDEX_DTYPES, PageTable
from .quantize import DEFAULT_QUANTILE, FP4_QUANTIZERS, QUANTIZERS, check_quantizer, quantize_for
from .rotation import rotate


def export(cache: QuantKVCache) -> dict:
    """Logical contents for interop (KIVI/OSCAR-style tensors), nothing lost.

    ``{k,v}_codes``: uint8 ``[B, Hkv, Q, D]`` (``Q`` = longest quantized part, zero past each);
    ``{k,v}_scale``/``{k,v}_offset``: the ``(s, z)`` of ``x = s*q + z``, float64 (exact from the
    stored FP32 ``s', z'``), ``[B, Hkv, Q, D/g]`` token-wise or ``[B, Hkv, Q/g, D]`` channel-wise;
    ``{k,v}_scale_folded``/``{k,v}_offset_folded``: the stored FP32 ``s', z'``;
    ``{k,v}_sink``, ``{k,v}_recent``: the BF16 windows in token order (``[B, Hkv, n, D]``, zero
    past each sequence's count); ``seq_lens``; ``format``; ``k_mean`` (the keys' centring mean, or
    ``None``). With a rotation, the values as stored (rotated: ``format.rotation`` names it), keys
    centred.
    """
    fmt, B, H, D, g = cache.fmt, cache.batch_size, cache.num_kv_heads, cache.head_dim, cache.fmt.group_size
    n_sink, n_quant, n_recent = cache.split()
    Q = int(n_quant.max()) if B else 0
    R = int(n_recent.max()) if B else 0
    res = {"format": fmt, "seq_lens": cache.seq_lens.clone()}
    if fmt.is_fp4:
        return _export_fp4(cache, res)
    for tensor in ("k", "v"):
        rows, cols = fmt.param_shape(tensor, Q) if fmt.axis(tensor) == TOKEN else (Q // g, D)
        codes = torch.zeros(B, H, Q, D, dtype=torch.uint8, device=cache.device)
        spf = torch.zeros(B, H, rows, cols, dtype=torch.float32, device=cache.device)
        zpf = torch.zeros_like(spf)
        recent = torch.zeros(B, H, R, D, dtype=cache.window_dtype, device=cache.device)
        for b in range(B):
            nq = int(n_quant[b])
            codes[b, :, :nq] = cache.quantized_codes(tensor, b).to(torch.uint8)
            sp, zp = cache.quantized_params(tensor, b)
            spf[b, :, : sp.shape[1]] = sp
            zpf[b, :, : zp.shape[1]] = zp
            recent[b, :, : int(n_recent[b])] = cache.windows(tensor, b)[:, int(n_sink[b]):]
        s, z = fmt.op.unfold(spf, zpf)
        res.update({f"{tensor}_codes": codes, f"{tensor}_scale": s, f"{tensor}_offset": z,
                    f"{tensor}_scale_folded": spf, f"{tensor}_offset_folded": zpf,
                    f"{tensor}_sink": (cache.k_sink if tensor == "k" else cache.v_sink).clone(),
                    f"{tensor}_recent": recent})
    res["k_mean"] = None if cache.k_mean is None else cache.k_mean.clone()
    return res


def _export_fp4(cache: QuantKVCache, res: dict) -> dict:
    """:func:`export` of an FP4 format: ``{k,v}_codes`` (E2M1, uint8 ``[B, Hkv, Q, D]``), ``{k,v}_scale`` (the
    block-scale bytes, uint8 ``[B, Hkv, Q, D/block]``), ``tensor_scales`` (FP32 ``[2]``), the windows, as
    :func:`from_quantized` takes them."""
    B, H, D = cache.batch_size, cache.num_kv_heads, cache.head_dim
    n_sink, n_quant, n_recent = cache.split()
    Q = int(n_quant.max()) if B else 0
    R = int(n_recent.max()) if B else 0
    for tensor in ("k", "v"):
        codes = torch.zeros(B, H, Q, D, dtype=torch.uint8, device=cache.device)
        scales = torch.zeros(B, H, Q, D // cache.fmt.group_size, dtype=torch.uint8, device=cache.device)
        recent = torch.zeros(B, H, R, D, dtype=cache.window_dtype, device=cache.device)
        for b in range(B):
            nq = int(n_quant[b])
            codes[b, :, :nq] = cache.quantized_codes(tensor, b).to(torch.uint8)
            scales[b, :, :nq] = cache.quantized_scales(tensor, b)
            recent[b, :, : int(n_recent[b])] = cache.windows(tensor, b)[:, int(n_sink[b]):]
        res.update({f"{tensor}_codes": codes, f"{tensor}_scale": scales,
                    f"{tensor}_sink": (cache.k_sink if tensor == "k" else cache.v_sink).clone(),
                    f"{tensor}_recent": recent})
    res["tensor_scales"] = cache.tensor_scales.clone()
    res["k_mean"] = None if cache.k_mean is None else cache.k_mean.clone()
    return res



def from_quantized(fmt: KVFormat, *, k_codes, k_scale, v_codes, v_scale, seq_lens, k_offset=None, v_offset=None,
                   k_sink=None, v_sink=None, k_recent=None, v_recent=None, page_size: int | None = None,
                   page_table: PageTable | None = None, num_pages: int | None = None,
                   k_mean: torch.Tensor | None = None, tensor_scales=None) -> QuantKVCache:
    """Build a cache from existing logical codes, scales and offsets (KIVI, OSCAR, a serving engine).

    Shapes are those of :meth:`export`: codes ``[B, Hkv, Q, D]`` (integers in ``[0, 2^bits)``),
    ``(s, z)`` of ``x = s*q + z`` shaped ``[B, Hkv, Q, D/g]`` (token-wise) or ``[B, Hkv, Q/g, D]``
    (channel-wise), ``Q`` at least every sequence's quantized count (``fmt.split_length``);
    windows in token order ``[B, Hkv, n, D]`` (``n`` at least each sequence's sink/recent count).
    ``(s, z)`` are folded into the cache's FP32 ``(s', z')`` (one rounding of ``z'``). With
    ``fmt.rotation`` every tensor is of the rotated values (``x R``, :func:`foscar.rotation.rotation_matrix`),
    as a writer that rotates before quantizing (OSCAR) stores them; :meth:`export` gives them back so.
    ``k_mean [B, Hkv, D]``: the mean the keys were centred by before that (:mod:`foscar.centring`).
    An FP4 format (:mod:`foscar.fp4`): ``{k,v}_codes`` are E2M1 codes (0-15), ``{k,v}_scale`` the block scales
    ``[B, Hkv, Q, D/block]`` as their bytes (uint8: E4M3 for NVFP4, E8M0 for MXFP4; or
    ``torch.float8_e4m3fn`` for NVFP4), stored as they are; no offsets; NVFP4's per-tensor scales
    ``tensor_scales=(k, v)`` (default 1). The values are codes times block scale times tensor scale.
    A format with a BF16 recent ring holds the window alone (``ring_from``): a decode step of several tokens reads
    earlier windows, which the ring has once the step's tokens are appended through foscar
    (:func:`foscar.multitoken.check_ring` refuses it before, where the lengths are read on the host).
    """
    if not isinstance(fmt, KVFormat):
        raise InvalidArgumentError("fmt", "a foscar.KVFormat", type(fmt).__name__)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor("k_codes", k_codes, ndim=4)
    B, H, Q, D = k_codes.shape
    dev = k_codes.device
    if D != fmt.head_dim:
        raise InvalidArgumentError("k_codes", f"head_dim {fmt.head_dim} (fmt.head_dim) in dim 3", D)
    check_tensor("seq_lens", seq_lens, shape=(B,), device=dev)
    n_sink, n_quant, n_recent = fmt.split_length(seq_lens.long())
    if B and int(n_quant.max()) > Q:
        b = int(n_quant.argmax())
        raise InvalidArgumentError("seq_lens", f"lengths whose quantized parts fit the {Q} tokens of k_codes "
                                   f"(dim 2)", f"{int(seq_lens[b])} at sequence {b} ({int(n_quant[b])} quantized)")
    g = fmt.group_size
    wdtype = None
    tensors = {}
    for tensor, codes, s, z, sink, recent in (("k", k_codes, k_scale, k_offset, k_sink, k_recent),
                                              ("v", v_codes, v_scale, v_offset, v_sink, v_recent)):
        check_tensor(f"{tensor}_codes", codes, shape=(B, H, Q, D), device=dev)
        if codes.is_floating_point() or codes.dtype == torch.bool:
            raise InvalidArgumentError(f"{tensor}_codes", "an integer dtype", codes.dtype)
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= (1 << fmt.bits)):
            raise InvalidArgumentError(f"{tensor}_codes", f"codes in [0, {1 << fmt.bits})",
                                       f"values in [{int(codes.min())}, {int(codes.max())}]")
        shp = (B, H, Q, D // g) if fmt.axis(tensor) == TOKEN else (B, H, -(-Q // g), D)
        if fmt.is_fp4:
            folded = (_fp4_scale_bytes(fmt, f"{tensor}_scale", s, shp, dev), None)
            if z is not None:
                raise InvalidArgumentError(f"{tensor}_offset", f"None ({fmt.scheme} blocks have no offset)",
                                           type(z).__name__)
        else:
            for nm, t in ((f"{tensor}_scale", s), (f"{tensor}_offset", z)):
                check_tensor(nm, t, shape=shp, dtypes=INPUT_DTYPES, device=dev)
                check_finite(nm, t)
            fmt.check_folded((f"{tensor}_scale", f"{tensor}_offset"), s, z)
            folded = fmt.op.fold(s, z)
        for nm, t, need in ((f"{tensor}_sink", sink, n_sink), (f"{tensor}_recent", recent, n_recent)):
            if t is None:
                if B and int(need.max()) > 0:
                    raise InvalidArgumentError(nm, f"the BF16 tokens the format keeps ({int(need.max())} max)", None)
                continue
            check_tensor(nm, t, ndim=4, dtypes=WINDOW_DTYPES, device=dev)
            if t.shape[:2] != (B, H) or t.shape[3] != D or (B and t.shape[2] < int(need.max())):
                raise InvalidArgumentError(nm, f"shape ({B}, {H}, >= {int(need.max()) if B else 0}, {D})",
                                           tuple(t.shape))
            check_finite(nm, t)
            fmt.check_magnitude(nm, t)
            if wdtype is not None and t.dtype != wdtype:
                raise InvalidArgumentError(nm, f"window dtype {wdtype} like the other windows", t.dtype)
            wdtype = t.dtype
        tensors[tensor] = (codes, *folded, sink, recent)
    if tensor_scales is not None:
        from .fp4 import check_tensor_scales
        tensor_scales = check_tensor_scales(fmt, tensor_scales, dev).tolist()
    cache = QuantKVCache._allocate(fmt, seq_lens=seq_lens, num_kv_heads=H, page_size=page_size, page_table=page_table,
                                   num_pages=num_pages, window_dtype=wdtype or torch.bfloat16, device=dev,
                                   tensor_scales=tensor_scales)
    for b in range(B):
        nq, ns, nr = int(n_quant[b]), int(n_sink[b]), int(n_recent[b])
        wins = []
        for tensor in ("k", "v"):
            codes, sp, zp, sink, recent = tensors[tensor]
            rows = nq if fmt.axis(tensor) == TOKEN else nq // g
            cache._store_quantized(tensor, b, codes[b, :, :nq], sp[b, :, :rows], None if zp is None else zp[b, :, :rows])
            parts = [t[b, :, :n] for t, n in ((sink, ns), (recent, nr)) if t is not None]
            wins.append(torch.cat(parts, dim=1) if parts else torch.zeros(H, 0, D, device=dev))
        cache._store_windows(b, *wins)
    if isinstance(k_mean, str):
        raise InvalidArgumentError("k_mean", "None or a [B, Hkv, D] tensor", repr(k_mean))
    cache.k_mean = check_key_mean(k_mean, B, H, D, dev)
    return cache


def _fp4_scale_bytes(fmt: KVFormat, name: str, s, shape: tuple, dev) -> torch.Tensor:
    """Given FP4 block scales as their bytes (uint8, or ``float8_e4m3fn`` for NVFP4), checked: the shape, and
    bytes that are scales (E4M3: not negative, not NaN; E8M0: not the NaN byte 255)."""
    spec = fmt.fp4_spec
    dtypes = (torch.uint8, torch.float8_e4m3fn) if spec.scale == "e4m3" else (torch.uint8,)
    check_tensor(name, s, shape=shape, dtypes=dtypes, device=dev)
    b = s.view(torch.uint8) if s.dtype != torch.uint8 else s
    bad = ((b & 0x80) != 0) | ((b & 0x7F) == 0x7F) if spec.scale == "e4m3" else b == 255
    if b.numel() and bool(bad.any()):
        i = tuple(bad.nonzero()[0].tolist())
        raise InvalidArgumentError(name, f"{spec.scale.upper()} block-scale bytes of scales >= 0 (no NaN"
                                   f"{', no sign bit' if spec.scale == 'e4m3' else ''})",
                                   f"byte 0x{int(b[i]):02X} at index {i}")
    return b




def quantize_kv(k: torch.Tensor, v: torch.Tensor, fmt: KVFormat, *, seq_lens: torch.Tensor | None = None,
                quantizer: str = "minmax", clip: float = DEFAULT_QUANTILE, page_size: int | None = None,
                page_table: PageTable | None = None, num_pages: int | None = None,
                window_dtype: torch.dtype = torch.bfloat16, key_mean=None, tensor_scales=None,
                key_weights=None) -> QuantKVCache:
    """Quantize dense ``k, v [B, Hkv, L, D]`` into a foscar cache.

    ``seq_lens`` (default: ``L`` for all) gives each sequence's length; tokens past it are ignored.
    ``page_size=None`` gives a contiguous cache; otherwise pages of ``page_size`` tokens, taken in
    order from a fresh pool, or from ``page_table`` (a :class:`PageTable`) into a pool of
    ``num_pages`` pages. ``quantizer``: ``"minmax"``, ``"mse"`` or ``"quantile"`` (``clip``).
    The first ``fmt.sink`` and last ``fmt.recent`` tokens stay in ``window_dtype``. ``key_mean``: key
    centring (:mod:`foscar.centring`): ``None``, ``"prefill"`` (each sequence's mean) or ``[B, Hkv, D]``.
    An FP4 format (:mod:`foscar.fp4`) takes ``"minmax"`` (block scales from the block maxima) or ``"mse"``
    (two candidates a block); NVFP4's per-tensor scales ``tensor_scales=(k, v)`` are given or taken from the
    values quantized (their largest magnitude over ``448 * 6``). ``key_weights [B, Hkv, D, D]``: the keys'
    codes rounded for the error they weigh (:mod:`foscar.key_weights`), kept for later appends.
    """
    if not isinstance(fmt, KVFormat):
        raise InvalidArgumentError("fmt", "a foscar.KVFormat", type(fmt).__name__)
    check_tensor("k", k, ndim=4, dtypes=INPUT_DTYPES)
    B, H, L, D = k.shape
    if D != fmt.head_dim:
        raise InvalidArgumentError("k", f"head_dim {fmt.head_dim} (fmt.head_dim) in dim 3", D)
    if H == 0:
        raise InvalidArgumentError("k", "at least one KV head in dim 1", f"shape {tuple(k.shape)}")
    check_tensor("v", v, shape=(B, H, L, D), dtypes=INPUT_DTYPES, device=k.device)
    check_quantizer(quantizer, FP4_QUANTIZERS if fmt.is_fp4 else QUANTIZERS,
                    f" (scheme={fmt.scheme!r})" if fmt.is_fp4 else "")
    if tensor_scales is not None:
        from .fp4 import check_tensor_scales
        tensor_scales = check_tensor_scales(fmt, tensor_scales, k.device)
    if quantizer == "quantile" and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                    or not 0.0 <= clip < 0.5):
        raise InvalidArgumentError("clip", "a quantile in [0, 0.5)", repr(clip))
    if window_dtype not in WINDOW_DTYPES:
        raise InvalidArgumentError("window_dtype", "torch.bfloat16 or torch.float16", window_dtype)
    if seq_lens is None:
        seq_lens = torch.full((B,), L, dtype=torch.int32, device=k.device)
    check_tensor("seq_lens", seq_lens, shape=(B,), dtypes=INDEX_DTYPES, device=k.device)
    if B and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > L):
        raise InvalidArgumentError("seq_lens", f"lengths in [0, {L}] (k.shape[2])", seq_lens.tolist())
    if page_table is not None and not isinstance(page_table, PageTable):
        raise InvalidArgumentError("page_table", "a foscar.PageTable", type(page_table).__name__)
    key_mean = check_key_mean(key_mean, B, H, D, k.device)
    cache = QuantKVCache._allocate(fmt, seq_lens=seq_lens, num_kv_heads=H, page_size=page_size,
                                   page_table=page_table, num_pages=num_pages, window_dtype=window_dtype,
                                   device=k.device)
    if isinstance(key_mean, str):
        key_mean = sequence_means(k, seq_lens)
    cache.k_mean = key_mean
    cache.set_key_weights(key_weights)
    k = centre(k, key_mean)
    k, v = rotate(k, fmt), rotate(v, fmt)  # the stored values (a rotation mixes channels, never tokens)
    n_sink, n_quant, _ = cache.split()
    if fmt.fp4_spec is not None and fmt.fp4_spec.tensor_scale:
        cache.tensor_scales.copy_(tensor_scales if tensor_scales is not None else torch.tensor(
            [_nvfp4_scale(fmt, x, n_sink, n_quant, window_dtype) for x in (k, v)], dtype=torch.float32))
    for b in range(B):
        Lb, ns, nq = int(seq_lens[b]), int(n_sink[b]), int(n_quant[b])
        for name, x in (("k", k), ("v", v)):
            check_finite(name, x[b, :, :Lb])
            fmt.check_storable(name, x[b, :, :Lb], window_dtype, 0, (b,))
        for tensor, x in (("k", k), ("v", v)):
            if nq:
                codes, sp, zp = quantize_for(fmt, fmt.as_quantized(x[b, :, ns: ns + nq], window_dtype), tensor,
                                             quantizer, clip, cache.tensor_scale(tensor), None,
                                             None if cache.k_weights is None else cache.k_weights[b])
                cache._store_quantized(tensor, b, codes, sp, zp)
        keep = torch.cat([torch.arange(ns), torch.arange(ns + nq, Lb)]).to(k.device)
        cache._store_windows(b, k[b][:, keep], v[b][:, keep])
        if fmt.rollback and fmt.recent_capacity:  # the ring holds the last recent_capacity tokens, as appends leave it
            lo = int(fmt.ring_keep_from(Lb))
            slots = (torch.arange(lo, nq) % fmt.recent_capacity).to(k.device)
            for x, ring in ((k, cache.k_recent), (v, cache.v_recent)):
                ring[b][:, slots] = x[b][:, ns + lo: ns + nq].to(ring.dtype)
            cache.ring_from[b] = lo
    return cache


def _nvfp4_scale(fmt: KVFormat, x: torch.Tensor, n_sink, n_quant, window_dtype) -> float:
    """NVFP4's per-tensor scale for the quantized tokens of ``x [B, H, L, D]``: their largest magnitude over
    ``448 * 6`` (:func:`foscar.fp4.nvfp4_tensor_scale`), as the FP32 at or above it, so that the largest block's
    scale fits E4M3 (1 when nothing is quantized or every value is 0)."""
    from .fp4 import nvfp4_tensor_scale
    parts = [fmt.as_quantized(x[b, :, int(n_sink[b]): int(n_sink[b]) + int(n_quant[b])], window_dtype).reshape(-1)
             for b in range(x.shape[0])]
    t = nvfp4_tensor_scale(torch.cat(parts)) if parts else 1.0
    t32 = torch.tensor(t, dtype=torch.float32)
    if float(t32) < t:
        t32 = torch.nextafter(t32, torch.tensor(float("inf")))
    return float(t32)


def from_flashinfer_nvfp4(kv_data, kv_cache_sf, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                          kv_last_page_len: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0,
                          kv_layout: str = "NHD", page_size: int | None = None) -> QuantKVCache:
    """A foscar NVFP4 cache of FlashInfer's paged NVFP4 KV cache, its codes and scales as they are (no
    re-quantization): ``kv_data = (k, v)``, uint8 ``[pages, page, Hkv, D/2]`` (``kv_layout="NHD"``; ``"HND"``:
    ``[pages, Hkv, page, D/2]``), two E2M1 codes a byte, channel ``2i`` in the low nibble; ``kv_cache_sf =
    (k_sf, v_sf)``, the E4M3 block scales ``[pages, page, Hkv, D/16]`` (or HND), linear as FlashInfer's fa2
    decode reads them (``torch.float8_e4m3fn`` or their uint8 bytes); the sequences by CSR
    (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, FlashInfer's ``plan`` arguments); ``k_scale``,
    ``v_scale``: the per-tensor scales FlashInfer's ``run`` takes. ``page_size``: foscar's pages (default
    FlashInfer's where it is a multiple of 16, else 64)."""
    from ._checks import check_int
    if kv_layout not in ("NHD", "HND"):
        raise InvalidArgumentError("kv_layout", "'NHD' or 'HND'", repr(kv_layout))
    tensors = {}
    for name, pair in (("kv_data", kv_data), ("kv_cache_sf", kv_cache_sf)):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidArgumentError(name, "a (k, v) pair of tensors", type(pair).__name__)
        for t, x in zip("kv", pair):
            check_tensor(f"{name}[{'kv'.index(t)}]", x, ndim=4,
                         dtypes=(torch.uint8,) if name == "kv_data" else (torch.uint8, torch.float8_e4m3fn))
            x = x.view(torch.uint8)
            tensors[(name, t)] = x.permute(0, 2, 1, 3) if kv_layout == "HND" else x  # as NHD
    P, page, H, half = tensors[("kv_data", "k")].shape
    D = 2 * half
    fmt = KVFormat.fp4("nvfp4", D)
    dev = tensors[("kv_data", "k")].device
    for (name, t), x in tensors.items():
        want = (P, page, H, half if name == "kv_data" else D // 16)
        if tuple(x.shape) != want or x.device != dev:
            raise InvalidArgumentError(f"{name}[{'kv'.index(t)}]", f"shape {want} on {dev} ({kv_layout})",
                                       f"{tuple(x.shape)} on {x.device}")
    check_tensor("kv_indptr", kv_indptr, ndim=1, dtypes=INDEX_DTYPES)
    B = kv_indptr.shape[0] - 1
    check_tensor("kv_last_page_len", kv_last_page_len, shape=(B,), dtypes=INDEX_DTYPES)
    check_tensor("kv_indices", kv_indices, ndim=1, dtypes=INDEX_DTYPES)
    indptr, indices, last = (x.long().cpu() for x in (kv_indptr, kv_indices, kv_last_page_len))
    n_pages = indptr[1:] - indptr[:-1]
    if B < 0 or bool((n_pages < 0).any()) or int(indptr[-1]) > indices.numel():
        raise InvalidArgumentError("kv_indptr", f"a CSR over the {indices.numel()} kv_indices", indptr.tolist())
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= P):
        raise InvalidArgumentError("kv_indices", f"pages in [0, {P})", f"[{int(indices.min())}, {int(indices.max())}]")
    if bool(((last < 1) | (last > page))[n_pages > 0].any()):
        raise InvalidArgumentError("kv_last_page_len", f"last-page lengths in [1, {page}]", last.tolist())
    lens = torch.where(n_pages > 0, (n_pages - 1) * page + last, torch.zeros_like(n_pages))
    L = int(lens.max()) if B else 0
    dense = {key: torch.zeros(B, H, L, D if key[0] == "kv_data" else D // 16, dtype=torch.uint8, device=dev)
             for key in tensors}
    for b in range(B):
        pages = indices[int(indptr[b]): int(indptr[b + 1])].to(dev)
        n = int(lens[b])
        for key, x in tensors.items():
            rows = x[pages].reshape(-1, H, x.shape[-1])[:n].permute(1, 0, 2)  # [H, n, .]
            if key[0] == "kv_data":  # two codes a byte: channel 2i low, 2i + 1 high
                rows = torch.stack([rows & 0xF, rows >> 4], dim=-1).reshape(H, n, D)
            dense[key][b, :, :n] = rows
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < float(s) < float("inf"):
            raise InvalidArgumentError(name, "a finite positive per-tensor scale", s)
    if page_size is None:
        page_size = page if page % 16 == 0 else 64
    check_int("page_size", page_size, minimum=1)
    return from_quantized(fmt, k_codes=dense[("kv_data", "k")], v_codes=dense[("kv_data", "v")],
                          k_scale=dense[("kv_cache_sf", "k")], v_scale=dense[("kv_cache_sf", "v")],
                          seq_lens=lens.to(device=dev, dtype=torch.int32), page_size=page_size,
                          tensor_scales=(float(k_scale), float(v_scale)))
