"""The public API driven with random formats, shapes, dtypes, chunkings and extreme magnitudes
(1e-30 ... 1e38, +-Inf, NaN). Every call ends in one of three ways:

- a clear foscar error (``foscar.FoscarError``), and a refused append leaves the cache as it was;
- an output that matches the float64 oracle (:func:`foscar.decode_exact`) as closely as BF16 attention on
  the same cache does;
- NaN exactly where the oracle is NaN, and non-finite values only where the output dtype overflows or
  the scores can overflow FP32 (the write paths bound stored values so that nothing else can).

Never a finite wrong answer, never a foreign exception. Writing a cache in one call (``quantize_kv``)
and in random chunks (``append``) either both refuse or give the same cache.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from _cases import same_state, snapshot
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import foscar
from foscar import FoscarError, KVFormat, QuantKVCache

from _cases import GPU
MAGNITUDES = (1e-30, 1e-8, 1.0, 1.0, 1.0, 1e4, 1e26, 1e30, 1e38)
SPECIALS = (math.inf, -math.inf, math.nan, 7e4, 1e300)
INPUT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@st.composite
def formats(draw):
    bits = draw(st.sampled_from((2, 4)))
    head_dim = draw(st.sampled_from((64, 128)))
    k_axis, v_axis = draw(st.sampled_from(("token", "channel"))), draw(st.sampled_from(("token", "channel")))
    groups = [g for g in (32, 64, 128) if "token" not in (k_axis, v_axis) or head_dim % g == 0]
    return KVFormat(bits=bits, head_dim=head_dim, group_size=draw(st.sampled_from(groups)), k_axis=k_axis,
                    v_axis=v_axis, sink=draw(st.sampled_from((0, 0, 2, 5))), recent=draw(st.sampled_from((0, 0, 3, 17))),
                    mapping=draw(st.sampled_from(("bf16", "bf16", "f16", "e4m3"))))


@st.composite
def values(draw, shape, dtype):
    """Normal values at a drawn magnitude and offset, in ``dtype``, with a few drawn specials."""
    seed = draw(st.integers(0, 2 ** 16))
    mag = draw(st.sampled_from(MAGNITUDES))
    offset = draw(st.sampled_from((0.0, 0.0, 3.0, -20.0)))
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) + offset) * mag
    for _ in range(draw(st.integers(0, 2))):
        if draw(st.integers(0, 3)) == 0 and x.numel():
            idx = tuple(draw(st.integers(0, n - 1)) for n in shape)
            x[idx] = draw(st.sampled_from(SPECIALS))
    return x.to(dtype)


def attempt(fn):
    """``(result, None)`` or ``(None, error)`` for a foscar error; any other exception fails the test."""
    try:
        return fn(), None
    except FoscarError as e:
        return None, e


def check_decode(q, cache, backend: str) -> None:
    """Decode through ``backend`` (``"triton-interpreted"``: the Triton launcher itself, which runs under the
    interpreter on a CPU) and hold the result to the oracle as the module docstring says."""
    before = snapshot(cache)
    if backend == "triton-interpreted":
        import foscar.triton as ft
        got, err = attempt(lambda: ft.decode(q, cache, return_lse=True))
    else:
        got, err = attempt(lambda: foscar.decode(q, cache, backend=backend, return_lse=True))
    assert same_state(snapshot(cache), before)
    ref, ref_err = attempt(lambda: foscar.decode_exact(q, cache, return_lse=True))
    if err is not None:  # what the API refuses, the oracle refuses too (the same input checks)
        assert ref_err is not None, f"decode refused what the oracle takes: {err}"
        event(f"decode refused: {err.argument if hasattr(err, 'argument') else err.what}")
        return
    event("decoded")
    assert ref_err is None, ref_err
    (out, lse), (ref, ref_lse) = got, ref
    ref_cast = ref.to(out.dtype).double()  # the oracle rounded to the output dtype
    nan_diff = torch.isnan(out) != torch.isnan(ref)
    assert not nan_diff.any(), ("NaN where the oracle is not, or the reverse", nan_diff.nonzero()[:3].tolist(),
                                out[nan_diff][:3].tolist(), ref[nan_diff][:3].tolist())
    over = ~torch.isfinite(ref_cast) & ~torch.isnan(ref)  # the output dtype overflows
    assert (~torch.isfinite(out[over])).all()
    fin = torch.isfinite(ref_cast)
    bad = fin & ~torch.isfinite(out)
    if bad.any():  # allowed only where the scores can overflow FP32 (stored values are bounded so nothing else can)
        kd, _ = cache.dequantize()
        reach = float(q.double().abs().max()) * float(kd.abs().max()) * q.shape[-1]
        assert reach > 1e36, f"non-finite output for scores far from the FP32 range ({reach:.3g})"
    from _helpers import bf16_attention
    base = bf16_attention(q.float(), cache) if q.dtype != torch.float64 else None
    for b in range(out.shape[0]):
        for h in range(out.shape[1]):
            m = fin[b, h] & torch.isfinite(out[b, h])
            if not m.any():
                continue
            o, r = out[b, h].double()[m], ref_cast[b, h][m]
            scale = float(ref[b, h][m].abs().max())
            if scale == 0:
                assert float(o.abs().max()) == 0, "non-zero output where the oracle is exactly zero"
                continue
            fi = torch.finfo(out.dtype)
            tol = 3e-2 * scale + 2 * max(fi.eps * scale, fi.tiny * fi.eps)  # two steps of the output dtype
            if base is not None:
                bb = base[b, h].double()[m]
                if torch.isfinite(bb).all():
                    tol += 3 * float((bb - ref[b, h][m]).abs().max())
            assert float((o - r).abs().max()) <= tol, (b, h, float((o - r).abs().max()), tol)
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    assert torch.equal(lse[ref_lse == -math.inf], ref_lse[ref_lse == -math.inf].float())
    if live.any():
        d = (lse.double()[live] - ref_lse[live]).abs() / ref_lse[live].abs().clamp(min=1.0)
        d = d[torch.isfinite(d)]
        assert not d.numel() or float(d.max()) < 5e-2, float(d.max())


@st.composite
def problems(draw):
    fmt = draw(formats())
    B, H, G = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from((1, 2, 4)))
    L = draw(st.integers(0, 150))
    dtype = draw(st.sampled_from(INPUT_DTYPES))
    window_dtype = draw(st.sampled_from((torch.bfloat16, torch.float16)))
    k = draw(values((B, H, L, fmt.head_dim), dtype))
    v = draw(values((B, H, L, fmt.head_dim), dtype))
    # queries scaled against the keys, so that scores stay in the range where BF16 attention is accurate
    kmag = float(k.double()[torch.isfinite(k.double())].abs().max()) if torch.isfinite(k.double()).any() else 1.0
    temp = draw(st.sampled_from((0.0, 1e-3, 1.0, 4.0)))
    q_dtype = draw(st.sampled_from((torch.bfloat16, torch.float16, torch.float32)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    q = torch.randn(B, H * G, fmt.head_dim, generator=gen, dtype=torch.float64) * temp / max(kmag, 1e-300)
    if draw(st.integers(0, 9)) == 0:
        q[tuple(draw(st.integers(0, n - 1)) for n in q.shape)] = draw(st.sampled_from((math.nan, math.inf)))
    chunks = draw(st.lists(st.integers(1, 60), min_size=1, max_size=5))
    lens = draw(st.lists(st.integers(0, L), min_size=B, max_size=B))
    page = draw(st.sampled_from((None, 64, 128)))
    return dict(fmt=fmt, k=k, v=v, q=q.to(q_dtype), window_dtype=window_dtype, chunks=chunks, lens=lens, page=page)


def build_in_chunks(p):
    """The cache written by appends of the drawn chunk sizes (every sequence the full length); ``(cache,
    error)``: the first refused append's error, after checking that it changed nothing."""
    fmt, k, v = p["fmt"], p["k"], p["v"]
    B, H, L, _ = k.shape
    cache = QuantKVCache.empty(fmt, B, H, max_len=max(L, 1), page_size=p["page"] or 64,
                               window_dtype=p["window_dtype"])
    t = 0
    sizes = [c for c in p["chunks"]] + [L]
    for c in sizes:
        c = min(c, L - t)
        if c <= 0:
            break
        before = snapshot(cache)
        _, err = attempt(lambda: cache.append(k[:, :, t: t + c], v[:, :, t: t + c]))
        if err is not None:
            assert same_state(snapshot(cache), before), "a refused append changed the cache"
            return cache, err
        t += c
    return cache, None


#: examples per run (CI: 200, about ten seconds); FOSCAR_FUZZ_EXAMPLES=5000 for a longer search
FUZZ = settings(max_examples=int(os.environ.get("FOSCAR_FUZZ_EXAMPLES", 200)), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(p=problems())
def test_writes_and_decodes_are_right_or_refused(p):
    fmt, k, v = p["fmt"], p["k"], p["v"]
    B, H, L, _ = k.shape
    full = torch.full((B,), L, dtype=torch.int32)
    whole, err_whole = attempt(lambda: foscar.quantize_kv(k, v, fmt, seq_lens=full, page_size=p["page"],
                                                          window_dtype=p["window_dtype"]))
    chunked, err_chunked = build_in_chunks(p)
    # a value is refused by the rule of where it is stored, whatever the chunking
    assert (err_whole is None) == (err_chunked is None), (err_whole, err_chunked)
    event("write refused" if err_whole is not None else "written")
    if err_whole is None:
        ea, eb = whole.export(), chunked.export()
        for name, x in ea.items():
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, eb[name]), name
        check_decode(p["q"], chunked, "auto")
    lens = torch.tensor(p["lens"], dtype=torch.int32)
    cache, err = attempt(lambda: foscar.quantize_kv(k, v, fmt, seq_lens=lens, page_size=p["page"],
                                                    window_dtype=p["window_dtype"]))
    if err is None:
        check_decode(p["q"], cache, "auto")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems())
def test_the_triton_kernels_are_right_or_refused(p):
    """The same contract through the Triton kernels (the interpreter on a CPU-only machine; few examples:
    each runs a whole kernel interpreted)."""
    fmt = p["fmt"]
    if fmt.mapping != "bf16":
        fmt = KVFormat(**{**fmt.__dict__, "mapping": "bf16"})
    k, v = p["k"], p["v"]
    lens = torch.tensor(p["lens"], dtype=torch.int32)
    cache, err = attempt(lambda: foscar.quantize_kv(k, v, fmt, seq_lens=lens, page_size=p["page"],
                                                    window_dtype=p["window_dtype"]))
    if err is not None:
        return
    q = p["q"]
    if GPU:
        from foscar.bench import cache_to
        cache, q = cache_to(cache, "cuda"), q.cuda()
        if not torch.isfinite(q).all():
            return  # the GPU path does not read q back to check it: covered on the CPU
        check_decode(q, cache, "triton")
    else:
        check_decode(q, cache, "triton-interpreted")


@pytest.mark.gpu
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems())
def test_every_gpu_backend_is_right_or_refused(p):
    """The contract through ``auto`` and every usable GPU backend, on the GPU."""
    from foscar.bench import cache_to
    lens = torch.tensor(p["lens"], dtype=torch.int32)
    cache, err = attempt(lambda: foscar.quantize_kv(p["k"], p["v"], p["fmt"], seq_lens=lens, page_size=p["page"],
                                                    window_dtype=p["window_dtype"]))
    if err is not None or not torch.isfinite(p["q"]).all():
        return
    cache, q = cache_to(cache, "cuda"), p["q"].cuda()
    for s in foscar.backend_status(fmt=cache.fmt, gqa=q.shape[1] // cache.num_kv_heads, page_size=cache.page_size):
        if s.usable and s.name != "reference":
            check_decode(q, cache, s.name)
