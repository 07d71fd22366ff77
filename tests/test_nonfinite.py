"""Nothing silently wrong: a value a cache cannot hold is refused by name (the cache left as it was), a
NaN or infinite partial makes the merged output NaN in every backend's merge (never zeros), every window
dtype decodes on every backend, and appends in any chunking give the cache ``quantize_kv`` builds.

On a CPU-only machine the Triton cases run under the interpreter (conftest); the CuTe and compiled
Triton cases need a GPU.
"""
from __future__ import annotations

import math

import pytest
import torch
from _cases import DEV, GPU, broken_cache, same_state, snapshot

import foscar
from foscar import InvalidArgumentError, KVFormat, QuantKVCache

NAN = float("nan")


def gpu_backends() -> list[str]:
    """The GPU decode backends usable here (none on a CPU-only machine)."""
    if not GPU:
        return []
    return [s.name for s in foscar.backend_status() if s.usable and s.name != "reference"]


def assert_unchanged(cache: QuantKVCache, before: list[torch.Tensor]) -> None:
    assert same_state(snapshot(cache), before)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --------------------------------------------------------------------------------------------
# Values the cache cannot hold are refused where they are converted
# --------------------------------------------------------------------------------------------
def test_a_value_that_overflows_an_fp16_window_is_refused():
    """The issue's case: 1e5 in an FP16 sink is Inf once stored; it is refused by name instead."""
    fmt = KVFormat(bits=2, head_dim=128, group_size=128, sink=4, recent=64)
    k, v = randn(2, 2, 256, 128, seed=1), randn(2, 2, 256, 128, seed=2)
    k[0, 1, 2, :] = 1e5
    with pytest.raises(InvalidArgumentError, match=r"^k: expected values the float16 windows hold .*"
                                                   r"got 100000.0 at index \(0, 1, 2, 0\)"):
        foscar.quantize_kv(k, v, fmt, window_dtype=torch.float16)
    foscar.quantize_kv(k, v, fmt)  # control: a BF16 window holds it


@pytest.mark.parametrize("where", ["sink", "ring", "quantized"])
def test_appending_what_an_fp16_window_cannot_hold_changes_nothing(where):
    """7e4 > 65504: refused whether the token lands in the sink, in the ring, or is quantized at once (a
    format with a ring quantizes every token from the window dtype, whatever the chunking)."""
    fmt = KVFormat(bits=4, head_dim=64, group_size=64, sink=2, recent=8)
    cache = QuantKVCache.empty(fmt, 2, 2, max_len=256, window_dtype=torch.float16)
    foscar.append(cache, randn(2, 2, {"sink": 1, "ring": 5, "quantized": 40}[where], 64), randn(2, 2, 1, 64)
                  .expand(2, 2, {"sink": 1, "ring": 5, "quantized": 40}[where], 64).contiguous())
    before = snapshot(cache)
    k = randn(2, 2, 30, 64, seed=3)
    k[1, 0, 0, 7] = -7e4
    with pytest.raises(InvalidArgumentError, match=r"^k_new: expected values the float16 windows hold .*"
                                                   r"at index \(1, 0, 0, 7\)"):
        foscar.append(cache, k, randn(2, 2, 30, 64, seed=4))
    assert_unchanged(cache, before)
    k[1, 0, 0, 7] = 6e4  # control: within FP16
    foscar.append(cache, k, randn(2, 2, 30, 64, seed=4))


def test_a_format_without_a_ring_quantizes_what_no_window_holds():
    """No ring (token-wise groups, no recent window): post-sink tokens go straight to the quantizer, so a
    value an FP16 window cannot hold is stored, quantized, and decodes like the oracle."""
    fmt = KVFormat(bits=4, head_dim=64, group_size=64, sink=2)
    k, v = randn(1, 1, 40, 64, seed=5), randn(1, 1, 40, 64, seed=6)
    k[0, 0, 10] *= 1e5
    cache = foscar.quantize_kv(k, v, fmt, window_dtype=torch.float16)
    q = randn(1, 2, 64, seed=7) * 1e-5
    out = foscar.decode(q, cache)
    assert float((out.double() - foscar.decode_exact(q, cache)).norm() / foscar.decode_exact(q, cache).norm()) < 1e-2


@pytest.mark.parametrize("bits", [2, 4])
def test_quantized_values_past_the_fp32_constants_are_refused(bits):
    """Past ``max_abs_value`` a group's z' = z - 128 s' or a decode's FP32 sums could be Inf. Refused by
    name; at the limit the cache decodes like the oracle."""
    fmt = KVFormat(bits=bits, head_dim=64, group_size=64)
    lim = fmt.max_abs_value
    assert math.isfinite(lim) and lim > 1e26
    k = randn(1, 1, 16, 64, seed=8, dtype=torch.float64)
    v = randn(1, 1, 16, 64, seed=9, dtype=torch.float64)
    for bad in (lim * 1.001, 1e39, -1e300):
        k2 = k.clone()
        k2[0, 0, 3, 5] = bad
        with pytest.raises(InvalidArgumentError, match=r"^k: expected values of magnitude <= .* at index "
                                                       r"\(0, 0, 3, 5\)"):
            foscar.quantize_kv(k2, v, fmt)
    k2 = k.clone()
    k2[0, 0, 3] = lim * torch.sign(k2[0, 0, 3])
    cache = foscar.quantize_kv(k2, v, fmt)
    for t in (cache.k_params, cache.v_params):
        assert torch.isfinite(t).all()
    q = randn(1, 1, 64, seed=10, dtype=torch.float64) / lim  # scores of order 1
    out, ref = foscar.decode(q, cache), foscar.decode_exact(q, cache)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("name,value", [("k_scale", 1e39), ("v_scale", 1e39), ("k_offset", 1e39),
                                        ("v_offset", -1e38), ("k_scale", 3e27)])
def test_from_quantized_checks_the_folded_constants(name, value):
    """Finite float64 (s, z) whose FP32 (s', z') or group values overflow are refused by name (a scale of
    1e39 used to be stored as Inf and decode to zeros)."""
    fmt = KVFormat(bits=2, head_dim=64, group_size=64)
    src = foscar.quantize_kv(randn(1, 1, 32, 64), randn(1, 1, 32, 64, seed=1), fmt).export()
    kw = {n: src[n] for n in ("k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset", "seq_lens")}
    kw[name] = kw[name].clone()
    kw[name][0, 0, 4, 0] = value
    with pytest.raises(InvalidArgumentError, match=rf"^{name}: expected groups whose values .* at index \(0, 0, 4, 0\)"):
        QuantKVCache.from_quantized(fmt, **kw)
    QuantKVCache.from_quantized(fmt, **{n: src[n] for n in kw})  # control


# --------------------------------------------------------------------------------------------
# A broken partial is NaN after every merge
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_lse,bad_out", [(NAN, NAN), (NAN, 1.0), (math.inf, 1.0), (0.0, NAN)])
def test_combine_partials_propagates_a_broken_partial(bad_lse, bad_out):
    """A NaN or +inf LSE makes output and LSE NaN; a NaN output of a live partial makes the output NaN."""
    outs = [torch.ones(1, 4), torch.full((1, 4), bad_out)]
    out, lse = foscar.combine_partials(outs, [torch.zeros(1), torch.tensor([bad_lse])])
    assert torch.isnan(out).all()
    assert torch.isnan(lse).all() == (not math.isfinite(bad_lse))


def test_combine_partials_ignores_empty_partials_whatever_they_hold():
    out, lse = foscar.combine_partials([torch.ones(1, 4), torch.full((1, 4), NAN)],
                                       [torch.zeros(1), torch.tensor([-math.inf])])
    assert torch.equal(out, torch.ones(1, 4)) and torch.equal(lse, torch.zeros(1))
    out, lse = foscar.combine_partials([torch.full((1, 4), NAN)] * 2, [torch.tensor([-math.inf])] * 2)
    assert torch.equal(out, torch.zeros(1, 4)) and lse.item() == -math.inf


@pytest.mark.parametrize("bad_lse", [NAN, math.inf])
def test_the_triton_merge_propagates_a_broken_partial(bad_lse):
    """The standalone merge kernel (the fused one is the same function, :func:`merge_parts`)."""
    from foscar.splitkv import combine
    B, Hq, parts, D = 1, 3, 5, 64
    o = torch.ones(B, Hq, parts, D, device=DEV)
    lse = torch.zeros(B, Hq, parts, device=DEV)
    lse[0, 1, 2] = bad_lse
    lse[0, 2, 1:] = -math.inf  # head 2: one live partial, the rest empty (their outputs garbage)
    o[0, 2, 1:] = NAN
    out = torch.full((B, Hq, D), 7.0, device=DEV)
    l_out = torch.full((B, Hq), 7.0, device=DEV)
    combine(o, lse, out, l_out)
    assert torch.isnan(out[0, 1]).all() and torch.isnan(l_out[0, 1])
    assert torch.allclose(out[0, 0], torch.ones(D, device=DEV)) and abs(float(l_out[0, 0]) - math.log(5)) < 1e-5
    assert torch.allclose(out[0, 2], torch.ones(D, device=DEV)) and abs(float(l_out[0, 2])) < 1e-6


@pytest.mark.parametrize("where", ["sink", "recent", "params"])
@pytest.mark.parametrize("backend", ["reference", "triton"] + [b for b in gpu_backends() if b != "triton"])
def test_a_broken_cache_decodes_to_nan_not_zeros(backend, where):
    """NaN exactly where the oracle is NaN (a NaN key: the query heads of its KV head; a NaN value: its
    channel), in the output and in the LSE; every other element matches the oracle. Those heads used to
    be zeros: a NaN partial weighed nothing in the merge."""
    dev = DEV if backend != "reference" else "cpu"
    cache = broken_cache(where, dev)
    q = randn(2, 4, 64, seed=3).to(torch.bfloat16).to(dev)
    out = torch.full((2, 4, 64), 7.0, dtype=torch.float32, device=dev)
    lse = torch.full((2, 4), 7.0, device=dev)
    if backend == "triton" and not GPU:
        import foscar.triton as ft
        ft.decode(q, cache, out=out, lse=lse, num_splits=2)
    else:
        foscar.decode(q, cache, out=out, lse=lse, backend=backend)
    ref, ref_lse = foscar.decode_exact(q, cache, return_lse=True)
    assert torch.isnan(ref[0, 2:]).any()
    assert torch.equal(torch.isnan(out).cpu(), torch.isnan(ref).cpu())
    assert torch.equal(torch.isnan(lse).cpu(), torch.isnan(ref_lse).cpu())
    fin = ~torch.isnan(ref)
    err = float((out.double() - ref)[fin].norm() / ref[fin].norm())
    assert err < (5e-3 if GPU or backend == "reference" else 1e-4), err


# --------------------------------------------------------------------------------------------
# Every window dtype decodes on every backend
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("window_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["reference", "triton", "auto"] + [b for b in gpu_backends() if b != "triton"])
def test_every_window_dtype_decodes_on_every_backend(backend, window_dtype, q_dtype):
    """FP16 windows failed to compile in the Triton window kernel on the GPU (every query dtype, every GPU
    backend). Held to BF16 attention's error on the GPU, to the float32 bound under the interpreter."""
    if backend == "triton" and not GPU:
        pytest.skip("the interpreter upcasts every operand: the GPU case is what this checks (needs a CUDA GPU)")
    from _helpers import bf16_attention, kernel_error_bound, rel
    fmt = KVFormat(bits=2, head_dim=128, group_size=64, sink=4, recent=32)
    cache = foscar.quantize_kv(randn(2, 2, 300, 128), randn(2, 2, 300, 128, seed=1), fmt, page_size=64,
                               seq_lens=torch.tensor([300, 37]), window_dtype=window_dtype)
    dev = DEV if backend != "reference" else "cpu"
    if dev != "cpu":
        from foscar.bench import cache_to
        cache = cache_to(cache, dev)
    q = randn(2, 8, 128, seed=2).to(q_dtype).to(dev)
    out = torch.full((2, 8, 128), NAN, dtype=q_dtype, device=dev)
    foscar.decode(q, cache, out=out, backend=backend)
    exact = foscar.decode_exact(q, cache)
    assert torch.isfinite(out).all()
    err = rel(out, exact)
    base = rel(bf16_attention(q, cache), exact)
    assert err <= kernel_error_bound(fmt, base), (err, base)


# --------------------------------------------------------------------------------------------
# Appends in any chunking give quantize_kv's cache, whatever the input dtype
# --------------------------------------------------------------------------------------------
CHUNK_FORMATS = [dict(bits=2, group_size=64, sink=4, recent=16), dict(bits=4, group_size=32, k_axis="channel"),
                 dict(bits=2, group_size=32, v_axis="channel", recent=5), dict(bits=4, group_size=64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("fmt_kw", CHUNK_FORMATS)
def test_chunked_appends_equal_quantize_kv_for_any_input_dtype(fmt_kw, dtype):
    """Tokens that pass the recent ring are quantized from the window dtype whether they sat there (a
    chunked append) or not (one call, ``quantize_kv``), so the caches are equal bit for bit. They used to
    differ by a code step for float32 inputs."""
    fmt = KVFormat(head_dim=64, **fmt_kw)
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(2, 2, 200, 64, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(2, 2, 200, 64, generator=gen, dtype=torch.float64).to(dtype)
    whole = foscar.quantize_kv(k, v, fmt, page_size=64, num_pages=8,
                               page_table=foscar.PageTable.from_block_table(
                                   torch.arange(8, dtype=torch.int32).reshape(2, 4)))
    cache = QuantKVCache.empty(fmt, 2, 2, max_len=256)
    for a, b in ((0, 1), (1, 37), (37, 38), (38, 130), (130, 200)):
        cache.append(k[:, :, a:b], v[:, :, a:b])
    assert_same_contents(cache, whole)


def assert_same_contents(a: QuantKVCache, b: QuantKVCache) -> None:
    """Equal logical contents, bit for bit: codes, stored constants, windows in token order (ring slots
    that no live token occupies may differ)."""
    ea, eb = a.export(), b.export()
    for name, x in ea.items():
        if isinstance(x, torch.Tensor):
            assert torch.equal(x.cpu(), eb[name].cpu()), name


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_kw", CHUNK_FORMATS)
def test_the_triton_append_of_float32_tokens_matches_the_reference(fmt_kw):
    """Compiled (the interpreter truncates its float32 -> BF16 casts): float32 inputs that are not BF16
    values, appended in chunks and a token at a time, bit for bit the PyTorch write path."""
    fmt = KVFormat(head_dim=64, **fmt_kw)
    gen = torch.Generator().manual_seed(12)
    k, v = torch.randn(2, 2, 150, 64, generator=gen), torch.randn(2, 2, 150, 64, generator=gen)
    ref = QuantKVCache.empty(fmt, 2, 2, max_len=192)
    gpu = QuantKVCache.empty(fmt, 2, 2, max_len=192, device="cuda")
    for a, b in ((0, 40), (40, 41), (41, 42), (42, 150)):
        ref.append(k[:, :, a:b], v[:, :, a:b])
        foscar.append(gpu, k[:, :, a:b].cuda(), v[:, :, a:b].cuda(), backend="triton")
    assert_same_contents(gpu, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("window_dtype", [torch.bfloat16, torch.float16])
def test_the_triton_append_refuses_and_writes_fp16_windows(window_dtype):
    """The checked Triton append refuses what the window cannot hold (cache unchanged) and writes FP16
    windows as the reference does."""
    fmt = KVFormat(bits=4, head_dim=64, group_size=64, sink=2, recent=8)
    gpu = QuantKVCache.empty(fmt, 2, 2, max_len=128, window_dtype=window_dtype, device="cuda")
    ref = QuantKVCache.empty(fmt, 2, 2, max_len=128, window_dtype=window_dtype)
    k, v = randn(2, 2, 50, 64, seed=13), randn(2, 2, 50, 64, seed=14)
    foscar.append(gpu, k.cuda(), v.cuda(), backend="triton")
    ref.append(k, v)
    assert_same_contents(gpu, ref)
    before = snapshot(gpu)
    k[0, 0, 0, 0] = 1e5 if window_dtype == torch.float16 else 1e38
    with pytest.raises(InvalidArgumentError, match="^k_new: expected"):
        foscar.append(gpu, k.cuda(), v.cuda(), backend="triton")
    assert_unchanged(gpu, before)


# --------------------------------------------------------------------------------------------
# Clear errors instead of raw crashes
# --------------------------------------------------------------------------------------------
FMT = KVFormat(bits=2, head_dim=64, group_size=64, sink=4, recent=16)


def small_cache():
    return foscar.quantize_kv(randn(2, 2, 100, 64), randn(2, 2, 100, 64, seed=1), FMT, page_size=64)


def test_plan_run_without_out_allocates_it():
    cache = small_cache()
    q = randn(2, 4, 64, seed=2)
    p = foscar.plan(q, cache)
    out = p.run(q, cache, None)
    assert torch.allclose(out, foscar.decode(q, cache))
    with pytest.raises(InvalidArgumentError, match="^cache: expected a foscar.QuantKVCache"):
        p.run(q, "cache", None)
    with pytest.raises(InvalidArgumentError, match="^q: expected a torch.Tensor"):
        p.run(None, cache)


def test_zero_kv_heads_and_huge_capacities_are_named():
    with pytest.raises(InvalidArgumentError, match="^k: expected at least one KV head"):
        foscar.quantize_kv(torch.randn(1, 0, 8, 64), torch.randn(1, 0, 8, 64), FMT)
    with pytest.raises(InvalidArgumentError, match="^max_len: expected at most 2147483647 pages"):
        QuantKVCache.empty(FMT, 1, 1, max_len=10 ** 12)
    # a petabyte: past any address space, so the allocator refuses at once (overcommit or not)
    one_page = foscar.PageTable.from_block_table(torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(InvalidArgumentError, match="^num_pages: expected a cache that cpu can allocate, got .* GiB"):
        QuantKVCache.empty(FMT, 1, 1024, page_table=one_page, num_pages=2 ** 30)
    with pytest.raises(InvalidArgumentError, match="^max_len: expected a cache that cpu can allocate"):
        QuantKVCache.empty(FMT, 64, 1024, max_len=2 ** 36, page_size=None)


@pytest.mark.parametrize("length,what", [(1000, "lengths the pages hold"), (-3, "lengths >= 0")])
def test_lengths_set_past_the_pages_are_named(length, what):
    cache = small_cache()
    q = randn(2, 4, 64, seed=2)
    cache.seq_lens[1] = length
    for call in (lambda: foscar.decode(q, cache), lambda: foscar.decode_exact(q, cache),
                 lambda: foscar.decode_folded(q, cache), lambda: foscar.plan(q, cache)):
        with pytest.raises(InvalidArgumentError, match=f"^cache.seq_lens: expected {what}"):
            call()


def test_a_tensor_sm_scale_is_a_type_error():
    cache = small_cache()
    with pytest.raises(InvalidArgumentError, match="^sm_scale: expected a Python float .*got a Tensor"):
        foscar.decode(randn(2, 4, 64), cache, sm_scale=torch.tensor(0.1))
