"""The FP4 block formats' codec (:mod:`foscar.fp4`): every E2M1 code, every scale byte, the rounding and the
scale search against brute force in float64, the operands by bit placement read back through torch's own
float8 and float16 types, and bad input refused by name."""
import pytest
import torch

from foscar import fp4
from foscar.format import e2m1_decode
from foscar.errors import InvalidArgumentError

CODES = torch.arange(16)


def test_rounding_is_to_nearest_with_ties_to_the_even_mantissa():
    gen = torch.Generator().manual_seed(0)
    y = torch.cat([torch.randn(4000, generator=gen, dtype=torch.float64) * 4,
                   torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 7.0, -100.0, 0.0, -0.0, 1e-30])])
    codes = fp4.e2m1_round(y)
    grid = e2m1_decode(CODES)
    dist = (y[:, None] - grid[None, :]).abs()
    best = dist.min(1).values
    got = (y - e2m1_decode(codes)).abs()
    inside = y.abs() <= 6
    assert torch.equal(got[inside], best[inside])  # nearest
    assert bool((e2m1_decode(codes[~inside]).abs() == 6).all())  # saturated
    ties = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}  # the even mantissa (code bit 0 clear)
    for v, c in ties.items():
        assert int(fp4.e2m1_round(torch.tensor([v], dtype=torch.float64))) == c
        assert int(fp4.e2m1_round(torch.tensor([-v], dtype=torch.float64))) == c | (8 if c else 0)
    assert int(fp4.e2m1_round(torch.tensor([-0.1]))) == 0  # no negative zero code


@pytest.mark.parametrize("spec", (fp4.NVFP4, fp4.MXFP4))
def test_every_scale_byte_round_trips(spec):
    b = torch.arange(255, dtype=torch.uint8) if spec.scale == "e8m0" else torch.arange(256, dtype=torch.uint8)
    s = fp4.decode_scale(b, spec)
    finite = torch.isfinite(s) & (s >= 0) & ~((b == 0x80) & (spec.scale == "e4m3"))  # E4M3: -0 is 0x80
    assert torch.equal(fp4.encode_scale(s[finite], spec), b[finite])
    if spec.scale == "e8m0":
        assert torch.equal(s, torch.ldexp(torch.ones(255, dtype=torch.float64), torch.arange(255) - 127))
        assert torch.isnan(fp4.decode_scale(torch.tensor([255], dtype=torch.uint8), spec)).all()


def _brute_force(x: torch.Tensor, spec, ts: float):
    """Per block: the better of the two candidates, each scale and its codes tried exhaustively in float64."""
    xb = x.double().reshape(-1, spec.block)
    out = []
    for blk in xb:
        amax = blk.abs().max()
        best = None
        for sb in fp4._candidates(amax[None], spec, ts):
            s = float(fp4.decode_scale(sb, spec)) * ts
            grid = e2m1_decode(CODES) * s
            deq = grid[(blk[:, None] - grid[None, :]).abs().argmin(1)] if s > 0 else torch.zeros_like(blk)
            err = float(((deq - blk) ** 2).sum())
            if best is None or err < best[0]:
                best = (err, deq)
        out.append(best[1])
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("spec", (fp4.NVFP4, fp4.MXFP4))
@pytest.mark.parametrize("seed", (0, 1))
def test_the_quantizer_keeps_the_better_candidate_per_block(spec, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 128, generator=gen) * torch.logspace(-3, 3, 6)[:, None]
    x[0, :spec.block] = 0  # an all-zero block
    x[1, 5] = 40.0  # an outlier
    q = fp4.quantize_blocks(x, spec)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape and q.scales.shape == (6, 128 // spec.block)
    deq = fp4.dequantize_blocks(q)
    assert torch.equal(deq[0, :spec.block], torch.zeros(spec.block, dtype=torch.float64))
    want = _brute_force(x, spec, q.tensor_scale)
    # the same error per block (equal codes where the grid has no tie)
    err_got = ((deq - x.double()) ** 2).reshape(-1, spec.block).sum(1)
    err_want = ((want - x.double()) ** 2).reshape(-1, spec.block).sum(1)
    assert torch.allclose(err_got, err_want, rtol=1e-12, atol=0)
    rel = float((deq - x.double()).norm() / x.double().norm())
    assert rel < 0.12  # FP4's step: a few percent per value
    if spec is fp4.NVFP4:  # the per-tensor scale puts the largest block scale within E4M3's range
        assert q.tensor_scale == pytest.approx(float(x.abs().max()) / (448 * 6))
        assert float(fp4.decode_scale(q.scales, spec).max()) <= 448


def test_the_search_lowers_the_error_of_max_scaling():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=gen, dtype=torch.float64)
    for spec in (fp4.NVFP4, fp4.MXFP4):
        q = fp4.quantize_blocks(x, spec)
        ts = q.tensor_scale
        amax = x.reshape(-1, spec.block).abs().amax(-1)
        plain = fp4._candidates(amax, spec, ts)[0]  # max scaling alone (MXFP4: the unclipped power of two)
        s = fp4.decode_scale(plain, spec)[:, None] * ts
        deq = e2m1_decode(fp4.e2m1_round(x.reshape(-1, spec.block) / s)) * s
        assert float(((fp4.dequantize_blocks(q).reshape(-1, spec.block) - x.reshape(-1, spec.block)) ** 2).sum()) \
            < float(((deq - x.reshape(-1, spec.block)) ** 2).sum())


def test_placed_operands_are_the_value_times_a_power_of_two():
    v = e2m1_decode(CODES)
    e4m3 = fp4.e2m1_to_e4m3(CODES).view(torch.float8_e4m3fn).double()
    assert torch.equal(e4m3, v * fp4.E4M3_PLACED_SCALE)
    f16 = fp4.e2m1_to_f16(CODES).view(torch.float16).double()
    assert torch.equal(f16, v * fp4.F16_PLACED_SCALE)


def test_a_words_two_e4m3_registers_hold_its_eight_codes():
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (500, 8), generator=gen)
    w = (codes << (4 * torch.arange(8))).sum(1)
    lo, hi = fp4.word_to_e4m3_registers(w)
    for b in range(4):
        assert torch.equal((lo >> (8 * b)) & 0xFF, fp4.e2m1_to_e4m3(codes[:, 2 * b]).long())
        assert torch.equal((hi >> (8 * b)) & 0xFF, fp4.e2m1_to_e4m3(codes[:, 2 * b + 1]).long())


def test_bad_input_is_refused_by_name():
    with pytest.raises(InvalidArgumentError, match="fp4 format"):
        fp4.spec_for("nvfp8")
    with pytest.raises(InvalidArgumentError, match="multiple of 16"):
        fp4.quantize_blocks(torch.randn(3, 24), "nvfp4")
    with pytest.raises(InvalidArgumentError, match="finite"):
        fp4.quantize_blocks(torch.tensor([[float("nan")] * 32]), "mxfp4")
    with pytest.raises(InvalidArgumentError, match="tensor_scale"):
        fp4.quantize_blocks(torch.randn(2, 32), "mxfp4", tensor_scale=2.0)
    with pytest.raises(InvalidArgumentError, match="tensor_scale"):
        fp4.quantize_blocks(torch.randn(2, 32), "nvfp4", tensor_scale=0.0)
    with pytest.raises(InvalidArgumentError, match="floating-point"):
        fp4.quantize_blocks(torch.ones(2, 32, dtype=torch.int32), "nvfp4")
    with pytest.raises(InvalidArgumentError, match="powers of two"):
        fp4.encode_scale(torch.tensor([3.0]), fp4.MXFP4)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgumentError, match="finite block scales"):
            fp4.encode_scale(torch.tensor([bad]), fp4.NVFP4)
    assert fp4.NVFP4.bytes_per_token(128) == 72 and fp4.MXFP4.bytes_per_token(128) == 68
