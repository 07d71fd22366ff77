"""Overlapped one-tile passes of v1 (``foscar.cute.config.OVERLAP_COLS``, :mod:`foscar.cute.overlap`): two of a
consumer's tiles a pass, tile B's QK product in flight over tile A's softmax and A's PV product over B's; and the
zeroing atom they use in two-tile passes (``QK_ZEROING_BITS``).

On the CPU (the switch at 8, 16 and 32 columns): the kernels compile for sm_90a with both products in flight (ptxas injects no wait and serializes no
wgmma), spill nothing at one CTA an SM, and at two CTAs an SM run as one-tile passes (``config.as_run``). On an sm_90
GPU: NaN-poisoned outputs against the float64 oracle at 8, 16 and 32 columns, steps with their causal limits, BF16
windows, consumers left without a tile B, scores that rise tile after tile (the rare rescale in tile B, while A's PV
product is in flight), V of any magnitude, and a CUDA graph's replay."""
import dataclasses
import os
import re
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER  # noqa: E402
from _helpers import V_MAGNITUDES, bf16_attention, cute_switches, kernel_error_bound, rel  # noqa: E402
from foscar.cute import config  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402

gpu = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")


@pytest.fixture
def overlap(monkeypatch):
    with cute_switches(monkeypatch, OVERLAP_COLS=(8, 16, 32), WIDE_STEP_COLUMNS=()):  # three consumers: no overlap
        yield


def _ptxas_report(cfg, ctas: int) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from ptxas_info import ptxas_report
    finally:
        sys.path.pop(0)
    return ptxas_report(compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=ctas).__ptx__)


@pytest.mark.parametrize("bits,gqa,step", [(2, 32, 1), (4, 32, 1), (2, 16, 1), (2, 4, 8), (4, 4, 4), (2, 8, 1), (4, 4, 2),
                                           (4, 4, 1)])
def test_overlapped_passes_keep_both_products_in_flight(overlap, bits, gqa, step):
    """At one CTA an SM: no wgmma serialized, no wait injected by ptxas, nothing spilled; each loop copy waits for
    one product of two in flight twice a pass (``wgmma.wait_group 1``)."""
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    cfg = config.config_for(fmt, gqa, 64, "e4m3", 1, step)
    assert cfg.overlap and cfg.p_tiles == 2
    report = _ptxas_report(cfg, 1)
    assert "serialized" not in report and "injected" not in report, report
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=1).__ptx__
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) == 2 * config.consumer_code_paths(cfg, 1)


@pytest.mark.parametrize("bits", (2, 4))
def test_two_tile_passes_zeroed_by_mma_wait_only_where_they_ask(monkeypatch, bits):
    """Two tiles a pass (GQA 4, the paper grid's default) with ``QK_ZEROING_BITS`` (as shipped): each QK accumulator
    zeroed by its first MMA. Without it, ptxas injects waits for the zeros moved into an accumulator while another
    product is in flight (INT2: tile B's, INT4: each FP32-promoted step's); zeroed by MMA it injects none."""
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    cfg = config.config_for(fmt, 4, 64, "e4m3", 2)
    assert cfg.qk_zeroing and not cfg.overlap
    report = _ptxas_report(cfg, 2)
    assert "serialized" not in report and "injected" not in report, report
    with cute_switches(monkeypatch, QK_ZEROING_BITS=()):  # monkeypatch keeps it to the test's end
        moved = _ptxas_report(config.config_for(fmt, 4, 64, "e4m3", 2), 2)
    assert "injected" in moved, moved


def test_two_ctas_an_sm_run_one_tile_passes(overlap):
    """At two CTAs an SM (or three consumers at one) the consumers' registers would spill the second tile's: the
    kernel is the one-tile pass's, PTX for PTX."""
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    cfg = config.config_for(fmt, 16, 64, "e4m3")
    assert cfg.overlap and not config.as_run(cfg, 2).overlap and config.as_run(cfg, 1) is cfg
    wide = dataclasses.replace(cfg, wide=True)  # three consumers at one CTA an SM: 160 registers a consumer
    assert not config.as_run(wide, 1).overlap
    plain = dataclasses.replace(cfg, overlap=False)
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__
    assert ptx == compile_stage1(plain, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__


def test_the_switch_applies_to_one_tile_passes_of_token_wise_k_and_v(overlap):
    for fmt_kw, gqa, k_operand, tiles, want in [
            ({}, 32, "e4m3", 1, True), ({}, 16, "bf16", 1, True), ({}, 8, "e4m3", 1, True), ({}, 4, "e4m3", 2, False),
            ({"k_axis": "channel"}, 32, "bf16", 1, False), ({"v_axis": "channel"}, 32, "e4m3", 1, False),
            ({"group_size": 64}, 32, "e4m3", 1, False)]:
        fmt = foscar.KVFormat(**{"bits": 2, "head_dim": 128, "group_size": 128, **fmt_kw})
        assert config.config_for(fmt, gqa, 64, k_operand, tiles).overlap == want, (fmt_kw, gqa, tiles)


# ---- on the GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,fmt_kw", [
    ([5000, 129, 1], 32, None, {}),  # a one-token sequence; two tiles and a token
    ([3000, 64 * 3], 32, 7, {}),  # seven splits: consumers with an odd count of tiles (no tile B in their last pass)
    ([4001, 700, 65], 16, 2, {}),
    ([5000, 700, 65], 8, None, {}),  # 8 columns (E4M3 K's terms in column blocks)
    ([3000, 129], 4, 5, {}),  # 4 rows: two terms share the 8 columns (INT4: FP32-promoted QK steps)
    ([3000, 5], 32, 3, {"sink": 4, "recent": 100}),  # BF16 windows: the combine attends them
    ([2000, 333], 32, None, {"head_dim": 64, "group_size": 64})])
def test_overlapped_passes_against_the_oracle_gpu(overlap, bits, lens, G, num_splits, fmt_kw):
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    cute_against_the_oracle(fmt, lens, G, "overlapped passes: error", num_splits=num_splits,
                               warp_specialized=True, ctas_per_sm=1, k_operand="e4m3")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("G,T", [(4, 8), (4, 4), (8, 4), (2, 8), (4, 2), (2, 4)])
def test_overlapped_steps_against_the_oracle_gpu(overlap, bits, G, T):
    """A step's tokens as the columns of overlapped passes (8, 16 and 32 columns, one CTA an SM), each column under
    its causal limit."""
    from foscar import backends
    from _cases import cut_to, make_step
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    lens = [T, 64 * 7 + T - 1, 4099, 64 * 5 + 1]
    q, cache = make_step(fmt, lens, T, Hkv=2, G=G, seed=bits + T)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    got = backends.get("cute").launch_step(q, cache, {"out": out, "warp_specialized": True, "ctas_per_sm": 1,
                                                      "k_operand": "e4m3", "tiles_per_pass": 1})
    exact = foscar.decode_exact(q, cache)
    base = torch.stack([bf16_attention(q[:, j], cut_to(cache, [L - T + 1 + j for L in lens]), sdpa=True)
                        for j in range(T)], 1)
    assert bool(torch.isfinite(got).all())
    assert rel(got, exact) <= kernel_error_bound(fmt, rel(base, exact))


def _rising_scores_case(device):
    """``(q, cache)``: GQA 32, 2 KV heads, 3000 and 900 tokens whose keys' first channel grows along the sequence
    as the queries' does not change, so that the scores rise by about 50 (base 2) over the sequence: the maxima pass
    the lazy rescale's headroom again and again, in tiles A and B alike."""
    gen = torch.Generator().manual_seed(5)
    B, Hkv, L, D = 2, 2, 3000, 128
    k = torch.randn(B, Hkv, L, D, generator=gen)
    k[..., 0] += torch.linspace(0.0, 40.0, L)
    v = torch.randn(B, Hkv, L, D, generator=gen)
    q = torch.randn(B, Hkv * 32, D, generator=gen)
    q[..., 0] = 10.0
    fmt = foscar.KVFormat(bits=4, head_dim=D, group_size=128)
    cache = foscar.quantize_kv(k.to(device), v.to(device), fmt,
                               seq_lens=torch.tensor([L, 900], dtype=torch.int32, device=device))
    return q.to(torch.bfloat16).to(device), cache


@pytest.mark.gpu
@gpu
def test_rising_scores_rescale_in_either_tile_gpu(overlap):
    from foscar.cute.launch import decode
    q, cache = _rising_scores_case("cuda")
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    decode(q, cache, out=out, num_splits=2, warp_specialized=True, ctas_per_sm=1, k_operand="e4m3")
    exact = foscar.decode_exact(q, cache)
    assert bool(torch.isfinite(out).all())
    assert rel(out, exact) <= kernel_error_bound(cache.fmt, rel(bf16_attention(q, cache, sdpa=True), exact))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("magnitude", V_MAGNITUDES)
def test_overlapped_values_of_any_magnitude_gpu(overlap, magnitude):
    """The magnitude cases (:func:`_helpers.magnitude_cache`) with 32 query heads a KV head: finite, within the
    kernels' bound of the float64 oracle."""
    from _helpers import magnitude_cache

    from foscar.cute.launch import decode
    fmt = foscar.KVFormat(bits=2, head_dim=64, group_size=64)
    q4, cache = magnitude_cache(fmt, magnitude, "cuda")
    q = torch.randn(q4.shape[0], cache.num_kv_heads * 32, fmt.head_dim, generator=torch.Generator().manual_seed(1))
    q = q.to(torch.bfloat16).cuda()
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    decode(q, cache, out=out, warp_specialized=True, ctas_per_sm=1, k_operand="e4m3")
    exact = foscar.decode_exact(q, cache)
    assert torch.isfinite(out).all()
    assert rel(out, exact) <= kernel_error_bound(fmt, rel(bf16_attention(q, cache, sdpa=True), exact))


@pytest.mark.gpu
@gpu
def test_overlapped_graph_replay_gpu(overlap):
    """A CUDA graph's replay over new query values gives the eager result bit for bit."""
    from _cases import make

    from foscar.cute.launch import decode
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    q, cache = make(fmt, [5000, 700], Hkv=1, G=32, page=64, seed=3)
    launch = {"num_splits": 4, "warp_specialized": True, "ctas_per_sm": 1, "k_operand": "e4m3"}
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    decode(q, cache, out=out, **launch)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        decode(q, cache, out=out, **launch)
    q.copy_(torch.randn_like(q))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode(q, cache, **launch))
