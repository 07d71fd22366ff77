"""The packed layout, the operand mappings and the quantizer round trip."""
import itertools

import pytest
import torch
from _helpers import random_values
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import foscar
from foscar.format import (
    BF16_INJECTION,
    E2M1_PLACEMENT,
    E4M3_PLACEMENT,
    MAPPINGS,
    block_tokens,
    inject_pair_bf16,
    pack_codes,
    unpack_codes,
)

BITS = (2, 4)
HEAD_DIMS = (64, 128, 256)


def hopper_owner(t, r, h):
    """The verified m64nNk16 RS fragment (../shared/docs/cute-dsl-hopper.md): thread t = 32w + l,
    register r = 4b + j, half h -> (row, k). Works elementwise on tensors."""
    w, l = t // 32, t % 32
    b, j = r // 4, r % 4
    return 16 * w + l // 4 + 8 * (j % 2), 16 * b + 2 * (l % 4) + 8 * (j // 2) + h


@pytest.mark.parametrize("bits,D", list(itertools.product(BITS, HEAD_DIMS)))
def test_k_tile_is_the_hopper_fragment(bits, D):
    """A 64-token K tile: thread t's words are contiguous; register r sits in its word r // (16/bits)
    at bits*(r % (16/bits)) and 16 + that, so one shift + one masked merge builds it."""
    g = torch.Generator().manual_seed(bits * D)
    codes = torch.randint(0, 1 << bits, (64, D), generator=g)
    words = pack_codes(codes, bits, "k")
    rpw = 16 // bits
    wpt = D * bits // 64  # words per thread per tile
    assert words.numel() == 128 * wpt
    t, r = torch.meshgrid(torch.arange(128), torch.arange(D // 4), indexing="ij")  # D/4 A registers per thread
    pair = inject_pair_bf16(words[t * wpt + r // rpw], bits * (r % rpw), bits).double()
    for h in range(2):
        row, k = hopper_owner(t, r, h)
        assert torch.equal(pair[..., h], 128 + codes[row, k].double())


@pytest.mark.parametrize("bits,D", list(itertools.product(BITS, HEAD_DIMS)))
def test_v_tile_is_the_transposed_hopper_fragment(bits, D):
    """A 64-token V tile is the A operand V^T (rows = channels in m64 halves, k = tokens): thread t,
    half mh, register r lives in pack block r // (16/bits), word t*(D/64) + mh of that block."""
    g = torch.Generator().manual_seed(7 + bits * D)
    codes = torch.randint(0, 1 << bits, (64, D), generator=g)
    words = pack_codes(codes, bits, "v")
    rpw = 16 // bits
    wpb = block_tokens(bits, "v") * D * bits // 32
    assert wpb == 2 * D
    t, mh, r = torch.meshgrid(torch.arange(128), torch.arange(D // 64), torch.arange(16), indexing="ij")
    pair = inject_pair_bf16(words[(r // rpw) * wpb + t * (D // 64) + mh], bits * (r % rpw), bits).double()
    for h in range(2):
        row, tok = hopper_owner(t, r, h)  # 4 k16 blocks x 4 registers over the 64 tokens
        assert torch.equal(pair[..., h], 128 + codes[tok, 64 * mh + row].double())


@pytest.mark.parametrize("bits,D,tensor", list(itertools.product(BITS, HEAD_DIMS, "kv")))
def test_pack_unpack_roundtrip_and_fields_disjoint(bits, D, tensor):
    g = torch.Generator().manual_seed(bits + D)
    T = 4 * block_tokens(bits, tensor)
    codes = torch.randint(0, 1 << bits, (3, T, D), generator=g, dtype=torch.int32)
    words = pack_codes(codes, bits, tensor)
    assert words.dtype == torch.int32 and words.shape == (3, T * D * bits // 32)
    assert torch.equal(unpack_codes(words, bits, tensor, D), codes)
    full = torch.full_like(codes, (1 << bits) - 1)  # every field set -> every bit of every word set
    assert bool((pack_codes(full, bits, tensor) == -1).all())


@pytest.mark.parametrize("mapping", list(MAPPINGS.values()), ids=list(MAPPINGS))
def test_every_code_constructs_alpha_q_plus_beta_exactly(mapping):
    for b in (2,) if mapping.name == "e2m1" else (2, 4):
        q = torch.arange(1 << b)
        y = mapping.construct(q)
        assert torch.equal(y, mapping.alpha * q.double() + mapping.beta), (mapping.name, b)


@pytest.mark.parametrize("bits", (2, 4))
def test_f16_placement_is_linear_through_the_first_normal_binade(bits):
    """FP16 placement (exponent field 0): every code at every bit up to ``11 - bits`` is ``q 2^(shl - 24)``
    exactly, subnormal or in the first normal binade; one bit higher the pattern's value is no longer linear."""
    from foscar.format import f16_placement
    q = torch.arange(1 << bits)
    for shl in range(0, 12 - bits):
        op = f16_placement(shl)
        assert (op.alpha, op.beta) == (2.0 ** (shl - 24), 0.0)
        assert torch.equal(op.construct(q), op.alpha * q.double()), shl
    assert not torch.equal(f16_placement(12 - bits).construct(q), 2.0 ** (12 - bits - 24) * q.double())


def test_bf16_bit_patterns_and_pair_construction():
    q = torch.arange(16, dtype=torch.int32)
    bits = (q | 0x4300).to(torch.int16)
    assert torch.equal(bits.view(torch.bfloat16).double(), q.double() + 128)
    for bw in BITS:  # the pair trick: codes 16 bits apart -> two BF16 operands in one register
        for lo, hi in itertools.product(range(1 << bw), repeat=2):
            for slot in range(16 // bw):
                word = torch.tensor([(lo << (bw * slot)) | (hi << (16 + bw * slot))], dtype=torch.int64)
                word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
                pair = inject_pair_bf16(word, bw * slot, bw)[0]
                assert pair.tolist() == [128.0 + lo, 128.0 + hi]


def test_e2m1_decoder_matches_the_fp4_table():
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    got = foscar.format.e2m1_decode(torch.arange(16))
    assert got[:8].tolist() == table and got[8:].tolist() == [-x for x in table]


def test_e4m3_placement_is_subnormal_scaled():
    q = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(q.view(torch.float8_e4m3fn).double(), q.double() * 2.0 ** -9)


@pytest.mark.parametrize("mapping", [BF16_INJECTION, E4M3_PLACEMENT, E2M1_PLACEMENT], ids=lambda m: m.name)
def test_fold_constants_eq5(mapping):
    g = torch.Generator().manual_seed(3)
    s = torch.rand(100, generator=g) * 10
    z = torch.randn(100, generator=g) * 100
    sp, zp = mapping.fold(s, z)
    assert sp.dtype == zp.dtype == torch.float32
    assert torch.equal(sp.double(), s.double() / mapping.alpha)  # power-of-two alpha: exact
    ref = z.double() - mapping.beta * s.double() / mapping.alpha
    assert torch.equal(zp, ref.float())  # one round-to-nearest
    s2, z2 = mapping.unfold(sp, zp)
    assert torch.equal(s2, s.double())


# ------------------------------------------------------------------------------------------
# Quantizer round trip: |dequantize(quantize(x)) - x| <= s/2 per element (min-max)
# ------------------------------------------------------------------------------------------
@st.composite
def roundtrip_case(draw):
    bits = draw(st.sampled_from(BITS))
    D = draw(st.sampled_from(HEAD_DIMS))
    k_axis = draw(st.sampled_from(("token", "channel")))
    v_axis = draw(st.sampled_from(("token", "channel")))
    groups = [g for g in (32, 64, 128, 256) if g <= D or "channel" in (k_axis, v_axis)]
    g = draw(st.sampled_from(groups))
    if k_axis == "token" or v_axis == "token":
        g = min(g, D)
    L = draw(st.integers(1, 300))
    mag = draw(st.sampled_from((1e-3, 1.0, 1e3)))
    offset = draw(st.sampled_from((0.0, 1.0, -50.0)))
    const_frac = draw(st.sampled_from((0.0, 0.3)))
    mapping = draw(st.sampled_from(("bf16", "e4m3") + (("e2m1",) if bits == 2 else ())))
    seed = draw(st.integers(0, 2 ** 31))
    return dict(bits=bits, D=D, g=g, k_axis=k_axis, v_axis=v_axis, L=L, mag=mag, offset=offset,
                const_frac=const_frac, mapping=mapping, seed=seed)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(roundtrip_case())
@example(dict(bits=2, D=128, g=128, k_axis="token", v_axis="token", L=1, mag=1.0, offset=0.0, const_frac=0.0,
              mapping="bf16", seed=1))
@example(dict(bits=4, D=64, g=32, k_axis="channel", v_axis="channel", L=200, mag=1e3, offset=-50.0, const_frac=0.3,
              mapping="bf16", seed=2))
def test_minmax_roundtrip_within_half_step(case):
    gen = torch.Generator().manual_seed(case["seed"])
    fmt = foscar.KVFormat(bits=case["bits"], head_dim=case["D"], group_size=case["g"], k_axis=case["k_axis"],
                          v_axis=case["v_axis"], mapping=case["mapping"])
    L = case["L"]
    k = random_values((2, 2, L, case["D"]), case["mag"], case["offset"], case["const_frac"], gen)
    v = random_values((2, 2, L, case["D"]), case["mag"], case["offset"], case["const_frac"], gen)
    cache = foscar.quantize_kv(k, v, fmt)
    kd, vd = cache.dequantize(torch.float64)
    exp = cache.export()
    n_quant = int(cache.split()[1][0])
    for tensor, x, xd in (("k", k, kd), ("v", v, vd)):
        s = exp[f"{tensor}_scale"][..., :, :]
        z = exp[f"{tensor}_offset"]
        if fmt.axis(tensor) == "token":
            s_el = s.repeat_interleave(fmt.group_size, -1)
            z_el = z.repeat_interleave(fmt.group_size, -1)
        else:
            s_el = s.repeat_interleave(fmt.group_size, -2)
            z_el = z.repeat_interleave(fmt.group_size, -2)
        xq = fmt.as_quantized(x, torch.bfloat16).double()[:, :, :n_quant]  # what the quantizer reads
        err = (xd[:, :, :n_quant] - xq).abs()
        # s/2 from rounding, plus the FP32 resolution of the stored constants (z' = z - beta s' is
        # rounded once to FP32: half an ulp of |z'| and a few ulps of the operands' magnitude).
        ulp = 2.0 ** -23 * (z_el.abs() + fmt.op.beta * s_el + xq.abs())
        assert bool((err <= s_el / 2 + 2 * ulp).all()), float((err - s_el / 2).max())
        # unquantized (BF16 window) tokens are kept exactly in the window dtype
        assert torch.equal(xd[:, :, n_quant:], x.double()[:, :, n_quant:].to(torch.bfloat16).double())


def test_constant_group_is_exact_and_no_division_by_zero():
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64)
    k = torch.full((1, 1, 16, 64), 3.25)
    v = torch.full((1, 1, 16, 64), -7.5)
    cache = foscar.quantize_kv(k, v, fmt)
    kd, vd = cache.dequantize()
    assert torch.equal(kd, k.double()) and torch.equal(vd, v.double())
    assert torch.isfinite(cache.k_params).all()


@pytest.mark.parametrize("quantizer", ["mse", "quantile"])
def test_clipped_quantizers_beat_minmax_on_outliers(quantizer):
    """Clipping trades the outliers' error for finer steps: lower MSE on heavy-tailed groups."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 512, 128, generator=g) * torch.where(torch.rand(1, 4, 512, 128, generator=g) < 0.01, 20.0,
                                                               1.0)
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    err = {}
    for qz in ("minmax", quantizer):
        kd, _ = foscar.quantize_kv(x, x, fmt, quantizer=qz).dequantize()
        err[qz] = float(((kd - x.double()) ** 2).mean())
    assert err[quantizer] < err["minmax"]


@pytest.mark.parametrize("k_axis", ["token", "channel"])
def test_oscar_preset_shrinks_each_range_by_its_tensors_ratio(k_axis):
    """``quantizer="oscar"``: every group's range is its min-max range shrunk about the midpoint by 0.96 (K)
    and 0.92 (V), in float64; values past the ends take the end codes (checked against the stored
    constants, group by group, every element)."""
    from foscar.quantize import CLIP_PRESETS
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 128, 64, generator=g) * 3 + 1, torch.randn(2, 2, 128, 64, generator=g)
    k, v = k.bfloat16().float(), v.bfloat16().float()  # what a write path may round them to first
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64, k_axis=k_axis)
    cache = foscar.quantize_kv(k, v, fmt, quantizer="oscar")
    kd, vd = cache.dequantize()
    for x, xd, ratio, axis in ((k, kd, CLIP_PRESETS["oscar"][0], k_axis), (v, vd, CLIP_PRESETS["oscar"][1], "token")):
        def grouped(t):  # [..., groups, g]: 64 channels of a token, or 64 tokens of a channel
            return t.reshape(2, 2, 128, 1, 64) if axis == "token" else t.reshape(2, 2, 2, 64, 64).transpose(-1, -2)
        groups, dq = grouped(x.double()), grouped(xd)
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        mid, half = (lo + hi) / 2, (hi - lo) / 2
        want_lo, want_hi = mid - ratio * half, mid + ratio * half
        # the reconstructions' extremes are the shrunk range's ends (to FP32 storage of s', z')
        assert torch.allclose(dq.amin(-1, keepdim=True), want_lo, rtol=0, atol=1e-5 * float(half.max()))
        assert torch.allclose(dq.amax(-1, keepdim=True), want_hi, rtol=0, atol=1e-5 * float(half.max()))
    minmax_err = float(((foscar.quantize_kv(k, v, fmt).dequantize()[0] - k.double()) ** 2).mean())
    assert float(((kd - k.double()) ** 2).mean()) != minmax_err


def test_bytes_per_token():
    assert foscar.KVFormat(bits=2, head_dim=128, group_size=128).bytes_per_token() == 80
    assert foscar.KVFormat(bits=4, head_dim=128, group_size=128).bytes_per_token() == 144


@pytest.mark.parametrize("bits,D", list(itertools.product(BITS, HEAD_DIMS)))
def test_block_map_matches_docs_layout_md(bits, D):
    """The closed forms written in docs/layout.md are the layout."""
    from foscar.format import block_map
    t, c = torch.meshgrid(torch.arange(16), torch.arange(D), indexing="ij")
    lane = 4 * (t % 8) + (c % 8) // 2
    r = 4 * (c // 16) + t // 8 + 2 * ((c % 16) // 8)
    word, bit = block_map(bits, D, "k")
    assert torch.equal(word, lane * (D * bits // 64) + r // (16 // bits))
    assert torch.equal(bit, bits * (r % (16 // bits)) + 16 * (c % 2))
    t, c = torch.meshgrid(torch.arange(64 // bits), torch.arange(D), indexing="ij")
    cr = c % 64
    thread = 32 * (cr // 16) + 4 * (cr % 8) + (t % 8) // 2
    r = 4 * (t // 16) + (cr % 16) // 8 + 2 * ((t % 16) // 8)
    word, bit = block_map(bits, D, "v")
    assert torch.equal(word, thread * (D // 64) + c // 64)
    assert torch.equal(bit, bits * r + 16 * (t % 2))
