"""The Triton kernel of the FP4 block formats (NVFP4, MXFP4) against the float64 oracle.

On a CPU-only machine it runs under TRITON_INTERPRET=1 (the operands kept in float32, the same bit
placement read back), held to the fold's float32 bound; on a GPU the same cases run compiled (FP16
operands), held to BF16 attention's error on the same dequantized cache. Outputs are NaN-poisoned and
every element checked.
"""
import pytest
import torch
from _cases import DEV, GPU, snapshot
from _helpers import bf16_attention, rel

import foscar
import foscar.triton as ft
from foscar.errors import UnsupportedError

SCHEMES = ("nvfp4", "mxfp4")


def make(fmt, lens, Hkv, G, *, page=32, seed=0, k_mag=3.0, v_mag=1.0):
    gen = torch.Generator().manual_seed(seed)
    B, L, D = len(lens), max(lens), fmt.head_dim
    k = torch.randn(B, Hkv, L, D, generator=gen) * torch.rand(1, Hkv, 1, D, generator=gen) * k_mag  # outliers
    v = (torch.randn(B, Hkv, L, D, generator=gen) + 0.5) * v_mag
    q = torch.randn(B, Hkv * G, D, generator=gen).bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    need = [-(-int(n) // page) for n in fmt.split_length(seq_lens.long())[1]]
    perm = torch.randperm(sum(need) + 2, generator=gen)[: sum(need)].to(torch.int32)
    table = foscar.PageTable.from_csr(torch.tensor([0] + need).cumsum(0).to(torch.int32).to(DEV), perm.to(DEV))
    cache = foscar.quantize_kv(k.to(DEV), v.to(DEV), fmt, seq_lens=seq_lens.to(DEV), page_size=page,
                               page_table=table, num_pages=sum(need) + 2, quantizer="mse")
    return q.to(DEV), cache


def check(q, cache, *, num_splits=None, fused=True, tol=1e-5):
    B, Hq, D = q.shape
    out = torch.full((B, Hq, D), float("nan"), dtype=torch.bfloat16 if GPU else torch.float32, device=q.device)
    lse = torch.full((B, Hq), float("nan"), dtype=torch.float32, device=q.device)
    ft.decode(q, cache, out=out, lse=lse, num_splits=num_splits, fused_combine=fused)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all()), "unwritten or NaN output"
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    err = rel(out, exact)
    if GPU:
        base = rel(bf16_attention(q, cache), exact)
        print(f"\nerror {err:.3e}  BF16 attention {base:.3e}  ratio {err / base:.3f}")
        assert err <= 1.05 * base + 1e-4, (err, base)
        assert float((lse.double() - lse_exact).abs().max()) <= 1e-2
    else:
        assert err <= tol, err
        assert float((lse.double() - lse_exact).abs().max()) <= 1e-4
    return err


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("D,G,page", [(64, 4, 32), (128, 1, 64), (128, 8, 16), (64, 16, 32), (256, 2, 64)])
def test_every_block_format_head_dim_gqa_and_page(scheme, D, G, page):
    """Lengths 1, mid-tile and mid-page, shuffled pages, more splits than some sequences have tiles."""
    q, cache = make(foscar.KVFormat.fp4(scheme, D), [1, 70, 157], 2, G, page=page, seed=D + G)
    check(q, cache, num_splits=3)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("fused", (True, False))
def test_windows_and_merge_placement(scheme, fused):
    fmt = foscar.KVFormat.fp4(scheme, 64, sink=3, recent=5)
    q, cache = make(fmt, [2, 40, 131], 2, 4, seed=5)
    check(q, cache, num_splits=2, fused=fused)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("k_mag,v_mag", [(1e-3, 1e-4), (40.0, 300.0)])
def test_values_of_small_and_large_magnitude(scheme, k_mag, v_mag):
    """The block scales far from 1 (NVFP4: the per-tensor scales too): the FP16 query scaled per row, the V
    operand per block of a tile, both by powers of two, keep every product exact."""
    q, cache = make(foscar.KVFormat.fp4(scheme, 64), [90, 33], 2, 4, seed=7, k_mag=k_mag, v_mag=v_mag)
    check(q, cache, num_splits=2)


def test_a_tile_whose_block_scales_span_the_e4m3_range():
    """One NVFP4 tile holding V blocks of scale 448 and blocks near E4M3's smallest: within 2^26 of each other,
    the V operand ``v s 2^13 / 2^E`` is exact; the small tokens carry the output (their keys match q)."""
    fmt = foscar.KVFormat.fp4("nvfp4", 64)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(1, 1, 64, 64, generator=gen) * 0.01
    v = torch.randn(1, 1, 64, 64, generator=gen) * 2e-3
    v[:, :, 1::2] *= 1e5  # every other token 1e5 larger
    q = torch.randn(1, 4, 64, generator=gen)
    k[:, :, 0::2] = q[0, 0] * 0.5  # the small tokens hold the attention
    cache = foscar.quantize_kv(k.to(DEV), v.to(DEV), fmt, tensor_scales=(1.0, 1.0))
    check(q.bfloat16().to(DEV), cache, num_splits=1)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_zero_tokens_and_blocks(scheme):
    """Tokens and channel blocks of zeros (their block scales the format's smallest, MXFP4's E8M0 2^-127 among
    them): the powers of two the kernel divides by stay finite, the zeros stay zeros."""
    fmt = foscar.KVFormat.fp4(scheme, 64)
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(2, 2, 130, 64, generator=gen)
    v = torch.randn(2, 2, 130, 64, generator=gen)
    k[:, :, 60:70] = 0.0
    v[:, :, :64] = 0.0  # a whole tile of zero V
    v[:, :, 64:, :32] = 0.0  # and zero channel blocks beside non-zero ones
    cache = foscar.quantize_kv(k.to(DEV), v.to(DEV), fmt, seq_lens=torch.tensor([130, 70], dtype=torch.int32,
                                                                                 device=DEV))
    q = torch.randn(2, 8, 64, generator=gen).bfloat16().to(DEV)
    check(q, cache, num_splits=2)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("T", (2, 4))
def test_a_step_as_it_is(scheme, T):
    """``q [B, q_len, Hq, D]``: the step's tokens as rows, causal among them, the oracle's step."""
    fmt = foscar.KVFormat.fp4(scheme, 64)
    q, cache = make(fmt, [T, 90, 161], 2, 4, seed=T)
    q4 = torch.randn(3, T, 8, 64, generator=torch.Generator().manual_seed(T)).bfloat16().to(DEV)
    exact, lse_exact = foscar.decode_exact(q4, cache, return_lse=True)
    for fused in (True, False):
        out = torch.full(q4.shape, float("nan"), dtype=torch.float32, device=DEV)
        lse = torch.full(q4.shape[:3], float("nan"), device=DEV)
        ft.decode(q4, cache, out=out, lse=lse, num_splits=5, fused_combine=fused)
        assert bool(torch.isfinite(out).all())
        assert rel(out, exact) < (1e-2 if GPU else 1e-5)
        assert float((lse.double() - lse_exact).abs().max()) < (1e-2 if GPU else 1e-4)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_through_the_api_with_rotation_and_centring(scheme):
    """``foscar.decode(backend="triton")`` of a rotated cache with centred keys: the backend hands the kernel
    the query in the cache's space and rotates the output back; the LSE is corrected for the key mean."""
    fmt = foscar.KVFormat.fp4(scheme, 64, rotation="hadamard", rotation_seed=1)
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(2, 2, 100, 64, generator=gen) + 2.0
    v = torch.randn(2, 2, 100, 64, generator=gen)
    cache = foscar.quantize_kv(k.to(DEV), v.to(DEV), fmt, seq_lens=torch.tensor([100, 37], dtype=torch.int32,
                                                                                 device=DEV), key_mean="prefill")
    q = torch.randn(2, 8, 64, generator=gen).to(torch.bfloat16 if GPU else torch.float32).to(DEV)  # the
    # interpreter's bound: the rotated query must not be rounded to BF16 on the way
    if GPU:
        out, lse = foscar.decode(q, cache, backend="triton", return_lse=True)
    else:  # the API's path (its device check aside): the backend says it takes the cache's space
        from foscar.backends.triton import Triton
        from foscar.problem import DecodeProblem
        assert not Triton().rotates(fmt)
        problem = DecodeProblem.build(q, cache, out=torch.empty(q.shape), return_lse=True)
        solved = problem.in_cache_space()
        Triton().execute(solved)
        problem.finish(solved)
        out, lse = problem.out, problem.lse
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    assert rel(out, exact) < (1e-2 if GPU else 1e-5)
    assert float((lse.double() - lse_exact).abs().max()) < (1e-2 if GPU else 1e-4)
    out = ft.decode(q, cache, out=torch.empty(q.shape, device=DEV))  # its own entry point rotates around it too
    assert rel(out, exact) < (1e-2 if GPU else 1e-5)


@pytest.mark.parametrize("scheme,byte", [("nvfp4", 0x7F), ("mxfp4", 255)])
def test_a_nan_block_scale_is_a_nan_output_never_a_number(scheme, byte):
    """A NaN scale byte written into the pool behind the library's back (every writer refuses one) makes its
    KV head's outputs NaN: nothing reads it as a plausible number."""
    q, cache = make(foscar.KVFormat.fp4(scheme, 64), [40], 2, 4, seed=2)
    for params, tensor in ((cache.k_params, "k"), (cache.v_params, "v")):
        saved = params.clone()
        params[int(cache.page_table.block_table[0, 0]), 1, 5, 1] = byte
        out = ft.decode(q, cache, num_splits=1)
        block = cache.fmt.group_size
        bad = torch.zeros_like(out, dtype=torch.bool)
        if tensor == "k":  # every score of KV head 1 (query heads 4..7)
            bad[0, 4:] = True
        else:  # V's channel block 1 of KV head 1
            bad[0, 4:, block:2 * block] = True
        assert torch.equal(torch.isnan(out), bad), tensor
        params.copy_(saved)


def test_the_fp4_kernel_refuses_what_it_does_not_run():
    q, cache = make(foscar.KVFormat.fp4("nvfp4", 64), [40], 1, 4)
    with pytest.raises(UnsupportedError, match=r"^kernel='reconstruct'"):
        ft.decode(q, cache, kernel="reconstruct")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("G", (1, 4, 8))
def test_paper_shape_gpu(scheme, G):
    """Hkv 8, D 128, page 64, lengths around 4K (mid-tile, mid-page), through ``foscar.decode``'s auto choice."""
    fmt = foscar.KVFormat.fp4(scheme, 128)
    q, cache = make(fmt, [4096, 4001, 1], 8, G, page=64, seed=G)
    check(q, cache)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=DEV)
    foscar.decode(q, cache, out=out)
    assert rel(out, foscar.decode_exact(q, cache)) <= 1.05 * rel(bf16_attention(q, cache), foscar.decode_exact(
        q, cache)) + 1e-4


def _fp4_values(B, H, n, D, seed):
    """BF16-exact values (the ring round trip is lossless) with blocks that hit the E2M1 midpoints exactly:
    each token's first block is 6 (its scale 1 at NVFP4's tensor scale 1, MXFP4's) and the seven midpoints."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, H, n, D, generator=gen) * 3).bfloat16().float()
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.0])
    x[..., :16] = ties
    x[:, :, ::5] = 0.0  # zero tokens: the smallest block scales
    return x


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("quantizer", (pytest.param("minmax", marks=pytest.mark.slow), "mse"))
@pytest.mark.parametrize("windows", (pytest.param({}, marks=pytest.mark.slow), {"sink": 3, "recent": 5}),
                         ids=("no_windows", "windows"))  # the windowed cache and the search in CI (FOSCAR_SLOW=1: all)
def test_the_triton_append_writes_what_the_reference_writes_bit_for_bit(scheme, quantizer, windows):
    """``foscar.triton.append`` and ``append_step`` (under the interpreter on a CPU) over an FP4 cache: the
    codes, block-scale bytes and windows QuantKVCache.append writes, bit for bit, both block-scale choices and
    the E2M1 ties; a prompt, chunks across pages and the window, single steps."""
    fmt = foscar.KVFormat.fp4(scheme, 64, **windows)
    B, H, D, n = 2, 1, 64, 64
    k, v = (_fp4_values(B, H, n, D, seed=s).to(DEV) for s in (1, 2))
    kw = {"tensor_scales": (1.0, 0.5)} if scheme == "nvfp4" else {}
    ref = foscar.QuantKVCache.empty(fmt, B, H, max_len=n, page_size=32, device=DEV, **kw)
    ker = foscar.QuantKVCache.empty(fmt, B, H, max_len=n, page_size=32, device=DEV, **kw)
    t = 0
    for c in (20, 1, 5, 1, 30, 1, 6):
        ref.append(k[:, :, t: t + c], v[:, :, t: t + c], quantizer=quantizer)
        if c == 1:
            ft.append_step(ker, k[:, :, t].contiguous(), v[:, :, t].contiguous(), quantizer=quantizer)
        else:
            ft.append(ker, k[:, :, t: t + c], v[:, :, t: t + c], quantizer=quantizer, check=c != 30)
        t += c
        for name, a in snapshot(ref).items():
            assert torch.equal(a, getattr(ker, name)), (name, t)
    assert t == n


def test_the_triton_fp4_append_refuses_by_name_and_leaves_the_cache():
    fmt = foscar.KVFormat.fp4("nvfp4", 64)
    cache = foscar.QuantKVCache.empty(fmt, 1, 1, max_len=64, page_size=32, device=DEV, tensor_scales=(1e-4, 1.0))
    before = snapshot(cache)
    x = torch.ones(1, 1, 4, 64, device=DEV)
    with pytest.raises(foscar.InvalidArgumentError, match=r"^quantizer: expected one of \('minmax', 'mse'\)"):
        ft.append(cache, x, x, quantizer="oscar")
    with pytest.raises(foscar.InvalidArgumentError, match=r"^k_new: expected values of magnitude <= 0.2688"):
        ft.append(cache, x, x)  # 6 x 448 x 1e-4: past the E4M3 block scales
    for name, a in before.items():
        assert torch.equal(a, getattr(cache, name)), name
    ft.append(cache, x, x, check=False)  # no host check (a CUDA graph): the blocks' scales are NaN, never clipped
    assert int(cache.seq_lens[0]) == 4 and bool((cache.k_params[cache.page_table.block_table[0, 0], 0, :4] == 0x7F)
                                                .all())
    assert bool(torch.isnan(ft.decode(torch.ones(1, 4, 64, device=DEV), cache)).all())


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_append_then_decode_as_one_cuda_graph_gpu(scheme):
    """A decode step as one graph: ``foscar.append(check=False)`` of the step's token (the Triton writer) and
    ``plan.run`` of the decode; replays equal eager calls on a copy, and the decode equals the oracle's."""
    fmt = foscar.KVFormat.fp4(scheme, 128, recent=4)
    B, H, G = 2, 4, 4
    k, v = (_fp4_values(B, H, 40, 128, seed=s).to(DEV) for s in (3, 4))
    kw = {"tensor_scales": (1.0, 1.0)} if scheme == "nvfp4" else {}
    graphed, eager = (foscar.QuantKVCache.empty(fmt, B, H, max_len=64, page_size=16, device=DEV, **kw) for _ in "ab")
    for c in (graphed, eager):
        foscar.append(c, k[:, :, :30], v[:, :, :30])
    q = torch.randn(B, H * G, 128, device=DEV).bfloat16()
    plan = foscar.plan(q, graphed)
    kn, vn = k[:, :, 30:31].clone(), v[:, :, 30:31].clone()
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=DEV)
    foscar.append(graphed, kn, vn)  # a warm-up step (compiles), eager
    plan.run(q, graphed, out=out)
    foscar.append(eager, kn, vn, backend="reference")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        foscar.append(graphed, kn, vn, check=False)
        plan.run(q, graphed, out=out)
    for t in range(31, 40):
        kn.copy_(k[:, :, t: t + 1])
        vn.copy_(v[:, :, t: t + 1])
        graph.replay()
        foscar.append(eager, k[:, :, t: t + 1], v[:, :, t: t + 1], backend="reference")
        want = foscar.decode(q, eager, backend="triton")
        torch.cuda.synchronize()
        assert rel(out, want) < 1e-2 and bool(torch.isfinite(out).all()), t
        exact = foscar.decode_exact(q, eager)
        assert rel(out, exact) <= 1.05 * rel(bf16_attention(q, eager), exact) + 1e-4
    for name, a in snapshot(eager).items():
        assert torch.equal(a, getattr(graphed, name)), name
