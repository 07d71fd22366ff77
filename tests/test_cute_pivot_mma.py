"""Token-wise V's pivot sums by the tensor core (``foscar.cute.config.PIVOT_MMA_COLS``, ``Sm90Config.pivot_mma``):
``sum_t c_h P'`` of each column from one more m64 block of V^T whose row 0 holds each token half's pivot, joined to
the gathered offset corrections at the split's end, where each element converted its FP16 ``P'`` and took an FMA.
CPU: which configurations take it; ptxas keeps the kernel's wgmma pipelined (two copies of one register in a wgmma's
A, or an accumulator reset in a branch of the tile loop, serialize every wgmma) and spills nothing at 32 columns.
GPU (sm_90): GQA 16 and 32 and steps of 4 and 8 tokens (a step of 32 columns on three consumers and on two) against
the float64 oracle, with the other switches of 16 and 32 columns (stacked terms, one Q scale, the masks' branch, P^T
column-major)."""
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER  # noqa: E402
from _helpers import assert_pipelined_without_spills, cute_switches  # noqa: E402
from foscar.cute.config import config_for  # noqa: E402

WITH = {"STACKED_TERMS": True, "SHARED_Q_SCALE": True, "MASK_BRANCH": True, "P_COLUMN_MAJOR_COLS": (16, 32)}


@pytest.mark.parametrize("fmt_kw,gqa,step,taken", [
    ({}, 32, 1, True), ({}, 4, 8, True), ({}, 16, 1, True), ({}, 4, 1, False), ({"v_axis": "channel"}, 32, 1, False),
    ({"group_size": 64}, 32, 1, False)])
def test_the_pivot_sums_take_16_and_32_columns_of_token_wise_v(monkeypatch, fmt_kw, gqa, step, taken):
    fmt = foscar.KVFormat(**{"bits": 2, "head_dim": 128, "group_size": 128, **fmt_kw})
    tiles = 2 if gqa * step <= 4 else 1
    assert not config_for(fmt, gqa, 64, "e4m3", tiles, step).pivot_mma  # none by default
    with cute_switches(monkeypatch, PIVOT_MMA_COLS=(16, 32)):
        assert config_for(fmt, gqa, 64, "e4m3", tiles, step).pivot_mma is taken


@pytest.mark.parametrize("bits", (2, 4))
def test_the_kernel_keeps_its_wgmma_pipelined(monkeypatch, bits):
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, PIVOT_MMA_COLS=(32,), **WITH):
        cfg = config_for(fmt, 32, 64, "e4m3", 1)
        assert cfg.pivot_mma
        assert_pipelined_without_spills(cfg, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("gqa,lens,num_splits,fmt_kw", [
    (32, [8192, 700, 1], 16, {}), (32, [4097, 63, 130], 5, {}), (32, [3000, 5], None, {"sink": 4, "recent": 100}),
    (16, [1000, 64], 3, {}), (32, [2000, 77], 4, {"head_dim": 64, "group_size": 64})])
def test_heads_with_the_pivot_sums_against_the_oracle_gpu(monkeypatch, bits, gqa, lens, num_splits, fmt_kw):
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    with cute_switches(monkeypatch, PIVOT_MMA_COLS=(16, 32), **WITH):
        cute_against_the_oracle(fmt, lens, gqa, f"GQA {gqa}, pivot sums by the MMA: error", num_splits=num_splits,
                                   warp_specialized=True, ctas_per_sm=1, k_operand="e4m3", tiles_per_pass=1)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("G,T,num_splits", [(4, 8, None), (4, 8, 64), (8, 4, 5)])
@pytest.mark.parametrize("wide", ((32,), ()), ids=("three_consumers", "two_consumers"))
def test_steps_with_the_pivot_sums_against_the_oracle_gpu(monkeypatch, bits, G, T, num_splits, wide):
    from _cases import cute_step_against_the_oracle
    with cute_switches(monkeypatch, PIVOT_MMA_COLS=(32,), WIDE_STEP_COLUMNS=wide, **WITH):
        cute_step_against_the_oracle(bits, G, T, num_splits, {})
