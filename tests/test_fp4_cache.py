"""NVFP4 and MXFP4 caches (``KVFormat.scheme``): what the format takes, the stored blocks against the codec
(:mod:`foscar.fp4`), export and from_quantized, the write path against quantize_kv, the folded spec against
the float64 oracle, the reference backend against BF16 attention, and the refusals."""
import pytest
import torch
from _helpers import bf16_attention, rel

import foscar
from foscar import fp4
from foscar.errors import InvalidArgumentError, UnsupportedError

SCHEMES = ("nvfp4", "mxfp4")


def _values(B, H, L, D, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, L, D, generator=gen) * torch.rand(1, H, 1, D, generator=gen) * 4  # channel outliers
    v = torch.randn(B, H, L, D, generator=gen) + 0.5
    return k, v


@pytest.mark.parametrize("scheme,block,bpt", [("nvfp4", 16, 144), ("mxfp4", 32, 136)])
def test_the_fp4_formats_say_what_they_are(scheme, block, bpt):
    fmt = foscar.KVFormat.fp4(scheme, 128)
    assert (fmt.bits, fmt.group_size, fmt.k_axis, fmt.v_axis, fmt.is_fp4) == (4, block, "token", "token", True)
    assert fmt.bytes_per_token() == bpt  # codes and block-scale bytes, K and V
    assert fmt == foscar.KVFormat(4, 128, block, scheme=scheme) and hash(fmt) == hash(foscar.KVFormat.fp4(scheme, 128))
    for kw, name in (({"bits": 2}, "bits"), ({"group_size": 64}, "group_size"), ({"k_axis": "channel"}, "k_axis"),
                     ({"v_axis": "channel"}, "v_axis"), ({"mapping": "f16"}, "mapping")):
        args = {"bits": 4, "head_dim": 128, "group_size": block, "scheme": scheme, **kw}
        with pytest.raises(UnsupportedError, match=rf"^{name}=.* with scheme='{scheme}'"):
            foscar.KVFormat(**args)
    with pytest.raises(InvalidArgumentError, match=r"^scheme: expected one of"):
        foscar.KVFormat(4, 128, 16, scheme="fp4")
    assert not foscar.KVFormat(4, 128, 128).is_fp4 and foscar.KVFormat(4, 128, 128).fp4_spec is None


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("quantizer,page_size,windows", [("minmax", 64, {}), ("mse", None, {}),
                                                         ("mse", 32, {"sink": 4, "recent": 16})])
def test_a_cache_holds_the_blocks_the_codec_makes(scheme, quantizer, page_size, windows):
    fmt = foscar.KVFormat.fp4(scheme, 64, **windows)
    spec = fmt.fp4_spec
    k, v = _values(2, 2, 150, 64, seed=len(scheme) + (page_size or 0))
    lens = torch.tensor([150, 37], dtype=torch.int32)
    cache = foscar.quantize_kv(k, v, fmt, seq_lens=lens, page_size=page_size, quantizer=quantizer)
    K, V = cache.dequantize()
    n_sink, n_quant, _ = cache.split()
    for t, (x, dense) in enumerate(((k, K), (v, V))):
        scale = float(cache.tensor_scales[t])
        if spec.tensor_scale:  # the FP32 at or above the largest quantized magnitude over 448 * 6
            parts = torch.cat([x[b, :, int(n_sink[b]): int(n_sink[b] + n_quant[b])].bfloat16().double().reshape(-1)
                               if windows else x[b, :, : int(n_quant[b])].double().reshape(-1) for b in range(2)])
            assert scale * 448 * 6 >= float(parts.abs().max()) and scale == float(torch.tensor(scale).float())
        else:
            assert scale == 1.0
        for b in range(2):
            ns, nq, L = int(n_sink[b]), int(n_quant[b]), int(lens[b])
            src = x[b, :, ns: ns + nq]
            src = src.bfloat16().double() if windows else src.double()  # the recent ring's dtype first
            want = fp4.dequantize_blocks(fp4.quantize_blocks(src, spec, scale if spec.tensor_scale else None,
                                                             search=quantizer == "mse"))
            assert torch.equal(dense[b, :, ns: ns + nq], want)
            keep = torch.cat([torch.arange(ns), torch.arange(ns + nq, L)])
            assert torch.equal(dense[b, :, keep], x[b, :, keep].bfloat16().double())
            assert bool((dense[b, :, L:] == 0).all())
    assert cache.k_params.dtype == torch.uint8 and cache.k_params.shape[-1] == 64 // spec.block


@pytest.mark.parametrize("scheme", SCHEMES)
def test_export_and_from_quantized_round_trip(scheme):
    fmt = foscar.KVFormat.fp4(scheme, 128, sink=2)
    k, v = _values(2, 1, 90, 128, seed=3)
    lens = torch.tensor([90, 66], dtype=torch.int32)
    cache = foscar.quantize_kv(k, v, fmt, seq_lens=lens, page_size=16)
    e = cache.export()
    assert e["k_codes"].dtype == torch.uint8 and int(e["k_codes"].max()) < 16 and e["k_scale"].dtype == torch.uint8
    scales = e["tensor_scales"] if scheme == "nvfp4" else None
    for k_scale in (e["k_scale"], e["k_scale"].view(torch.float8_e4m3fn)) if scheme == "nvfp4" else (e["k_scale"],):
        again = foscar.QuantKVCache.from_quantized(fmt, k_codes=e["k_codes"], k_scale=k_scale, v_codes=e["v_codes"],
                                                   v_scale=e["v_scale"], seq_lens=lens, k_sink=e["k_sink"],
                                                   v_sink=e["v_sink"], page_size=None, tensor_scales=scales)
        for a, b in zip(again.dequantize(), cache.dequantize()):
            assert torch.equal(a, b)
        e2 = again.export()
        for name in ("k_codes", "k_scale", "v_codes", "v_scale", "tensor_scales"):
            assert torch.equal(e2[name], e[name])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_appends_write_what_quantize_kv_writes(scheme):
    fmt = foscar.KVFormat.fp4(scheme, 64, recent=8)
    k, v = _values(2, 2, 70, 64, seed=5)
    scales = (0.02, 0.01) if scheme == "nvfp4" else None
    cache = foscar.QuantKVCache.empty(fmt, 2, 2, max_len=80, page_size=16, tensor_scales=scales)
    cache.append(k[:, :, :50], v[:, :, :50])
    for t in range(50, 70):  # decode steps: each token leaves the recent ring in turn
        foscar.append(cache, k[:, :, t: t + 1], v[:, :, t: t + 1])
    whole = foscar.quantize_kv(k, v, fmt, page_size=16, tensor_scales=scales)
    for a, b in zip(cache.dequantize(), whole.dequantize()):
        assert torch.equal(a, b)
    a, b = cache.export(), whole.export()
    for name in ("k_codes", "k_scale", "v_codes", "v_scale", "tensor_scales", "k_recent", "v_recent"):
        assert torch.equal(a[name], b[name])


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("seed", range(3))
def test_the_folded_spec_is_the_oracle_and_the_reference_backend_is_within_bf16_attention(scheme, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    D, G = (64, 128)[seed % 2], (1, 4, 8)[seed]
    fmt = foscar.KVFormat.fp4(scheme, D, **({"sink": 3, "recent": 5} if seed == 2 else {}))
    lens = torch.randint(1, 300, (3,), generator=gen).to(torch.int32)
    k, v = _values(3, 2, 300, D, seed)
    cache = foscar.quantize_kv(k, v, fmt, seq_lens=lens, page_size=32, quantizer="mse",
                               key_mean="prefill" if seed == 1 else None)
    q = torch.randn(3, 2 * G, D, generator=gen)
    exact, lse = foscar.decode_exact(q, cache, return_lse=True)
    for tile, splits in ((64, 1), (32, 5)):
        got, got_lse = foscar.decode_folded(q, cache, tile_tokens=tile, num_splits=splits, return_lse=True)
        assert float((got - exact).abs().max()) < 1e-12 and float((got_lse - lse).abs().max()) < 1e-12
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    foscar.decode(q.bfloat16(), cache, out=out, backend="reference")
    assert bool(torch.isfinite(out).all())
    assert rel(out, exact) <= 1.05 * rel(bf16_attention(q.bfloat16().float(), cache), exact) + 1e-4


def test_fp4_refusals_name_the_argument_and_leave_the_cache_as_it_was():
    nv, mx = foscar.KVFormat.fp4("nvfp4", 64), foscar.KVFormat.fp4("mxfp4", 64)
    k, v = _values(1, 1, 20, 64, seed=9)
    cache = foscar.QuantKVCache.empty(nv, 1, 1, max_len=32, page_size=16, tensor_scales=(1e-4, 1e-4))
    before = (cache.k_codes.clone(), cache.k_params.clone(), cache.seq_lens.clone())
    with pytest.raises(InvalidArgumentError, match=r"^k_new: expected values of magnitude <= 0.2688"):
        cache.append(k, v)  # 6 x 448 x 1e-4: the E4M3 block scales cannot hold these values
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.k_codes, cache.k_params, cache.seq_lens)))
    with pytest.raises(InvalidArgumentError, match=r"^k: expected values of magnitude"):
        foscar.quantize_kv(k, v, nv, tensor_scales=(1e-4, 1.0))
    with pytest.raises(InvalidArgumentError, match=r"^quantizer: expected one of \('minmax', 'mse'\)"):
        foscar.quantize_kv(k, v, nv, quantizer="quantile")
    with pytest.raises(InvalidArgumentError, match=r"^tensor_scales: expected None \(scheme='mxfp4'"):
        foscar.quantize_kv(k, v, mx, tensor_scales=(1.0, 1.0))
    with pytest.raises(InvalidArgumentError, match=r"^tensor_scales: expected \(k_scale, v_scale\)"):
        foscar.QuantKVCache.empty(nv, 1, 1, max_len=32, tensor_scales=(0.0, 1.0))
    e = foscar.quantize_kv(k, v, nv).export()
    kw = {"k_codes": e["k_codes"], "v_codes": e["v_codes"], "v_scale": e["v_scale"], "seq_lens": e["seq_lens"]}
    with pytest.raises(InvalidArgumentError, match=r"^k_offset: expected None \(nvfp4 blocks have no offset\)"):
        foscar.QuantKVCache.from_quantized(nv, k_scale=e["k_scale"], k_offset=e["k_scale"].float(), **kw)
    for byte in (0x7F, 0x80 | 0x30):  # E4M3 NaN; a negative scale
        bad = e["k_scale"].clone()
        bad[0, 0, 3, 1] = byte
        with pytest.raises(InvalidArgumentError, match=r"^k_scale: expected E4M3 block-scale bytes"):
            foscar.QuantKVCache.from_quantized(nv, k_scale=bad, **kw)
    e = foscar.quantize_kv(k, v, mx).export()
    bad = e["v_scale"].clone()
    bad[0, 0, 0, 0] = 255
    with pytest.raises(InvalidArgumentError, match=r"^v_scale: expected E8M0 block-scale bytes"):
        foscar.QuantKVCache.from_quantized(mx, k_codes=e["k_codes"], k_scale=e["k_scale"], v_codes=e["v_codes"],
                                           v_scale=bad, seq_lens=e["seq_lens"])


def test_the_triton_kernels_take_fp4_and_the_cute_ones_at_pages_of_64():
    from foscar.backends.base import ProblemKey
    from foscar.backends.triton import Triton
    fmt = foscar.KVFormat.fp4("nvfp4", 128)
    if importlib_has("triton") and torch.cuda.is_available():  # the status names the GPU
        assert Triton().status(ProblemKey(torch.device("cuda"), fmt, 4, 64)).usable
    if importlib_has("cutlass"):
        from foscar.cute.config import config_for
        assert config_for(fmt, 4, 64).fp4_block == 16
        with pytest.raises(UnsupportedError, match=r"^gqa=4, q_len=1, page=16"):
            config_for(fmt, 4, 16)
        assert config_for(foscar.KVFormat.fp4("mxfp4", 128), 4, 64).fp4_mx
        with pytest.raises(UnsupportedError, match=r"^scheme='mxfp4', head_dim=256"):
            config_for(foscar.KVFormat.fp4("mxfp4", 256), 2, 64)
    cache = foscar.quantize_kv(*_values(1, 1, 64, 128, seed=1), fmt)
    with pytest.raises(UnsupportedError, match=r"operand_dtype"):
        foscar.decode_folded(torch.randn(1, 4, 128), cache, operand_dtype=torch.float8_e4m3fn, operand_terms=2)


def importlib_has(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def _flashinfer_layout(cache, page: int, layout: str = "NHD"):
    """The cache's NVFP4 codes and scales in FlashInfer's paged layout (two codes a byte, channel 2i low),
    pages of ``page`` tokens dealt out in reverse order; with the CSR that lists them."""
    e = cache.export()
    B, H, Q, D = e["k_codes"].shape
    lens = cache.seq_lens.long()
    need = [-(-int(n) // page) for n in lens]
    P = sum(need) + 1
    order = list(reversed(range(P)))
    data = {t: torch.zeros(P, page, H, D // 2, dtype=torch.uint8) for t in "kv"}
    sf = {t: torch.zeros(P, page, H, D // 16, dtype=torch.uint8) for t in "kv"}
    indices, indptr = [], [0]
    for b in range(B):
        pages = [order.pop() for _ in range(need[b])]
        indices += pages
        indptr.append(len(indices))
        for t in "kv":
            codes = e[f"{t}_codes"][b, :, : int(lens[b])].permute(1, 0, 2)  # [n, H, D]
            packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
            scales = e[f"{t}_scale"][b, :, : int(lens[b])].permute(1, 0, 2)
            for j, p in enumerate(pages):
                rows = slice(j * page, min((j + 1) * page, int(lens[b])))
                data[t][p, : rows.stop - rows.start] = packed[rows]
                sf[t][p, : rows.stop - rows.start] = scales[rows]
    last = [int(n) - (k - 1) * page if k else 0 for n, k in zip(lens, need)]
    kv = tuple(data[t] if layout == "NHD" else data[t].permute(0, 2, 1, 3) for t in "kv")
    sfs = tuple((sf[t] if layout == "NHD" else sf[t].permute(0, 2, 1, 3)).view(torch.float8_e4m3fn) for t in "kv")
    csr = (torch.tensor(indptr, dtype=torch.int32), torch.tensor(indices, dtype=torch.int32),
           torch.tensor(last, dtype=torch.int32))
    return kv, sfs, csr


@pytest.mark.parametrize("layout", ("NHD", "HND"))
def test_a_flashinfer_nvfp4_cache_is_taken_as_it_is(layout):
    fmt = foscar.KVFormat.fp4("nvfp4", 128)
    k, v = _values(3, 2, 100, 128, seed=11)
    lens = torch.tensor([100, 16, 33], dtype=torch.int32)
    cache = foscar.quantize_kv(k, v, fmt, seq_lens=lens, page_size=16)
    kv, sfs, (indptr, indices, last) = _flashinfer_layout(cache, 16, layout)
    ks, vs = cache.tensor_scales.tolist()
    got = foscar.from_flashinfer_nvfp4(kv, sfs, indptr, indices, last, k_scale=ks, v_scale=vs, kv_layout=layout)
    for a, b in zip(got.dequantize(), cache.dequantize()):
        assert torch.equal(a, b)
    with pytest.raises(InvalidArgumentError, match=r"^kv_indices: expected pages in"):
        foscar.from_flashinfer_nvfp4(kv, sfs, indptr, indices + 100, last, kv_layout=layout)
    with pytest.raises(InvalidArgumentError, match=r"^k_scale: expected a finite positive"):
        foscar.from_flashinfer_nvfp4(kv, sfs, indptr, indices, last, k_scale=float("nan"), kv_layout=layout)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and FlashInfer (none on this machine)")
@pytest.mark.parametrize("page", (16, 64))
def test_foscar_decodes_a_flashinfer_nvfp4_cache_as_flashinfer_does_gpu(page):
    """FlashInfer's own dequantization (``nvfp4_kv_dequantize``) and NVFP4 decode (fa2) of its paged cache
    against foscar's reading of the same bytes (its values; its reference decode within BF16 attention's
    error of the float64 oracle). FlashInfer's NVFP4 KV quantizer needs SM100+: on Hopper the bytes are
    foscar's quantizer's, in FlashInfer's layout. Pages of 64: the CuTe kernel too, where it runs."""
    fi = pytest.importorskip("flashinfer")
    dev = torch.device("cuda")
    fmt = foscar.KVFormat.fp4("nvfp4", 128)
    k, v = _values(2, 4, 300, 128, seed=12)
    lens = torch.tensor([300, 129], dtype=torch.int32)
    cache = foscar.quantize_kv(k, v, fmt, seq_lens=lens, page_size=page)
    kv, sfs, (indptr, indices, last) = _flashinfer_layout(cache, page)
    kv, sfs = tuple(x.to(dev) for x in kv), tuple(x.to(dev) for x in sfs)
    ks, vs = cache.tensor_scales.tolist()
    q = torch.randn(2, 16, 128, dtype=torch.bfloat16, device=dev)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True, backend="fa2")
    wrapper.plan(indptr.to(dev), indices.to(dev), last.to(dev), 16, 4, 128, page, q_data_type=torch.bfloat16,
                 kv_data_type=torch.uint8)
    fi_out = wrapper.run(q, kv, k_scale=ks, v_scale=vs, kv_cache_sf=sfs).float()
    ours = foscar.from_flashinfer_nvfp4(kv, sfs, indptr.to(dev), indices.to(dev), last.to(dev), k_scale=ks,
                                        v_scale=vs)
    for t, scale in ((0, ks), (1, vs)):  # FlashInfer's own dequantization of its pages (SM80+)
        fi_values = fi.nvfp4_kv_dequantize(kv[t].reshape(-1, 64), sfs[t].view(torch.uint8).reshape(-1, 8),
                                           torch.tensor([scale], dtype=torch.float32, device=dev),
                                           torch.bfloat16).reshape(*kv[t].shape[:3], 128)
        dense = ours.dequantize()[t]
        for b in range(2):
            pages = indices[int(indptr[b]): int(indptr[b + 1])].to(dev).long()
            n = int(lens[b])
            want = fi_values[pages].reshape(-1, 4, 128)[:n].permute(1, 0, 2).double()
            assert torch.allclose(dense[b, :, :n].bfloat16().double(), want, rtol=2 ** -8, atol=0)
    exact = foscar.decode_exact(q, ours)
    base = rel(bf16_attention(q.float(), ours), exact)
    backends = ["reference", "triton"]  # the PyTorch spec, and the kernels on FlashInfer's pages
    key = foscar.backends.ProblemKey(dev, ours.fmt, 4, page)
    if page % 64 == 0 and foscar.backends.get("cute").status(key).usable:
        backends.append("cute")
    for backend in backends:
        got = foscar.decode(q, ours, backend=backend).float()
        print(f"\nFlashInfer NVFP4 {rel(fi_out, exact):.3e}, foscar {backend} {rel(got, exact):.3e}, "
              f"BF16 attention {base:.3e}, FlashInfer vs foscar {rel(fi_out, got):.3e}")
        assert rel(got, exact) <= 1.05 * base + 1e-4
        assert rel(fi_out, got) <= 2 * base + 1e-3  # the same bytes read the same way


def test_the_accuracy_study_takes_the_fp4_formats():
    """``foscar bench accuracy --fp4``: the study's FP4 rows (the reference backend on the stress input), their
    arithmetic error below BF16 attention's on the same dequantized cache."""
    from foscar.bench import accuracy as acc
    from foscar.synthetic import stress_inputs
    assert [c.fmt(128, 128).scheme for c in acc.FP4_CONFIGS] == ["nvfp4"] * 3 + ["mxfp4"] * 2
    q, k, v = stress_inputs(1, 8, 2, 300, 128, seed=0, dtype=torch.bfloat16, device=torch.device("cpu"))
    formats = [(c.name, c.fmt(128, 128), c.quantizer) for c in acc.FP4_CONFIGS[1:4:2]]

    def decode(q, cache):
        return foscar.decode(q, cache, out=torch.empty(q.shape, dtype=torch.float32), backend="reference")
    rows = acc.error_rows(q, k, v, formats, decode, "reference")[1:]
    assert [r["format"] for r in rows] == ["nvfp4", "mxfp4"]
    for r in rows:
        assert r["err_vs_dequantized"] < r["bf16_err_vs_dequantized"] and r["err_vs_unquantized"] < 0.5
