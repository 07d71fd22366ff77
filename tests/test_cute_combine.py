"""The CuTe LSE combine (:mod:`foscar.cute.combine`). CPU: every configuration compiles for sm_90a and
its PTX issues a chunk's loads before it merges them. GPU (sm_90): the merge is float64
``combine_partials`` (base-2 partial LSEs) to FP32 rounding, every element checked, for part counts on
both sides of a chunk and past the largest, empty partials holding garbage, all-empty rows, NaN and +inf partial LSEs and a
NaN output of a weighted partial, into BF16, FP16 and FP32 outputs, with and without the LSE."""
import math
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

from foscar.cute.compile import compile_combine  # noqa: E402
from foscar.cute.combine_config import COMBINE_MAX_CHUNK, CombineConfig, combine_chunk  # noqa: E402
from foscar.fold import combine_partials  # noqa: E402
from _cases import HOPPER  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def test_the_chunk_covers_the_partials_in_one_round_trip_up_to_its_cap():
    assert [combine_chunk(p) for p in (1, 8, 9, 33, 64, 65, 200)] == [8, 8, 16, 64, 64, 128, 128]
    assert COMBINE_MAX_CHUNK == 128


@pytest.mark.parametrize("head_dim,chunk", ((64, 8), (64, 128), (128, 16), (128, 128), (256, 8)))
@pytest.mark.parametrize("out_dtype", sorted(DTYPES))
@pytest.mark.parametrize("write_lse", (True, False))
def test_compiles_for_sm90a(head_dim, chunk, out_dtype, write_lse):
    ptx = compile_combine(CombineConfig(head_dim, out_dtype, write_lse, chunk), keep_ptx=True).__ptx__
    body = ptx[ptx.index("$L__BB0_2"):]
    first_exp = body.index("ex2.approx")
    cfg = CombineConfig(head_dim, out_dtype, write_lse, chunk)
    loads = cfg.thread_chunk + -(-chunk // (head_dim * cfg.ranks))  # its outputs and its share of the LSEs
    assert body[:first_exp].count("ld.global") == loads, "a chunk's loads come before its merge"
    assert ".local" not in ptx, "no local memory (spills are ptxas's; this is the PTX's own)"
    assert ptx.count("st.global") == (2 if write_lse else 1), "the output, and the LSE when written"


def _partials(B, H, parts, D, gen):
    """Random partials (base-2 LSEs), with the edge cases in fixed rows: row (0, 0) all empty, (0, 1) one
    weighted partial among empties holding NaN, (1, 0) a NaN LSE, (1, 1) a +inf LSE, (1, 2) a NaN output
    in a weighted partial; and empty partials scattered elsewhere, holding garbage."""
    o = torch.randn(B, H, parts, D, generator=gen, dtype=torch.float64) * 3
    lse = torch.randn(B, H, parts, generator=gen, dtype=torch.float64) * 8
    empty = torch.rand(B, H, parts, generator=gen) < 0.2
    lse[empty] = -math.inf
    o[empty] = 1e30  # an empty partial's output is never read
    lse[0, 0] = -math.inf
    o[0, 0] = float("nan")
    lse[0, 1] = -math.inf
    lse[0, 1, parts - 1] = 2.5
    o[0, 1, parts - 1] = torch.randn(D, generator=gen, dtype=torch.float64)
    o[0, 1, : parts - 1] = float("nan")
    lse[1, 0, parts // 2] = float("nan")
    lse[1, 1, 0] = math.inf
    lse[1, 2, parts - 1] = max(float(lse[1, 2].max()), 0.0) + 1.0  # weighted, whatever the others hold
    o[1, 2, parts - 1] = torch.randn(D, generator=gen, dtype=torch.float64)
    o[1, 2, parts - 1, 3] = float("nan")
    return o, lse


def _reference(o, lse):
    """float64 combine of base-2 LSEs: ``combine_partials`` takes natural-log LSEs."""
    outs, lses = list(o.unbind(2)), [x * math.log(2.0) for x in lse.unbind(2)]
    return combine_partials(outs, lses)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("parts", (1, 3, 8, 9, 66, 130))
@pytest.mark.parametrize("out_dtype", sorted(DTYPES))
@pytest.mark.parametrize("with_lse", (True, False))
def test_matches_float64(parts, out_dtype, with_lse):
    from foscar.cute.launch import combine
    B, H, D = 3, 5, 128
    gen = torch.Generator().manual_seed(1000 * parts + 10 * len(out_dtype) + with_lse)
    o, lse = _partials(B, H, max(parts, 2), D, gen)
    o, lse = o[:, :, :parts].contiguous(), lse[:, :, :parts].contiguous()
    if parts == 1:  # the edge rows need two partials; keep the all-empty row
        lse[0, 1] = 1.0
    ref_o, ref_lse = _reference(o, lse)
    dt = DTYPES[out_dtype]
    out = torch.full((B, H, D), float("nan"), dtype=dt, device="cuda")
    got_lse = torch.full((B, H), float("nan"), device="cuda") if with_lse else None
    combine(o.float().cuda(), lse.float().cuda(), out, got_lse)
    torch.cuda.synchronize()
    out = out.cpu().double()
    tol = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -20}[dt]
    finite = torch.isfinite(ref_o)
    assert torch.equal(torch.isnan(out), torch.isnan(ref_o)), "NaN exactly where float64 has it"
    # the output's rounding, and FP32 (ex2.approx) weights: relative to the weighted sum of |o|
    scale = _reference(o.nan_to_num(0.0).abs(), lse)[0]
    err = (out - ref_o).abs()[finite]
    bound = tol * ref_o.abs()[finite] + 2.0 ** -17 * scale[finite]
    assert bool((err <= bound).all()), f"max err / bound {(err / bound.clamp(min=1e-300)).max():.3e}"
    assert bool((out[0, 0] == 0).all()), "an all-empty row is 0"
    if with_lse:
        g = got_lse.cpu().double()
        assert torch.equal(torch.isnan(g), torch.isnan(ref_lse))
        assert g[0, 0] == -math.inf and ref_lse[0, 0] == -math.inf
        fin = torch.isfinite(ref_lse)
        assert bool(((g - ref_lse).abs()[fin] <= 2.0 ** -18 * (ref_lse.abs()[fin] + 1)).all())


@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_the_rotating_merge_compiles_for_sm90a(head_dim):
    """With ``rotate``: a Walsh-Hadamard round (one barrier each) per power of two of the head dim, after the
    merge; still one store of the output."""
    plain = compile_combine(CombineConfig(head_dim, "bf16", False, 16), keep_ptx=True).__ptx__
    ptx = compile_combine(CombineConfig(head_dim, "bf16", False, 16, True), keep_ptx=True).__ptx__
    rounds = head_dim.bit_length() - 1
    assert ptx.count("bar.sync") - plain.count("bar.sync") >= rounds
    assert ".local" not in ptx and ptx.count("st.global") == 1


@pytest.mark.parametrize("head_dim,chunk,rotate,windows", [
    (128, 16, False, {"sink": 4, "recent": 64, "ring": 64, "gqa": 4}),
    (128, 128, True, {"sink": 4, "recent": 16, "flush": 128, "ring": 143, "gqa": 2, "window_dtype": "f16"}),
    (64, 8, False, {"sink": 0, "recent": 32, "ring": 32, "gqa": 8}),
    (256, 8, True, {"sink": 4, "recent": 0, "ring": 0, "gqa": 1}),
    (128, 8, True, {"sink": 4, "recent": 64, "ring": 64, "gqa": 6})])
def test_the_combine_with_windows_compiles_for_sm90a(head_dim, chunk, rotate, windows):
    """The combine that attends a cache's BF16 windows itself (``foscar.cute.windows``): one CTA for up to 8
    query rows of a KV head (their partials in a thread's 64 registers), each thread its channel of every row;
    the window staged in shared memory as 16-byte vectors (each thread's share of a stage one load each, no
    element loads but the query's), no local memory, a store per row as the merge alone; a rotated cache's query
    rotated in by a Walsh-Hadamard round per power of two of the head dim."""
    cfg = CombineConfig(head_dim, "bf16", True, chunk, rotate, **windows)
    rows = max(r for r in range(1, min(cfg.gqa, 8) + 1) if cfg.gqa % r == 0 and r * min(chunk, 64) <= 64)
    assert cfg.windows and cfg.rows == rows and cfg.threads == head_dim * cfg.ranks
    ptx = compile_combine(cfg, keep_ptx=True).__ptx__
    plain = compile_combine(CombineConfig(head_dim, "bf16", True, chunk, rotate), keep_ptx=True).__ptx__
    assert ".local" not in ptx and ptx.count("st.global") == 2 * rows
    def loads(text, width=r"[\w.]+"):
        return len(re.findall(rf"ld\.global(?:\.nc)?\.{width}\s", text))
    vectors = -(-2 * cfg.window_stage * head_dim // 8 // cfg.threads)  # a thread's share of a stage's K and V
    assert loads(plain, r"v4\.b32") == 0 and loads(ptx, r"v4\.b32") >= vectors, "the rows as 16-byte vectors"
    assert loads(ptx, r"[bu]16") - loads(plain, r"[bu]16") <= -(-rows * head_dim // cfg.threads), "the query only"
    if rotate:
        assert ptx.count("bar.sync") - plain.count("bar.sync") >= head_dim.bit_length() - 1


def test_the_cute_decode_takes_no_window_partials():
    """With ``COMBINE_WINDOWS`` the workspace holds the splits' partials only (the combine attends the windows)."""
    import foscar
    from foscar.cute import config
    from foscar.cute.launch import num_parts
    fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128, sink=4, recent=64)
    assert config.COMBINE_WINDOWS and num_parts(fmt, 3, True) == 6


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("parts,out_dtype", ((3, "f32"), (66, "bf16")))
def test_the_rotating_merge_is_the_merge_rotated_back(parts, out_dtype):
    """``combine(..., rotation)``: the float64 merge times ``R^T`` (a NaN of a row spreads over it, an
    all-empty row stays 0), the LSE unchanged."""
    import foscar
    from foscar.cute.launch import combine
    from foscar.rotation import rotation_factors
    from foscar.rotation import rotation_matrix
    B, H, D = 3, 5, 128
    fmt = foscar.KVFormat(bits=4, head_dim=D, group_size=128, rotation="hadamard", rotation_seed=3)
    gen = torch.Generator().manual_seed(parts)
    o, lse = _partials(B, H, parts, D, gen)
    ref_o, ref_lse = _reference(o, lse)
    ref_o = ref_o @ rotation_matrix(fmt).T
    dt = DTYPES[out_dtype]
    out = torch.full((B, H, D), float("nan"), dtype=dt, device="cuda")
    got_lse = torch.full((B, H), float("nan"), device="cuda")
    combine(o.float().cuda(), lse.float().cuda(), out, got_lse, rotation_factors(fmt, torch.device("cuda")))
    torch.cuda.synchronize()
    out = out.cpu().double()
    assert torch.equal(torch.isnan(out), torch.isnan(ref_o)), "NaN exactly where float64 has it"
    assert bool((out[0, 0] == 0).all()), "an all-empty row is 0"
    tol = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -18}[dt]
    fin = torch.isfinite(ref_o)
    scale = (_reference(o.nan_to_num(0.0).abs(), lse)[0].norm(dim=-1, keepdim=True) / D ** 0.5).expand_as(ref_o)
    err = (out - ref_o).abs()[fin]
    assert bool((err <= tol * (ref_o.abs()[fin] + scale[fin])).all())
    g = got_lse.cpu().double()
    assert torch.equal(torch.isnan(g), torch.isnan(ref_lse))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("fmt_kw,G,window_dtype", [
    ({"sink": 4, "recent": 64}, 4, torch.bfloat16),
    ({"sink": 4, "recent": 64, "rotation": "hadamard", "rotation_seed": 5}, 8, torch.float16),
    ({"sink": 2, "recent": 7, "k_axis": "channel"}, 4, torch.bfloat16),  # a ring of 134 slots
    ({"sink": 0, "recent": 32, "head_dim": 64, "group_size": 64}, 2, torch.bfloat16),
    ({"sink": 4, "recent": 0, "head_dim": 256}, 1, torch.float16)])
def test_the_combine_attends_the_windows_gpu(fmt_kw, G, window_dtype):
    """``foscar.decode`` through the CuTe kernels, the windows attended by the combine: sequences that are all
    window (no quantized token) match the float64 oracle to the output's rounding, the others within the
    kernels' bound; the LSE too; a NaN planted in one window token's V makes its KV head's rows NaN and no other."""
    import foscar
    from _helpers import bf16_attention, kernel_error_bound, rel
    fmt = foscar.KVFormat(bits=2, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    D, Hkv = fmt.head_dim, 2
    lens = [fmt.sink + fmt.recent, 3, 1, 2000, fmt.sink + 300]  # all window; all window; one token; long; ring wrapped
    gen = torch.Generator().manual_seed(11)
    k, v = (torch.randn(len(lens), Hkv, max(lens), D, generator=gen) for _ in range(2))
    q = torch.randn(len(lens), Hkv * G, D, generator=gen).bfloat16().cuda()
    cache = foscar.quantize_kv(k.cuda(), v.cuda(), fmt, seq_lens=torch.tensor(lens, dtype=torch.int32).cuda(),
                               page_size=64, window_dtype=window_dtype)
    assert [int(fmt.split_length(n)[1]) for n in lens[:3]] == [0, 0, 0]
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device="cuda")
    foscar.decode(q, cache, backend="cute", out=out, lse=lse)
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    for b in range(3):  # all window: FP32 products of the window's values, the output rounded to BF16
        assert rel(out[b], exact[b]) <= 2.0 ** -8, b
    err, base = rel(out, exact), rel(bf16_attention(q, cache, sdpa=True), exact)
    assert err <= kernel_error_bound(fmt, base)
    assert float((lse.double() - lse_exact).abs().max()) <= 1e-2
    n_sink = min(lens[3], fmt.sink)
    n_quant = int(fmt.split_length(lens[3])[1])
    slot = (n_quant + 1) % fmt.recent_capacity if fmt.recent_capacity else None
    if slot is not None:  # the second ring token of sequence 3, KV head 1
        cache.v_recent[3, 1, slot, 5] = float("nan")
    else:
        cache.v_sink[3, 1, n_sink - 1, 5] = float("nan")
    out.fill_(0.0)
    foscar.decode(q, cache, backend="cute", out=out)
    nan_rows = torch.isnan(out).any(-1).cpu()
    want = torch.zeros_like(nan_rows)
    want[3, G:2 * G] = True
    assert torch.equal(nan_rows, want)
