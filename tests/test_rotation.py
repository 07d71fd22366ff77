"""Rotated caches (``KVFormat(rotation="hadamard")``): the matrix is orthonormal and seeded; K and V are
stored rotated and every entry point gives results of the unrotated values (the oracle, the folded
spec, ``foscar.decode`` and plans on the CPU); appending chunk by chunk writes what quantizing the whole
does, bit for bit; a rotation spreads an outlier channel and lowers the quantization error; bad
arguments are refused by name. The GPU backends are covered by the same API (the query rotated in, the
output rotated back, around any backend) and by the GPU suites."""
import math

import pytest
import torch
from _helpers import rel

import foscar
from foscar.errors import InvalidArgumentError
from foscar.rotation import rotate, rotation_matrix


def fmt_of(**kw):
    return foscar.KVFormat(**{"bits": 4, "head_dim": 128, "group_size": 128, "rotation": "hadamard", **kw})


@pytest.mark.parametrize("D", (64, 128, 256))
@pytest.mark.parametrize("seed", (None, 0, 5))
def test_the_rotation_is_orthonormal_and_seeded(D, seed):
    fmt = fmt_of(head_dim=D, group_size=64, rotation_seed=seed)
    r = rotation_matrix(fmt)
    assert torch.allclose(r @ r.T, torch.eye(D, dtype=torch.float64), atol=1e-13, rtol=0)
    assert bool((r.abs() == 1 / math.sqrt(D)).all())  # every channel spread over every channel
    assert torch.equal(r, rotation_matrix(fmt_of(head_dim=D, group_size=64, rotation_seed=seed)))
    if seed is not None:
        assert not torch.equal(r, rotation_matrix(fmt_of(head_dim=D, group_size=64, rotation_seed=seed + 1)))


@pytest.mark.parametrize("kw,name", [({"rotation": "givens"}, "rotation"), ({"rotation": None, "rotation_seed": 1},
                                     "rotation_seed"), ({"rotation_seed": -1}, "rotation_seed"),
                                     ({"rotation_seed": 1.5}, "rotation_seed")])
def test_bad_rotations_are_refused_by_name(kw, name):
    with pytest.raises(InvalidArgumentError, match=f"^{name}: expected"):
        fmt_of(**kw)


def _inputs(B=2, H=2, L=700, D=128, G=4, outlier=20.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, B, H, L, D, generator=gen).unbind(0)
    k[..., 5] *= outlier  # an outlier channel, as real keys have
    q = torch.randn(B, H * G, D, generator=gen)
    return q, k, v


def _attention(q, k, v):
    """float64 attention over unquantized ``k, v [B, H, L, D]``, GQA by head groups."""
    B, H, L, D = k.shape
    G = q.shape[1] // H
    s = torch.einsum("bhgd,bhld->bhgl", q.double().view(B, H, G, D), k.double()) / math.sqrt(D)
    return torch.einsum("bhgl,bhld->bhgd", s.softmax(-1), v.double()).reshape(B, H * G, D)


@pytest.mark.parametrize("kw", ({}, {"rotation_seed": 3, "sink": 4, "recent": 32},
                                {"bits": 2, "k_axis": "channel", "group_size": 64, "rotation_seed": 1}))
def test_a_rotated_cache_gives_the_results_of_its_values(kw):
    """dequantize() gives the values back in their own space; the folded spec equals the oracle in float64;
    foscar.decode and a plan (the reference backend here) are within the kernels' arithmetic of it, their
    LSE the oracle's."""
    q, k, v = _inputs()
    fmt = fmt_of(**kw)
    cache = foscar.quantize_kv(k, v, fmt, page_size=64)
    kd, vd = cache.dequantize()
    plain = foscar.quantize_kv(rotate(k, fmt), rotate(v, fmt), foscar.KVFormat(**{**fmt.__dict__, "rotation": None,
                                                                                   "rotation_seed": None}), page_size=64)
    kp, vp = plain.dequantize()  # the same codes, unrotated by hand
    assert torch.allclose(kd, rotate(kp, fmt, inverse=True), atol=1e-12, rtol=0)
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    assert torch.allclose(exact, _attention(q.double(), kd, vd), atol=1e-12, rtol=0)
    folded = foscar.decode_folded(q, cache)
    assert rel(folded, exact) < 1e-12
    out, lse = foscar.decode(q, cache, return_lse=True)
    assert rel(out, exact) < 5e-3  # BF16 QK operands: the query's rounding moves a score by 2^-9 of it
    assert bool(((lse.double() - lse_exact).abs() <= 2e-3 * (lse_exact.abs() + 1)).all())
    planned = foscar.plan(q, cache).run(q, cache)
    assert torch.equal(planned, out)


@pytest.mark.parametrize("kw", ({"rotation_seed": 2, "sink": 4, "recent": 16}, {"k_axis": "channel", "group_size": 64},
                                {"bits": 2, "rotation_seed": 9}))
def test_chunked_appends_write_what_quantizing_the_whole_does(kw):
    """A token's rotated values do not depend on the tokens rotated with it (float64, rounded once), so
    appending in chunks (reference write path) and quantizing at once store the same cache, bit for bit."""
    _, k, v = _inputs(L=300)
    fmt = fmt_of(**kw)
    cache = foscar.QuantKVCache.empty(fmt, 2, 2, max_len=300, page_size=64)
    for t0, t1 in ((0, 130), (130, 131), (131, 200), (200, 300)):
        foscar.append(cache, k[:, :, t0:t1], v[:, :, t0:t1], backend="reference")
    whole = foscar.quantize_kv(k, v, fmt, page_size=64)
    for a, b in zip(cache.dequantize(), whole.dequantize()):
        assert torch.equal(a, b)


def test_rotation_lowers_the_error_of_an_outlier_channel():
    q, k, v = _inputs(outlier=30.0)
    ref = _attention(q, k, v)
    errs = {}
    for rot in (None, "hadamard"):
        for bits in (4, 2):
            fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, rotation=rot)
            errs[rot, bits] = rel(foscar.decode_exact(q, foscar.quantize_kv(k, v, fmt)), ref)
    assert errs["hadamard", 4] < 0.5 * errs[None, 4] and errs["hadamard", 2] < errs[None, 2]


def test_the_transformers_cache_takes_a_rotation():
    pytest.importorskip("transformers")
    from foscar.integrations.transformers import FoscarCache
    cache = FoscarCache(bits=2, rotation="hadamard", rotation_seed=0)
    assert cache.fmt_kwargs["rotation"] == "hadamard"
    with pytest.raises(InvalidArgumentError, match="^rotation: expected"):
        FoscarCache(rotation="dct")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ("auto", "triton", "cute"))
def test_every_gpu_backend_decodes_a_rotated_cache_gpu(backend):
    """Through foscar.decode and a CUDA-graph replay of a plan: within the kernels' bound of the oracle."""
    from _helpers import bf16_attention, kernel_error_bound
    q, k, v = (x.cuda() for x in _inputs(L=3000))
    fmt = fmt_of(bits=2, rotation_seed=4)
    cache = foscar.quantize_kv(k, v, fmt, page_size=64)
    status = {s.name: s for s in foscar.backend_status(q.device, fmt, 4)}
    if backend != "auto" and not status[backend].usable:
        pytest.skip(status[backend].why)
    q = q.bfloat16()
    out = foscar.decode(q, cache, backend=backend)
    exact = foscar.decode_exact(q, cache)
    assert rel(out, exact) <= kernel_error_bound(fmt, rel(bf16_attention(q, cache, sdpa=True), exact))
    plan = foscar.plan(q, cache, backend=backend)
    graph_out = torch.empty_like(out)
    plan.run(q, cache, out=graph_out)  # warm-up outside the graph
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(q, cache, out=graph_out)
    graph_out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, out)


CUTE_ROTATED = [  # (bits, D, G, windows, variant): v1 E4M3 K two tiles a pass, v1 BF16 K, v0, with windows
    (2, 128, 4, None, dict(warp_specialized=True, k_operand="e4m3", tiles_per_pass=2)),
    (4, 64, 2, None, dict(warp_specialized=True, k_operand="e4m3", tiles_per_pass=2)),
    (4, 128, 1, None, dict(warp_specialized=True, k_operand="bf16", tiles_per_pass=1)),
    (2, 64, 8, None, dict(warp_specialized=False)),
    (4, 128, 4, (4, 100), dict(warp_specialized=True)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits,D,G,windows,variant", CUTE_ROTATED)
def test_the_cute_kernels_rotate_in_and_back_gpu(bits, D, G, windows, variant):
    """The CuTe kernels take a rotated cache's query and output as they are (stage 1 rotates Q, the merge
    the output): each variant within the kernels' bound of the oracle, the LSE as close to the exact
    decode's as the Triton kernel's (the rotation leaves it unchanged), NaN-poisoned outputs all written."""
    from _helpers import bf16_attention, kernel_error_bound

    from foscar.cute.launch import decode
    status = {s.name: s for s in foscar.backend_status(torch.device("cuda"), fmt_of(bits=bits), 4)}
    if not status["cute"].usable:
        pytest.skip(status["cute"].why)
    sink, recent = windows or (0, 0)
    fmt = fmt_of(bits=bits, head_dim=D, group_size=64, rotation_seed=7, sink=sink, recent=recent)
    q, k, v = (x.cuda() for x in _inputs(L=2000, D=D, G=G, seed=bits + D + G))
    cache = foscar.quantize_kv(k, v, fmt, page_size=64)
    q = q.bfloat16()
    out = torch.full_like(q, float("nan"))
    out, lse = decode(q, cache, out=out, return_lse=True, num_splits=3, **variant)
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    assert bool(torch.isfinite(out).all())
    assert rel(out, exact) <= kernel_error_bound(fmt, rel(bf16_attention(q, cache, sdpa=True), exact))
    # the LSE: as close to the exact decode's as the Triton kernel's (the query rotated around it, BF16 operands)
    _, lse_triton = foscar.decode(q, cache, backend="triton", return_lse=True)
    base = float((lse_triton.double() - lse_exact.double()).abs().max())
    assert float((lse.double() - lse_exact.double()).abs().max()) <= 1.5 * base + 1e-3


def test_rotated_codes_written_elsewhere_decode_when_the_rotation_is_named():
    """export() gives the rotated codes with the format naming the rotation; from_quantized of them (as an
    OSCAR-style writer stores them) decodes to the same output."""
    q, k, v = _inputs(L=300)
    fmt = fmt_of(bits=2, rotation_seed=6, sink=4, recent=8)
    cache = foscar.quantize_kv(k, v, fmt)
    e = cache.export()
    assert e["format"].rotation == "hadamard"
    names = ("k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset", "seq_lens", "k_sink", "v_sink",
             "k_recent", "v_recent")
    again = foscar.QuantKVCache.from_quantized(e["format"], **{n: e[n] for n in names})
    assert rel(foscar.decode_exact(q, again), foscar.decode_exact(q, cache)) < 1e-12


def test_the_triton_write_path_writes_a_rotated_cache_as_the_reference_does():
    """foscar.append's Triton branch rotates the tokens as QuantKVCache.append does, then runs the Triton
    kernels: the two caches are equal bit for bit (the kernels under the interpreter on the CPU)."""
    import foscar.triton as ft
    from foscar.rotation import rotate_given
    from _cases import DEV, same_state, snapshot
    fmt = fmt_of(head_dim=64, group_size=32, bits=2, rotation_seed=8, sink=3, recent=5)
    # tokens whose rotated values are small multiples of 1/4 (BF16-exact: the interpreter truncates FP32 to
    # BF16 casts where the GPU rounds): y R^T with R's entries +-1/8 is exact in FP32, and so is its rotation
    gen = torch.Generator().manual_seed(3)
    r = rotation_matrix(fmt)
    k, v = ((torch.randint(-8, 9, (1, 2, 140, 64), generator=gen).double() / 4) @ r.T for _ in range(2))
    k, v = (x.float().to(DEV) for x in (k, v))
    assert torch.equal(rotate(k, fmt), (rotate(k, fmt) * 4).round() / 4)
    ref = foscar.QuantKVCache.empty(fmt, 1, 2, max_len=140, page_size=64, device=DEV)
    ker = foscar.QuantKVCache.empty(fmt, 1, 2, max_len=140, page_size=64, device=DEV)
    for t0, t1 in ((0, 70), (70, 71), (71, 140)):
        ref.append(k[:, :, t0:t1], v[:, :, t0:t1])
        kr, vr = rotate_given(fmt, k[:, :, t0:t1], v[:, :, t0:t1])
        if t1 - t0 == 1:
            ft.append_step(ker, kr[:, :, 0].contiguous(), vr[:, :, 0].contiguous(), check=False)
        else:
            ft.append(ker, kr, vr, check=False)
    assert same_state(snapshot(ref), snapshot(ker))
