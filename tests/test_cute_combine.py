"""The CuTe LSE combine (:mod:`foscar.cute.combine`). CPU: every configuration compiles for sm_90a and
its PTX issues a chunk's loads before it merges them. GPU (sm_90): the merge is float64
``combine_partials`` (base-2 partial LSEs) to FP32 rounding, every element checked, for part counts on
both sides of a chunk and past the largest, empty partials holding garbage, all-empty rows, NaN and +inf partial LSEs and a
NaN output of a weighted partial, into BF16, FP16 and FP32 outputs, with and without the LSE."""
import math
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

from foscar.cute.compile import compile_combine  # noqa: E402
from foscar.cute.config import COMBINE_MAX_CHUNK, CombineConfig, combine_chunk  # noqa: E402
from foscar.fold import combine_partials  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
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
