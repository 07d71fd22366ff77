"""Three consumer warpgroups at 8 columns (``foscar.cute.config.WIDE_EIGHT_COLUMNS``, ``Sm90Config.wide``): at one
CTA an SM, twelve consumer warps of 160 registers; one tile a pass (each consumer every third tile), or two tiles a
pass of token-wise K and V (consumer ``c``'s ``j``-th pass the split's tiles ``c + 6 j`` and ``c + 6 j + 3``:
``foscar.cute.ring.pass_tiles``). CPU: which configurations take it, the partials a split writes, and that ptxas
keeps the kernel's wgmma pipelined without a spill. GPU (sm_90): INT2 and INT4, E4M3 and BF16 K, against the float64
oracle at lengths whose last pass lacks tile B in some consumers and not others, a split of fewer tiles than
consumers, windows, a rotated cache, GQA 8, channel-wise V, steps of 2 tokens; CUDA-graph replay."""
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER  # noqa: E402
from _helpers import assert_pipelined_without_spills, cute_switches  # noqa: E402
from foscar.cute.config import config_for, consumers_for  # noqa: E402


@pytest.mark.parametrize("fmt_kw,gqa,step,tiles,taken", [
    ({}, 4, 1, 2, True), ({}, 1, 1, 2, True), ({}, 4, 1, 1, True), ({}, 8, 1, 1, True), ({}, 4, 2, 1, True),
    ({"v_axis": "channel"}, 4, 1, 1, True), ({"group_size": 64}, 4, 1, 2, True), ({}, 16, 1, 1, False),
    ({"k_axis": "channel"}, 4, 1, 1, False), ({"k_axis": "channel", "group_size": 64}, 4, 1, 1, True)])
def test_three_consumers_take_eight_columns(monkeypatch, fmt_kw, gqa, step, tiles, taken):
    from foscar.cute.launch import split_partials
    fmt = foscar.KVFormat(**{"bits": 2, "head_dim": 128, "group_size": 128, **fmt_kw})
    k_operand = "bf16" if fmt.k_axis == "channel" else "e4m3"
    assert not config_for(fmt, gqa, 64, k_operand, tiles, step).wide  # off by default
    with cute_switches(monkeypatch, WIDE_EIGHT_COLUMNS=True):
        cfg = config_for(fmt, gqa, 64, k_operand, tiles, step)
        assert cfg.wide is taken
        assert consumers_for(cfg, 1) == (3 if taken else 2) and consumers_for(cfg, 2) == 2
        launch = {"warp_specialized": True, "ctas_per_sm": 1, "k_operand": k_operand, "tiles_per_pass": tiles}
        assert split_partials(fmt, gqa, 64, step, launch) == consumers_for(cfg, 1)


@pytest.mark.parametrize("bits,gqa,step,tiles,k_operand", [
    (2, 4, 1, 2, "e4m3"), (4, 4, 1, 2, "e4m3"), (4, 4, 1, 2, "bf16"), (2, 8, 1, 1, "e4m3"), (4, 4, 2, 1, "e4m3")])
def test_the_kernel_keeps_its_wgmma_pipelined_and_spills_nothing(monkeypatch, bits, gqa, step, tiles, k_operand):
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, WIDE_EIGHT_COLUMNS=True, MASK_BRANCH=step > 1):
        cfg = config_for(fmt, gqa, 64, k_operand, tiles, step)
        assert cfg.wide
        assert_pipelined_without_spills(cfg, 1)


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
@pytest.mark.parametrize("tiles", (2, 1))
def test_three_consumers_against_the_oracle_gpu(monkeypatch, bits, G, lens, num_splits, fmt_kw, k_operand, tiles):
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    with cute_switches(monkeypatch, WIDE_EIGHT_COLUMNS=True):
        cute_against_the_oracle(fmt, lens, G, f"GQA {G}, three consumers, {tiles} tile(s) a pass: error",
                                   num_splits=num_splits, warp_specialized=True, ctas_per_sm=1, k_operand=k_operand,
                                   tiles_per_pass=tiles)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("G,lens,num_splits,fmt_kw", [
    (8, [8192, 700, 1], 16, {}), (8, [3000, 5], None, {"sink": 4, "recent": 100}),
    (8, [2500, 64], 3, {"v_axis": "channel"}), (6, [1500, 90], 2, {"group_size": 64})])
def test_three_consumers_of_eight_query_heads_against_the_oracle_gpu(monkeypatch, bits, G, lens, num_splits, fmt_kw):
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    with cute_switches(monkeypatch, WIDE_EIGHT_COLUMNS=True):
        cute_against_the_oracle(fmt, lens, G, f"GQA {G}, three consumers: error", num_splits=num_splits,
                                   warp_specialized=True, ctas_per_sm=1, k_operand="e4m3", tiles_per_pass=1)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("G,T,num_splits", [(4, 2, None), (4, 2, 64), (2, 4, 5)])
def test_steps_of_eight_rows_with_three_consumers_against_the_oracle_gpu(monkeypatch, bits, G, T, num_splits):
    """A step's 8 rows at one CTA an SM (``TWO_CTA_COLUMNS`` without 8), the masks in a branch."""
    from _cases import cute_step_against_the_oracle
    with cute_switches(monkeypatch, WIDE_EIGHT_COLUMNS=True, MASK_BRANCH=True, TWO_CTA_COLUMNS=(16,)):
        cute_step_against_the_oracle(bits, G, T, num_splits, {})


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
def test_three_consumer_passes_replay_in_a_graph_gpu(monkeypatch):
    """A CUDA-graph replay of the launch (its workspace given: nothing allocated) equals its eager call bit for
    bit."""
    from _cases import make

    from foscar.bench import as_graph
    from foscar.cute.launch import decode, num_parts
    from foscar.splitkv import new_workspace
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, WIDE_EIGHT_COLUMNS=True):
        q, cache = make(fmt, [4000, 900, 17], Hkv=2, G=4, page=64, seed=3)
        launch = {"num_splits": 6, "warp_specialized": True, "ctas_per_sm": 1, "k_operand": "e4m3", "tiles_per_pass": 2}
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
        from sweep_cute import with_wide_eight
    finally:
        sys.path.pop(0)
    import foscar.cute.config as cfg_mod
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    seen = []
    with_wide_eight(lambda: seen.append(config_for(fmt, 4, 64, "e4m3", 2).wide))()
    assert seen == [True] and not cfg_mod.WIDE_EIGHT_COLUMNS and not config_for(fmt, 4, 64, "e4m3", 2).wide

    def fails():
        raise RuntimeError("launch")
    with pytest.raises(RuntimeError):
        with_wide_eight(fails)()
    assert not cfg_mod.WIDE_EIGHT_COLUMNS and not config_for(fmt, 4, 64, "e4m3", 2).wide
