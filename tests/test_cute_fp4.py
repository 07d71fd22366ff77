"""The CuTe sm_90a kernel over NVFP4 and MXFP4 caches (``foscar.cute.operands_fp4``).

On the CPU: the kernel compiles for sm_90a at every head dim, GQA and step it takes; its register map (which
token, channel and block scale each FP16 A register holds) agrees with the fragment CuTe DSL assigns; MXFP4's
scale bits (PTX, run on the GPU) are those of the format's definition; and it refuses by name what it does not
take. On the GPU: outputs NaN-poisoned, every element checked against the
float64 oracle and held to BF16 attention's error on the same dequantized cache.
"""
import os

import pytest
import torch
from _helpers import bf16_attention, rel

import foscar
from foscar.errors import UnsupportedError

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU (read as cutlass is imported)
cute_dsl = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from foscar.cute.config import config_for  # noqa: E402

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
DEV = "cuda" if GPU else "cpu"
gpu = pytest.mark.skipif(not GPU, reason="needs an sm_90 GPU (runs on the H200)")


def nvfp4(D, **kw):
    return foscar.KVFormat.fp4("nvfp4", D, **kw)


SCHEMES = ("nvfp4", "mxfp4")


@pytest.mark.parametrize("scheme,D,gqa,step", [("nvfp4", 128, 4, 1), ("nvfp4", 64, 8, 1), ("nvfp4", 128, 16, 2),
                                               ("mxfp4", 128, 4, 1), ("mxfp4", 64, 8, 1), ("mxfp4", 128, 16, 2)])
def test_compiles_for_sm90a(scheme, D, gqa, step):
    from foscar.cute.compile import compile_stage1
    cfg = config_for(foscar.KVFormat.fp4(scheme, D), gqa, 64, step=step)
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=1 if gqa * step > 16 else 2).__ptx__
    scale = "cvt.rn.f16x2.e4m3x2" if scheme == "nvfp4" else "max.s16x2"
    assert scale in ptx and "mul.rn.f16x2" in ptx and "wgmma.mma_async" in ptx


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_rotated_cache_with_windows_compiles_for_sm90a(scheme):
    from foscar.cute.compile import compile_stage1
    cfg = config_for(foscar.KVFormat.fp4(scheme, 128, sink=4, recent=64, rotation="hadamard"), 4, 64)
    assert cfg.rotation and compile_stage1(cfg, warp_specialized=True, ctas_per_sm=2) is not None


@pytest.mark.parametrize("scheme,D", [("nvfp4", 128), ("mxfp4", 128), ("mxfp4", 64)])
def test_two_tiles_a_pass_compile_for_sm90a(scheme, D):
    from foscar.cute.compile import compile_stage1
    cfg = config_for(foscar.KVFormat.fp4(scheme, D), 4, 64, tiles_per_pass=2)
    assert cfg.tiles_per_pass == 2 and compile_stage1(cfg, warp_specialized=True, ctas_per_sm=2) is not None


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kw,gqa,what", [
    ({"k_operand": "e4m3"}, 4, "k_operand='e4m3'"),
    ({"tiles_per_pass": 2}, 8, "tiles_per_pass=2"),
])
def test_what_it_does_not_take_is_refused_by_name(scheme, kw, gqa, what):
    with pytest.raises(UnsupportedError, match=what):
        config_for(foscar.KVFormat.fp4(scheme, 128), gqa, 64, **kw)
    with pytest.raises(UnsupportedError, match="head_dim=256"):
        config_for(foscar.KVFormat.fp4(scheme, 256), 2, 64)


@pytest.mark.parametrize("D", (64, 128))
def test_the_register_map_is_the_fragment_cute_assigns(D):
    """Every K register's token row and block (``build_k_registers_fp4``: k16 block ``r // 4``, row ``row0 + 8
    (r % 2)``) and every V^T register's channel block and tokens (``build_vt_registers_fp4``) are the ``(row, k)``
    CuTe DSL assigns to that register, for both 16-bit halves."""
    from foscar.cute.fragment import rs_fragment_ownership
    own_k = rs_fragment_ownership(64, D)  # [thread, register, half] -> (token, channel)
    for t in range(128):
        warp, lane = t // 32, t % 32
        row0, quad = 16 * warp + lane // 4, lane % 4
        for r in range(own_k.shape[1]):
            for h in range(2):
                tok, ch = own_k[t, r, h].tolist()
                assert tok == row0 + 8 * (r % 2) and ch // 16 == r // 4 and ch // 32 == (r // 4) // 2
    own_v = rs_fragment_ownership(D, 64)  # V^T: (channel, token)
    for t in range(128):
        warp, lane = t // 32, t % 32
        quad = lane % 4
        for r in range(own_v.shape[1]):
            mh, kb = (r // 4) % (D // 64), (r // 4) // (D // 64)
            for h in range(2):
                ch, tok = own_v[t, r, h].tolist()
                assert ch // 16 == 4 * mh + warp  # the block: byte `warp` of word `mh` of a token's scales
                assert ch // 32 == 2 * mh + warp // 2  # MXFP4's block (build_vt_registers_mx)
                assert tok == 16 * kb + 2 * quad + 8 * ((r % 4) // 2) + h


def test_mxfp4_operands_times_their_row_scale_are_the_format_values():
    """MXFP4's arithmetic (``operands_fp4``): a code placed as FP16 ``v 2^-14`` times the FP16 scale of bits
    ``max(30 - (E - e), 0) << 10`` (``E`` the token's largest block byte, ``e`` the block's), rounded to FP16 as
    ``mul.rn.f16x2`` rounds, times the row's ``2^(E - 128)`` is ``v 2^(e - 127)`` exactly for every code and byte
    up to ``E - e = 24``; beyond, it errs by at most ``2^-24`` of the token's largest value."""
    from foscar.cute.operands_fp4 import MX_TOP
    from foscar.format import e2m1_decode
    v = e2m1_decode(torch.arange(16)).double()[:, None]
    top = torch.arange(1, 255, dtype=torch.float64)[None, :]
    for d in range(0, 40):
        placed = (v * 2.0 ** -14).half()
        assert torch.equal(placed.double(), v * 2.0 ** -14)
        scale = torch.tensor([max(MX_TOP - d, 0) << 10], dtype=torch.int16).view(torch.float16)
        op = (placed * scale).double()  # a product of two FP16 values is exact in FP32: one rounding to FP16
        got = op * torch.pow(2.0, top - 128)
        want = v * torch.pow(2.0, top - d - 127)
        keep = top - d >= 0
        if d <= 24:
            assert torch.equal(got[:, keep[0]], want[:, keep[0]]), d
        else:
            assert bool(((got - want).abs() <= 6 * torch.pow(2.0, top - 127) * 2.0 ** -24).all()), d


def make(D, lens, Hkv, G, *, page=64, seed=0, k_mag=3.0, v_mag=1.0, scheme="nvfp4", **fmt_kw):
    gen = torch.Generator().manual_seed(seed)
    fmt = foscar.KVFormat.fp4(scheme, D, **fmt_kw)
    B, L = len(lens), max(lens)
    k = torch.randn(B, Hkv, L, D, generator=gen) * torch.rand(1, Hkv, 1, D, generator=gen) * k_mag
    v = (torch.randn(B, Hkv, L, D, generator=gen) + 0.5) * v_mag
    q = torch.randn(B, Hkv * G, D, generator=gen).bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    need = [-(-int(n) // page) for n in fmt.split_length(seq_lens.long())[1]]
    perm = torch.randperm(sum(need) + 2, generator=gen)[: sum(need)].to(torch.int32)
    table = foscar.PageTable.from_csr(torch.tensor([0] + need).cumsum(0).to(torch.int32).to(DEV), perm.to(DEV))
    cache = foscar.quantize_kv(k.to(DEV), v.to(DEV), fmt, seq_lens=seq_lens.to(DEV), page_size=page,
                               page_table=table, num_pages=sum(need) + 2, quantizer="mse")
    return q.to(DEV), cache


def check(q, cache, **launch):
    from foscar.cute.launch import decode
    B, Hq, D = q.shape
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=DEV)
    lse = torch.full((B, Hq), float("nan"), dtype=torch.float32, device=DEV)
    decode(q, cache, out=out, lse=lse, **launch)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all()), "unwritten or NaN output"
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    err, base = rel(out, exact), rel(bf16_attention(q, cache), exact)
    print(f"\nerror {err:.3e}  BF16 attention {base:.3e}  ratio {err / base:.3f}")
    assert err <= 1.05 * base + 1e-4, (err, base)
    assert float((lse.double() - lse_exact).abs().max()) <= 1e-2
    return err


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("D,G,page", [(128, 4, 64), (128, 1, 128), (128, 8, 64), (64, 4, 64), (64, 16, 256)])
@pytest.mark.parametrize("splits", (1, 3))
@pytest.mark.parametrize("tiles", (1, 2))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_against_the_oracle_gpu(scheme, D, G, page, splits, tiles):
    """Lengths 1, mid-tile, mid-page and several pages, shuffled pages, more splits than some sequences have;
    one tile a softmax pass, or two where the GQA takes them."""
    if tiles == 2 and G > 4:
        pytest.skip("two tiles a pass take gqa <= 4")
    q, cache = make(D, [1, 70, 157, 1000], 2, G, page=page, seed=D + G, scheme=scheme)
    check(q, cache, num_splits=splits, tiles_per_pass=tiles)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_paper_shape_gpu(scheme):
    q, cache = make(128, [4096, 4001, 1, 2500], 8, 4, seed=1, scheme=scheme)
    check(q, cache)
    out = foscar.decode(q, cache, backend="cute")
    assert rel(out, foscar.decode_exact(q, cache)) <= 1.05 * rel(bf16_attention(q, cache),
                                                                 foscar.decode_exact(q, cache)) + 1e-4


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("k_mag,v_mag", [(1e-3, 1e-4), (40.0, 300.0)])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_values_of_small_and_large_magnitude_gpu(scheme, k_mag, v_mag):
    q, cache = make(64, [90, 33, 300], 2, 4, seed=7, k_mag=k_mag, v_mag=v_mag, scheme=scheme)
    check(q, cache, num_splits=2)


@gpu
@pytest.mark.gpu
def test_block_scales_across_the_e4m3_range_gpu():
    """Per-tensor scales of 1 and values from 1e-3 to 1e2: block scales from E4M3's subnormals to its largest, the
    operands ``v s 2^-14`` FP16 subnormals for most blocks; every product exact, the output the oracle's."""
    gen = torch.Generator().manual_seed(13)
    mag = 10.0 ** (torch.randint(-3, 3, (2, 2, 300, 1), generator=gen).float())  # per token
    k = torch.randn(2, 2, 300, 128, generator=gen) * mag
    v = torch.randn(2, 2, 300, 128, generator=gen) * mag.flip(2)
    cache = foscar.quantize_kv(k.to(DEV), v.to(DEV), nvfp4(128), tensor_scales=(1.0, 1.0),
                               seq_lens=torch.tensor([300, 171], dtype=torch.int32, device=DEV))
    q = (torch.randn(2, 8, 128, generator=gen) * 1e-2).bfloat16().to(DEV)
    codes = cache.v_params[cache.v_params != 0]
    assert int((codes < 8).sum()) > 0 and int((codes >= 0x60).sum()) > 0  # subnormal scales, and from 32 up
    for tiles in (1, 2):
        check(q, cache, num_splits=2, tiles_per_pass=tiles)


@gpu
@pytest.mark.gpu
def test_mxfp4_scales_across_blocks_and_tokens_gpu():
    """MXFP4 with block magnitudes from 1e-4 to 1e3 inside a token (E8M0 scales up to 2^23 apart: each block's
    operand relative to its token's largest, every product exact) and token magnitudes from 1e-3 to 1e2 (the
    rows' ``s'`` under the running units of ``P'``): the output the oracle's."""
    gen = torch.Generator().manual_seed(17)
    blk = 10.0 ** torch.randint(-4, 4, (2, 2, 300, 4), generator=gen).float()
    tok = 10.0 ** torch.randint(-3, 3, (2, 2, 300, 1), generator=gen).float()
    mag = (blk.repeat_interleave(32, dim=3) * tok)
    k = torch.randn(2, 2, 300, 128, generator=gen) * mag
    v = torch.randn(2, 2, 300, 128, generator=gen) * mag.flip(2)
    cache = foscar.quantize_kv(k.to(DEV), v.to(DEV), foscar.KVFormat.fp4("mxfp4", 128),
                               seq_lens=torch.tensor([300, 171], dtype=torch.int32, device=DEV))
    q = (torch.randn(2, 8, 128, generator=gen) * 1e-3).bfloat16().to(DEV)
    e = cache.k_params[cache.k_params != 0].int()
    assert int(e.max() - e.min()) >= 20  # scales 2^20 apart
    for tiles in (1, 2):
        check(q, cache, num_splits=2, tiles_per_pass=tiles)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_windows_and_rotation_gpu(scheme):
    q, cache = make(128, [2, 40, 531], 2, 4, seed=5, sink=4, recent=64, rotation="hadamard", rotation_seed=1,
                    scheme=scheme)
    check(q, cache, num_splits=2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tiles", (1, 2))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_nan_bytes_past_the_length_never_reach_the_output_gpu(scheme, tiles):
    """The scale bytes of a partial tile's tokens past the sequence (a reused page's, NaN here) are not read as
    numbers: every output stays finite and within bounds. A NaN byte inside the sequence makes its KV head NaN
    (the channels of its block; MXFP4: every channel, the token's ``P'`` NaN), a K byte every channel."""
    nan = 0x7F if scheme == "nvfp4" else 0xFF
    q, cache = make(128, [70, 157], 2, 4, seed=3, scheme=scheme)
    for params in (cache.k_params, cache.v_params):
        for b, n in ((0, 70), (1, 157)):
            page = int(cache.page_table.block_table[b, n // 64])
            params[page, :, n % 64:] = nan
    check(q, cache, num_splits=1, tiles_per_pass=tiles)
    from foscar.cute.launch import decode
    block = cache.fmt.group_size
    for params in (cache.v_params, cache.k_params):
        keep = params.clone()
        params[int(cache.page_table.block_table[0, 0]), 1, 5, 1] = nan
        out = decode(q, cache, num_splits=1, tiles_per_pass=tiles)
        lo, hi = (block, 2 * block) if params is cache.v_params else (0, 128)
        assert bool(torch.isnan(out[0, 4:, lo:hi]).all()) and bool(torch.isfinite(out[0, :4]).all())
        assert bool(torch.isfinite(out[1]).all())
        params.copy_(keep)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cuda_graph_replay_equals_eager_gpu(scheme):
    from foscar.cute.launch import decode
    q, cache = make(128, [300, 1000], 8, 4, seed=9, scheme=scheme)
    eager = decode(q, cache, num_splits=2)
    out = torch.full_like(eager, float("nan"))
    decode(q, cache, out=out, num_splits=2)  # compiled and warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(q, cache, out=out, num_splits=2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
