"""The E4M3 K-side operands and the ``m64n8k32`` QK wgmma in CuTe DSL (``foscar/cute/operands_e4m3.py``,
step 1 of ``docs/hopper-e4m3-plan.md``). CPU: the probe kernel compiles for sm_90a with four-register A
wgmma and no local memory; the (word, shift) each byte of a thread's A registers comes from, evaluated on
the host through the index functions the builder traces, is what :func:`foscar.e4m3.tile_fragment_map`
says, and CuTe's FP8 A fragment puts each byte at that map's (row, kappa). GPU (sm_90): the probe's S^T
equals the float64 product of the E4M3 operands."""
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # trace and compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

from cutlass.cute.runtime import from_dlpack

from foscar import e4m3
from foscar.cute import operands_e4m3
from foscar.cute.operands_e4m3 import (
    E4m3Tile,
    compile_probe,
    e4m3_fragment_ownership,
    k_registers_e4m3,
    tile_register_source_e4m3,
)
from foscar.format import pack_codes
from _cases import HOPPER

WGMMA_E4M3 = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n8k32\.f32\.e4m3\.e4m3\s+\{[^}]*\},\s*\{([^}]*)\}")
CASES = [(bits, d) for bits in (2, 4) for d in (64, 128)]


def _tensors(cfg, tiles, device="cpu"):
    W = torch.zeros(tiles, cfg.tile_words, dtype=torch.int32, device=device)
    Q = torch.zeros(8, cfg.head_dim, dtype=torch.uint8, device=device)
    S = torch.zeros(tiles, 64, 8, dtype=torch.float32, device=device)
    return W, Q, S


def _compile(cfg, W, Q, S, keep_ptx=False):
    return compile_probe(cfg, *(from_dlpack(x, assumed_align=16) for x in (W, Q, S)), keep_ptx=keep_ptx)


@pytest.mark.parametrize("bits,head_dim", CASES)
def test_probe_compiles_for_sm90a(bits, head_dim):
    cfg = E4m3Tile(bits, head_dim)
    ptx = _compile(cfg, *_tensors(cfg, 2), keep_ptx=True).__ptx__
    mmas = WGMMA_E4M3.findall(ptx)
    assert len(mmas) == head_dim // 32, "S^T = K Q^T: one m64n8k32 wgmma per k32 block of the head dim"
    assert all(len(a.split(",")) == 4 for a in mmas), "A from registers: four 32-bit registers"
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == len(mmas)
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"
    assert "fence.proxy.async" in ptx, "Q^T stored to shared memory must be fenced before the wgmma reads it"


@pytest.mark.parametrize("bits,head_dim", CASES)
def test_register_sources_are_the_tile_fragment_map(bits, head_dim):
    """For every thread, register and byte: the code at the builder's (word, shift) of the packed tile is
    the code of tile_fragment_map's (token, channel), and the bytes are tile_registers'."""
    fmap = e4m3.tile_fragment_map(bits, head_dim, "k")
    word, shift = tile_register_source_e4m3(bits, head_dim)
    assert word.shape == fmap["token"].shape[1:] == (128, k_registers_e4m3(head_dim), 4)
    gen = torch.Generator().manual_seed(7 * bits + head_dim)
    codes = torch.randint(0, 1 << bits, (64, head_dim), generator=gen, dtype=torch.int32)
    words = pack_codes(codes, bits, "k")
    w = words.long() & 0xFFFFFFFF
    got = (w[word] >> shift) & ((1 << bits) - 1)
    assert torch.equal(got, codes[fmap["token"][0], fmap["channel"][0]].long())
    assert torch.equal(got.to(torch.uint8), e4m3.tile_registers(words, bits, "k", head_dim)[0])
    # the shift and the mask leave exactly the code in each byte: the register is (w >> bits*i) & mask
    assert torch.equal(shift[..., 0] % bits, torch.zeros_like(shift[..., 0]))
    assert bool((shift[..., 0] < 8).all()) and torch.equal(shift[..., 1:] - shift[..., :1],
                                                           8 * torch.arange(1, 4).expand(128, shift.shape[1], 3))
    # every word of the tile is read, by exactly one thread
    readers = torch.zeros(words.numel(), dtype=torch.long)
    for t in range(128):
        readers[word[t].unique()] += 1
    assert bool((readers == 1).all())


@pytest.mark.parametrize("head_dim", (64, 128))
def test_cute_fragment_is_the_tile_fragment_map(head_dim):
    """CuTe's FP8 A fragment (Uint32 view) puts byte v of register e of thread t at tile_fragment_map's
    (row, kappa): the GMMA ALayout_64x32 order foscar.e4m3 assumes."""
    own = e4m3_fragment_ownership(64, head_dim)
    assert (own >= 0).all(), "a fragment slot CuTe did not assign"
    for bits in (2, 4):
        fmap = e4m3.tile_fragment_map(bits, head_dim, "k")
        assert torch.equal(own[..., 0], fmap["row"][0])
        assert torch.equal(own[..., 1], fmap["kappa"][0])
        assert torch.equal(fmap["row"], fmap["token"])  # K: the rows are the tokens
        # kappa holds channel order[kappa]: B = Q[:, order] pairs each code with its channel of Q
        assert torch.equal(e4m3.contraction_order(bits, head_dim)[fmap["kappa"]], fmap["channel"])


def test_probe_traces_the_index_functions(monkeypatch):
    """The probe loads its words at fragment.k_word and builds each register at k_register_source_e4m3."""
    calls = {}

    def spy(name):
        real = getattr(operands_e4m3, name)

        def wrapper(*args):
            calls[name] = calls.get(name, 0) + 1
            return real(*args)
        monkeypatch.setattr(operands_e4m3, name, wrapper)

    spy("k_word")
    spy("k_register_source_e4m3")
    cfg = E4m3Tile(2, 128)
    _compile(cfg, *_tensors(cfg, 1))
    assert calls == {"k_word": cfg.k_words, "k_register_source_e4m3": k_registers_e4m3(cfg.head_dim)}


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits,head_dim", CASES)
def test_probe_matches_float64(bits, head_dim):
    """S^T of random codes and a random E4M3 Q (stored permuted by contraction_order) is float64
    ``y Q^T`` with ``y = q 2^-9``, to the rounding of the tensor cores' FP8 accumulation."""
    tiles = 8
    cfg = E4m3Tile(bits, head_dim)
    gen = torch.Generator().manual_seed(100 * bits + head_dim)
    codes = torch.randint(0, 1 << bits, (tiles, 64, head_dim), generator=gen, dtype=torch.int32)
    words = torch.stack([pack_codes(c, bits, "k") for c in codes])
    q = (torch.randn(8, head_dim, generator=gen) * 4).to(torch.float8_e4m3fn)
    order = e4m3.contraction_order(bits, head_dim)
    W, Q, S = words.cuda(), q[:, order].contiguous().view(torch.uint8).cuda(), torch.full(
        (tiles, 64, 8), float("nan"), device="cuda")
    fn = _compile(cfg, W, Q, S)
    fn(*(from_dlpack(x, assumed_align=16) for x in (W, Q, S)))
    torch.cuda.synchronize()
    y = codes.double() * 2.0 ** -9
    ref = y @ q.double().T
    scale = y.abs() @ q.double().abs().T  # sum of |products|: the bound of any accumulation's rounding
    err = (S.cpu().double() - ref).abs()
    ratio = float((err / scale.clamp(min=1e-30)).max())
    print(f"INT{bits} D{head_dim}: max |S - float64| / sum|products| = {ratio:.2e}")
    assert bool(torch.isfinite(S).all())
    # FP8 wgmma keeps about 14 bits of the running sum (it is not an FP32 accumulation)
    assert bool((err <= 2.0 ** -13 * scale + 1e-30).all()), f"max err / scale {ratio:.2e}"


# ---- Q as two E4M3 residual terms in the N columns (QkTermsProbeE4m3) ---------------------------------
TERM_CASES = [(2, 128, 4), (4, 128, 4), (2, 64, 1), (4, 64, 3)]


def _terms_tensors(cfg, tiles, gqa, device="cpu"):
    W = torch.zeros(tiles, cfg.tile_words, dtype=torch.int32, device=device)
    Q = torch.zeros(1, gqa, cfg.head_dim, dtype=torch.float32, device=device)
    S = torch.zeros(tiles, 64, gqa, dtype=torch.float32, device=device)
    return W, Q, S


@pytest.mark.parametrize("bits,head_dim,gqa", TERM_CASES)
def test_terms_probe_compiles_for_sm90a(bits, head_dim, gqa):
    cfg = E4m3Tile(bits, head_dim)
    fn = operands_e4m3.compile_terms_probe(cfg, gqa, *(from_dlpack(x, assumed_align=16)
                                                      for x in _terms_tensors(cfg, 2, gqa)))
    assert callable(fn)


def test_terms_probe_refuses_more_heads_than_the_columns_hold():
    with pytest.raises(ValueError, match="^gqa: expected 1 to 4"):
        operands_e4m3.QkTermsProbeE4m3(E4m3Tile(2, 128), 5)


def test_a_heads_lo_term_is_where_sum_q_terms_reads_it():
    """``sum_q_terms`` reads head h's lo term (column gp + h) in the FP8 MMA's C fragment from element e + 1
    of the same thread (gp 1) or element e of lane ``lane ^ gp/2`` (gp 2 and 4): traced C ownership."""
    from foscar.cute.fragment import rs_accumulator_ownership
    own = rs_accumulator_ownership(64, make_mma=operands_e4m3.qk_mma_e4m3)  # [thread, e, (row, col)]
    for gqa in (1, 2, 3, 4):
        gp = operands_e4m3.term_columns(gqa)
        for t in range(128):
            for e in range(own.shape[1]):
                row, col = own[t, e].tolist()
                if col >= gqa:
                    continue
                if gp == 1:
                    assert own[t, e + 1].tolist() == [row, gp + col]
                else:
                    assert own[t ^ (gp // 2), e].tolist() == [row, gp + col]


def test_contraction_position_is_the_contraction_order():
    for bits in (2, 4):
        for d in (64, 128, 256):
            got = [operands_e4m3.contraction_position(bits, p) for p in range(d)]
            assert got == e4m3.contraction_order(bits, d).tolist()


def test_scale_exponent_in_the_kernel_is_the_emulations():
    """The kernel's bit formula for the scale exponent (:func:`operands_e4m3.scale_exponent`: 134 minus
    the biased exponent, plus one where the significand is at most 1.75) equals
    :func:`foscar.e4m3.scale_exponent` for tops from 2^-100 to 2^100 (every exponent, both sides of
    1.75)."""
    ex = torch.arange(-100, 101, dtype=torch.float64)
    tops = torch.cat([torch.ldexp(torch.tensor(m, dtype=torch.float64).expand_as(ex), ex.long())
                      for m in (1.0, 1.5, 1.75, 1.7500001, 1.99)]).float()
    bits = tops.view(torch.int32).long()
    kernel = 134 - ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) <= 0x600000).long()
    assert torch.equal(kernel, e4m3.scale_exponent(tops.double()))
    assert bool((tops.double() * torch.pow(2.0, kernel.double()) <= operands_e4m3.E4M3_TOP).all())


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits,head_dim,gqa", TERM_CASES)
def test_terms_probe_matches_float64(bits, head_dim, gqa):
    """S^T from an FP32 Q split into two E4M3 terms in the kernel is the float64 product of the same terms
    (``foscar.e4m3.split_terms``, a power-of-two scale per head) to the FP8 wgmma's accumulation, and
    the exact ``y Q^T`` to the two-term split's error besides."""
    tiles = 8
    cfg = E4m3Tile(bits, head_dim)
    gen = torch.Generator().manual_seed(1000 * bits + head_dim + gqa)
    codes = torch.randint(0, 1 << bits, (tiles, 64, head_dim), generator=gen, dtype=torch.int32)
    words = torch.stack([pack_codes(c, bits, "k") for c in codes])
    q = torch.randn(gqa, head_dim, generator=gen) * torch.logspace(-3, 3, gqa)[:, None]  # heads far apart
    W, Q = words.cuda(), q[None].contiguous().cuda()  # natural channel order: the kernel places them
    S = torch.full((tiles, 64, gqa), float("nan"), device="cuda")
    fn = operands_e4m3.compile_terms_probe(cfg, gqa, *(from_dlpack(x, assumed_align=16) for x in (W, Q, S)))
    fn(*(from_dlpack(x, assumed_align=16) for x in (W, Q, S)))
    torch.cuda.synchronize()
    got = S.cpu().double()
    assert bool(torch.isfinite(got).all())
    y = codes.double() * 2.0 ** -9
    terms = e4m3.split_terms(q.double(), 2, dims=(1,))
    ref_terms = sum(y @ t.T for t in terms)
    scale = y.abs() @ q.double().abs().T
    accum = ((got - ref_terms).abs() / scale.clamp(min=1e-300)).max().item()
    exact = ((got - y @ q.double().T).abs() / scale.clamp(min=1e-300)).max().item()
    print(f"INT{bits} D{head_dim} G{gqa}: against the terms {accum:.2e}, against exact y Q^T {exact:.2e} "
          f"(of sum |products|)")
    assert accum <= 2.0 ** -13
    assert exact <= 2.0 ** -13 + 2.0 ** -8  # one term's rounding (2^-4) times the next term's (2^-4)


@pytest.mark.parametrize("bits,head_dim", CASES)
def test_placed_registers_carry_the_token_halfs_factor(bits, head_dim):
    """The decode kernels' placement (``k_placement_e4m3``, taken where ``Sm90Config.k_factors`` differ):
    each byte of register ``e``, read as E4M3, is ``q 2^9 / k_factor_h``, ``h`` the token half of CuTe's row
    for that byte (rows + 8 of a 16-row block), for the code at the unplaced register's bit."""
    import foscar
    from foscar.cute.config import config_for
    from foscar.cute.operands_e4m3 import k_placement_e4m3, k_register_source_e4m3
    cfg = config_for(foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=64), 4, 64, "e4m3")
    placed = cfg.k_factors[0] != cfg.k_factors[1]
    assert placed == (bits == 2)
    gen = torch.Generator().manual_seed(11 * bits + head_dim)
    codes = torch.randint(0, 1 << bits, (64, head_dim), generator=gen, dtype=torch.int32)
    words = pack_codes(codes, bits, "k").long() & 0xFFFFFFFF
    word, _ = tile_register_source_e4m3(bits, head_dim)
    fmap = e4m3.tile_fragment_map(bits, head_dim, "k")  # CuTe's rows (tests above), the channels they hold
    for e in range(k_registers_e4m3(head_dim)):
        rot, field = k_placement_e4m3(bits, k_register_source_e4m3(bits, e)[1], placed)
        reg = (words[word[:, e, 0]] >> rot) & (e4m3.PLACEMENT_MASK[bits] << field)
        byte = torch.stack([(reg >> (8 * b)) & 0xFF for b in range(4)], -1).to(torch.uint8)
        value = byte.view(torch.float8_e4m3fn).double()
        row, chan = fmap["token"][0][:, e], fmap["channel"][0][:, e]
        factor = torch.tensor(cfg.k_factors, dtype=torch.float64)[(row % 16) // 8]
        assert torch.equal(value * factor, codes[row, chan].double())
