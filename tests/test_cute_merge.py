"""v1's split merge inside stage 1 (``foscar.cute.merge``, ``foscar.cute.config.FUSED_MERGE``: one launch per short
decode). CPU: which calls take it, and the kernel with it compiles for sm_90a with one GPU-scope atomic and no local
memory, leaving the kernels without it as they were. GPU (sm_90): against the float64 oracle beside the two-launch
merge (outputs and LSEs NaN-poisoned, every element checked), splits past the sequence's tiles, steps of several
tokens, CUDA-graph replays, counters left at zero, and NaN rows where the cache holds a NaN, as the two-launch merge
gives them."""
import dataclasses
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _helpers import bf16_attention, rel  # noqa: E402
from foscar.cute import budget, config  # noqa: E402
from foscar.cute.launch import merges_in_stage1  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (runs on the H200)")
FMT = foscar.KVFormat(bits=4, head_dim=128, group_size=128)


def test_which_calls_merge_in_stage_1(monkeypatch):
    monkeypatch.setattr(config, "FUSED_MERGE", True)
    cfg = config.config_for(FMT, 4, 64, "e4m3", 2)
    out = torch.empty(2, 8, 128, dtype=torch.bfloat16)
    lse = torch.empty(2, 8)
    cnt = torch.zeros(4, dtype=torch.int32)

    def takes(fmt=FMT, c=cfg, ctas=2, parts=32, o=out, lv=lse, B=2, Hr=8):
        return merges_in_stage1(fmt, c, ctas, parts, o, lv, cnt, B, Hr) is not None
    assert takes() and takes(lv=None) and takes(parts=config.MERGE_PARTS)
    assert not takes(parts=config.MERGE_PARTS + 2), "more partials than the merge's shared memory holds"
    assert not takes(c=config.config_for(FMT, 16, 64, "e4m3", 1)), "more rows than MERGE_ROWS"
    assert not takes(fmt=foscar.KVFormat(bits=4, head_dim=128, group_size=128, sink=4, recent=32)), "windows"
    assert not takes(fmt=foscar.KVFormat(bits=4, head_dim=128, group_size=128, rotation="hadamard")), "rotation"
    assert not takes(o=out.float()), "a BF16 output only"
    heads_major = torch.empty(8, 2, 128, dtype=torch.bfloat16).transpose(0, 1)  # a step's rows: [B T, Hq, D]
    assert takes(o=heads_major) and not takes(o=heads_major, lv=None, B=1, Hr=16)
    assert not takes(lv=torch.empty(8, 2).t()), "an LSE that does not view as rows"
    assert not takes(o=torch.empty(2 * 8 * 128 + 1, dtype=torch.bfloat16)[1:].view(2, 8, 128)), "a misaligned output"
    full = budget.SM90_SHARED_BYTES  # an SM whose shared memory holds two CTAs' rings but not the merge's too
    monkeypatch.setattr(budget, "SM90_SHARED_BYTES", 2 * budget.shared_bytes(cfg))
    assert budget.fits_shared_memory(cfg, 2) and not takes(), "the merge's shared memory beside the ring"
    assert budget.merge_bytes(dataclasses.replace(cfg, fused_merge=True)) > 0 == budget.merge_bytes(cfg)
    monkeypatch.setattr(budget, "SM90_SHARED_BYTES", full)
    monkeypatch.setattr(config, "FUSED_MERGE", False)
    assert not takes()


@pytest.mark.parametrize("bits,gqa,tiles", [(4, 4, 2), (2, 8, 1)])
def test_the_merging_kernel_compiles_for_sm90a(bits, gqa, tiles):
    from foscar.cute.compile import compile_stage1
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    cfg = dataclasses.replace(config.config_for(fmt, gqa, 64, "e4m3", tiles), fused_merge=True, merge_lse=True)
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__
    assert len(re.findall(r"\batom\.", ptx)) == 1 and "atom.global.acq_rel.add" in ptx and "fence.acq_rel.gpu" in ptx
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"
    with pytest.raises(ValueError, match="v0"):
        compile_stage1(cfg, warp_specialized=False)


def _make(fmt, lens, Hkv, G, seed, T=1):
    from test_triton import make
    q, cache = make(fmt, lens, Hkv=Hkv, G=G, page=64, seed=seed)
    if T > 1:  # a step's tokens: [B, T, Hq, D]
        q = torch.randn(len(lens), T, q.shape[1], q.shape[2], device=q.device).bfloat16()
    return q, cache


def _both(q, cache, monkeypatch, **launch):
    """The decode with the merge in stage 1 and with the two-launch merge, outputs and LSEs NaN-poisoned; the first
    checked to have run the merging kernel."""
    from foscar.cute import launch as cute_launch
    res = []
    for fused in _merge_switch(monkeypatch):
        out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
        lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
        cute_launch.decode(q, cache, out=out, lse=lse, warp_specialized=True, **launch)
        res.append((out, lse))
    return res


def _merge_switch(monkeypatch):
    """``FUSED_MERGE`` on, then off, the compiled kernels forgotten before each; after each the decode run in
    between is checked to have compiled the merging kernel exactly when the switch was on."""
    from foscar.cute import launch as cute_launch
    for fused in (True, False):
        monkeypatch.setattr(config, "FUSED_MERGE", fused)
        cute_launch._COMPILED.clear()
        yield fused
        assert any(k[0].fused_merge for k in cute_launch._COMPILED if hasattr(k[0], "fused_merge")) == fused


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt,G,launch", [
    (FMT, 4, {"num_splits": 3}),
    (FMT, 4, {"num_splits": 30, "k_operand": "e4m3", "tiles_per_pass": 2}),  # splits past most sequences' tiles
    (foscar.KVFormat(bits=2, head_dim=128, group_size=64), 8, {"num_splits": 5}),  # two channel groups, 8 rows
    (foscar.KVFormat(bits=4, head_dim=64, group_size=64), 2, {"num_splits": 7, "ctas_per_sm": 1}),
    (foscar.KVFormat.fp4("mxfp4", 128), 2, {"num_splits": 4}),
])
def test_against_the_oracle_beside_the_two_launch_merge_gpu(monkeypatch, fmt, G, launch):
    from foscar.splitkv import _COUNTERS
    q, cache = _make(fmt, [1, 70, 1000, 3001], 2, G, seed=G)
    (out, lse), (out2, lse2) = _both(q, cache, monkeypatch, **launch)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all()), "unwritten or NaN rows"
    exact, lse_exact = foscar.decode_exact(q, cache, return_lse=True)
    base = rel(bf16_attention(q, cache), exact)
    assert rel(out, exact) <= 1.05 * base + 1e-4 and abs(rel(out, exact) - rel(out2, exact)) <= 0.05 * base
    assert float((lse.double() - lse_exact).abs().max()) <= 1e-2
    assert float((lse - lse2).abs().max()) <= 1e-5
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values()), "counters left at zero"


@pytest.mark.gpu
@gpu
def test_a_step_of_several_tokens_gpu(monkeypatch):
    q, cache = _make(FMT, [300, 1000], 2, 4, seed=5, T=2)
    for fused in _merge_switch(monkeypatch):
        out = foscar.decode(q, cache, backend="cute", num_splits=3)
        exact = foscar.decode_exact(q, cache)
        assert bool(torch.isfinite(out).all()) and rel(out, exact) <= 2e-2, fused


@pytest.mark.gpu
@gpu
def test_cuda_graph_replays_equal_eager_gpu(monkeypatch):
    from foscar.cute.launch import decode
    monkeypatch.setattr(config, "FUSED_MERGE", True)
    q, cache = _make(FMT, [5000, 700], 2, 4, seed=3)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    decode(q, cache, out=out, num_splits=4, warp_specialized=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        decode(q, cache, out=out, num_splits=4, warp_specialized=True)
    for _ in range(3):  # every replay finds its counters at zero
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, decode(q, cache, num_splits=4, warp_specialized=True))


@pytest.mark.gpu
@gpu
def test_a_nan_in_the_cache_gives_the_rows_the_two_launch_merge_gives_gpu(monkeypatch):
    q, cache = _make(FMT, [700, 300], 2, 4, seed=9)
    cache.k_params[int(cache.page_table.block_table[0, 3]), 1, 5, 0] = float("nan")
    (out, lse), (out2, lse2) = _both(q, cache, monkeypatch, num_splits=3)
    assert torch.equal(torch.isnan(out), torch.isnan(out2)) and torch.equal(torch.isnan(lse), torch.isnan(lse2))
    assert bool(torch.isnan(out[0, 4:]).all()) and bool(torch.isfinite(out[1]).all())
