"""The split rule, one definition (:func:`foscar.splitkv.split_ranges`) held against every place that
follows it: the folded spec deals its tiles with it, and each kernel's per-split partial LSEs are those of
exactly the quantized tokens the rule gives that split (float64 oracle over the dequantized cache).

On a CPU-only machine the Triton kernel runs under the interpreter; the CuTe kernels need an sm_90 GPU.
"""
from __future__ import annotations

import math

import pytest
import torch
from _cases import DEV, GPU, HOPPER
from hypothesis import given, settings
from hypothesis import strategies as st

import foscar
from foscar.splitkv import new_workspace, num_window_parts, split_ranges

LN2 = math.log(2.0)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 500), splits=st.integers(1, 70), run=st.sampled_from((1, 2)))
def test_split_ranges_cover_every_tile_once_in_contiguous_runs(n, splits, run):
    runs = split_ranges(n, splits, run)
    assert len(runs) == splits
    assert [t for r in runs for t in r] == list(range(n))
    per = -(-n // splits) if n else 0
    per = -(-per // run) * run
    assert all(len(r) <= per for r in runs) and all(r.step == 1 for r in runs)
    assert all(r.start % run == 0 for r in runs if len(r)), "every split starts at a multiple of the run"
    lens = [len(r) for r in runs]
    assert lens == sorted(lens, reverse=True), "full runs first, then the short and the empty ones"


def expected_split_lses(q, cache, tile: int, num_splits: int, run: int = 1) -> torch.Tensor:
    """Natural-log LSE of each split's quantized tokens, ``[B, Hq, num_splits]`` (-inf when empty), by the
    rule (splits in multiples of ``run`` tiles) and the float64 oracle."""
    B, Hq, D = q.shape
    Hkv = cache.num_kv_heads
    G = Hq // Hkv
    k, _ = cache.dequantize()
    n_sink, n_quant, _ = cache.split()
    out = torch.full((B, Hq, num_splits), -math.inf, dtype=torch.float64)
    for b in range(B):
        ns, nq = int(n_sink[b]), int(n_quant[b])
        kq = k[b, :, ns: ns + nq].cpu()  # [Hkv, nq, D]
        qb = q[b].double().cpu().reshape(Hkv, G, D)
        for s, tiles in enumerate(split_ranges(-(-nq // tile), num_splits, run)):
            lo, hi = tiles.start * tile, min(tiles.stop * tile, nq)
            if hi > lo:
                scores = torch.einsum("hgd,hnd->hgn", qb, kq[:, lo:hi]) / math.sqrt(D)
                out[b, :, s] = torch.logsumexp(scores, -1).reshape(Hq)
    return out


def make_case(fmt, lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    L = max(lens)
    k = torch.randn(len(lens), 2, L, fmt.head_dim, generator=gen).bfloat16().float()
    v = torch.randn(len(lens), 2, L, fmt.head_dim, generator=gen).bfloat16().float()
    cache = foscar.quantize_kv(k, v, fmt, seq_lens=torch.tensor(lens), page_size=64)
    q = torch.randn(len(lens), 8, fmt.head_dim, generator=gen).bfloat16()
    if GPU:
        from foscar.bench import cache_to
        cache, q = cache_to(cache, DEV), q.to(DEV)
    return q, cache


def assert_lses(got_base2: torch.Tensor, want: torch.Tensor) -> None:
    got = got_base2.double().cpu() * LN2
    empty = want == -math.inf
    assert torch.equal(got == -math.inf, empty), "a split empty in one and not the other: different split rules"
    assert float((got[~empty] - want[~empty]).abs().max()) < 2e-2


@pytest.mark.parametrize("num_splits", [1, 3, 7])
@pytest.mark.parametrize("block_n", [32, 64])
def test_the_triton_splits_follow_the_rule(num_splits, block_n):
    import foscar.triton as ft
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64, sink=2, recent=3)
    q, cache = make_case(fmt, [400, 70, 5])
    parts = num_splits + num_window_parts(fmt)
    ws = new_workspace(3, 8, 2, parts, 64, q.device)
    ft.decode(q, cache, num_splits=num_splits, block_n=block_n, fused_combine=False, workspace=ws)
    assert_lses(ws[1][:, :, :num_splits], expected_split_lses(q, cache, block_n, num_splits))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("num_splits", [1, 3, 7])
@pytest.mark.parametrize("ws", [False, True], ids=["v0", "v1"])
@pytest.mark.parametrize("k_axis", ["token", "channel"])
def test_the_cute_splits_follow_the_rule(num_splits, ws, k_axis):
    """v0 writes one partial per split; v1 one per split and consumer warpgroup (``split * CONSUMERS + c``),
    merged here by LSE; v1 with channel-wise K of two-tile token groups in splits of whole runs of two tiles."""
    from foscar.cute import launch
    from foscar.cute.config import config_for
    from foscar.cute.decode_sm90 import CONSUMERS, TILE
    fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128, sink=2, recent=3, k_axis=k_axis)
    run = config_for(fmt, 4, 64).tile_run if ws else 1
    assert run == (2 if ws and k_axis == "channel" else 1)
    q, cache = make_case(fmt, [1000, 130, 5])
    parts = launch.num_parts(fmt, num_splits, ws)
    work = new_workspace(3, 8, 2, parts, 128, q.device)
    launch.decode(q, cache, num_splits=num_splits, warp_specialized=ws, workspace=work)
    lse = work[1][:, :, : (CONSUMERS if ws else 1) * num_splits]  # the splits' partials (the windows' follow, if any)
    if ws:  # base 2: log2 sum 2^l over the consumers of each split
        lse = torch.logsumexp(lse.reshape(3, 8, num_splits, CONSUMERS) * LN2, -1) / LN2
    assert_lses(lse, expected_split_lses(q, cache, TILE, num_splits, run))


def test_split_ranges_and_the_registry_name_bad_arguments():
    from foscar import backends
    from foscar.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="^num_splits: expected"):
        split_ranges(10, 0)
    with pytest.raises(InvalidArgumentError, match="^n_tiles: expected"):
        split_ranges(-1, 2)
    with pytest.raises(InvalidArgumentError, match="^backend: expected one of"):
        backends.get("cuda")
