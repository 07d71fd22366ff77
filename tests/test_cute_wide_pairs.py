"""Three consumer warpgroups for two tiles a pass (``foscar.cute.config.WIDE_PAIRS``, ``Sm90Config.wide``): at one
CTA an SM, token-wise K and V, consumer ``c`` takes the split's tiles ``c + 6 j`` and ``c + 6 j + 3`` as its
``j``-th pass (``foscar.cute.ring.pass_tiles``), twelve consumer warps of 160 registers. CPU: which configurations
take it, the partials a split writes, and that ptxas keeps the kernel's wgmma pipelined without a spill. GPU
(sm_90): INT2 and INT4, E4M3 and BF16 K, against the float64 oracle at lengths whose last pass lacks tile B in
some consumers and not others, a split of fewer tiles than consumers, windows, a rotated cache, CUDA-graph replay."""
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _helpers import cute_switches  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402
from foscar.cute.config import config_for, consumers_for  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("fmt_kw,gqa,tiles,taken", [
    ({}, 4, 2, True), ({}, 1, 2, True), ({}, 4, 1, False), ({}, 8, 1, False), ({"v_axis": "channel"}, 4, 1, False),
    ({"group_size": 64}, 4, 2, True)])
def test_three_consumers_take_two_tile_passes_of_token_wise_k_and_v(monkeypatch, fmt_kw, gqa, tiles, taken):
    from foscar.cute.launch import split_partials
    fmt = foscar.KVFormat(**{"bits": 2, "head_dim": 128, "group_size": 128, **fmt_kw})
    assert not config_for(fmt, gqa, 64, "e4m3", tiles).wide  # off by default
    with cute_switches(monkeypatch, WIDE_PAIRS=True):
        cfg = config_for(fmt, gqa, 64, "e4m3", tiles)
        assert cfg.wide is taken
        assert consumers_for(cfg, 1) == (3 if taken else 2) and consumers_for(cfg, 2) == 2
        launch = {"warp_specialized": True, "ctas_per_sm": 1, "k_operand": "e4m3", "tiles_per_pass": tiles}
        assert split_partials(fmt, gqa, 64, 1, launch) == consumers_for(cfg, 1)


@pytest.mark.parametrize("bits,k_operand", [(2, "e4m3"), (4, "e4m3"), (4, "bf16")])
def test_the_kernel_keeps_its_wgmma_pipelined_and_spills_nothing(monkeypatch, bits, k_operand):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from ptxas_info import ptxas_report
    finally:
        sys.path.pop(0)
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, WIDE_PAIRS=True):
        cfg = config_for(fmt, 4, 64, k_operand, 2)
        assert cfg.wide
        report = ptxas_report(compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=1).__ptx__)
    assert "serialized" not in report and "0 bytes spill stores, 0 bytes spill loads" in report


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("G,lens,num_splits,fmt_kw,k_operand", [
    # 8192 tokens, 16 splits: 8 tiles a split (consumer 2's one pass lacks tile B); 700: 11 tiles; 1 token
    (4, [8192, 700, 1], 16, {}, "e4m3"),
    (4, [4097, 63, 130], 5, {}, "e4m3"),  # a last tile of one token; splits of 1-13 tiles
    (4, [3000, 5], None, {"sink": 4, "recent": 100}, "e4m3"),
    (2, [1000, 64 * 6, 64 * 7], 1, {}, "e4m3"),  # one split: 16, 6 and 7 tiles, every consumer's passes
    (1, [5000, 333], 3, {"rotation": "hadamard"}, "e4m3"),
    (4, [2000, 77], 4, {"group_size": 64}, "bf16"),
    (4, [6000, 129], 7, {}, "bf16")])
def test_three_consumer_passes_against_the_oracle_gpu(monkeypatch, bits, G, lens, num_splits, fmt_kw, k_operand):
    from test_cute_decode import _decode_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    with cute_switches(monkeypatch, WIDE_PAIRS=True):
        _decode_against_the_oracle(fmt, lens, G, f"GQA {G}, three consumers a pass of two tiles: error",
                                   num_splits=num_splits, warp_specialized=True, ctas_per_sm=1, k_operand=k_operand,
                                   tiles_per_pass=2)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
def test_three_consumer_passes_replay_in_a_graph_gpu(monkeypatch):
    """A CUDA-graph replay of the launch (its workspace given: nothing allocated) equals its eager call bit for
    bit."""
    from test_triton import make

    from foscar.bench import as_graph
    from foscar.cute.launch import decode, num_parts
    from foscar.splitkv import new_workspace
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, WIDE_PAIRS=True):
        q, cache = make(fmt, [4000, 900, 17], Hkv=2, G=4, page=64, seed=3)
        launch = dict(num_splits=6, warp_specialized=True, ctas_per_sm=1, k_operand="e4m3", tiles_per_pass=2)
        ws = new_workspace(3, 8, 2, num_parts(fmt, 6, True, 3), 128, q.device)
        out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
        decode(q, cache, out=out, workspace=ws, **launch)
        again = torch.full_like(out, float("nan"))
        replay = as_graph(lambda: decode(q, cache, out=again, workspace=ws, **launch))
        replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.equal(again, out)


def test_the_sweeps_wide_variant_sets_the_switch_for_its_call_only():
    """``benchmarks/sweep_cute.py``'s ``v1w``: the switch set (and the configs of the other setting forgotten) for
    the launch, the shipped setting back after it, an error too."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from sweep_cute import with_wide_pairs
    finally:
        sys.path.pop(0)
    import foscar.cute.config as cfg_mod
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    seen = []
    with_wide_pairs(lambda: seen.append(config_for(fmt, 4, 64, "e4m3", 2).wide))()
    assert seen == [True] and not cfg_mod.WIDE_PAIRS and not config_for(fmt, 4, 64, "e4m3", 2).wide

    def fails():
        raise RuntimeError("launch")
    with pytest.raises(RuntimeError):
        with_wide_pairs(fails)()
    assert not cfg_mod.WIDE_PAIRS and not config_for(fmt, 4, 64, "e4m3", 2).wide
