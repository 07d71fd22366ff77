"""Token-wise V's pivot sums by the tensor core (``foscar.cute.config.PIVOT_MMA_COLS``, ``Sm90Config.pivot_mma``):
``sum_t c_h P'`` of each column from one more m64 block of V^T whose rows hold each token half's pivot, joined to the
gathered offset corrections at the split's end by the threads of row 0, where each element converted its FP16 ``P'``
and took an FMA. CPU: which configurations take it; the block's values sum ``c_h P'`` in every row and row 0's
threads hold every column once; ptxas keeps the kernel's wgmma pipelined (two copies of one register in a wgmma's A,
an accumulator reset in a branch of the tile loop, or the A constants materialized inside the MMA group serialize
every wgmma) and spills nothing at 32 columns (two consumers, and three on the own wgmma). GPU (sm_90): GQA 16 and 32
and steps of 4 and 8 tokens (a step of 32 columns on three consumers and on two) against the float64 oracle, with the
other switches of 16 and 32 columns (stacked terms, one Q scale, the masks' branch, P^T column-major)."""
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER  # noqa: E402
from _helpers import assert_pipelined_without_spills, cute_switches  # noqa: E402
from foscar.cute.config import config_for  # noqa: E402

WITH = {"STACKED_TERMS": True, "SHARED_Q_SCALE": True, "MASK_BRANCH": True, "P_COLUMN_MAJOR_COLS": (16, 32)}


@pytest.mark.parametrize("fmt_kw,gqa,step,taken", [
    ({}, 32, 1, True), ({}, 4, 8, True), ({}, 16, 1, True), ({}, 4, 1, False), ({"v_axis": "channel"}, 32, 1, False),
    ({"group_size": 64}, 32, 1, False), ({"bits": 4}, 32, 1, True), ({"bits": 4}, 4, 8, False)])
def test_the_pivot_sums_take_16_and_32_columns_of_token_wise_v(monkeypatch, fmt_kw, gqa, step, taken):
    """Token-wise V with groups of the head dim, 16 and 32 columns; three consumers (a step of 32 columns) on the own
    wgmma only (INT2; INT4's 160 registers spill with it)."""
    fmt = foscar.KVFormat(**{"bits": 2, "head_dim": 128, "group_size": 128, **fmt_kw})
    tiles = 2 if gqa * step <= 4 else 1
    assert not config_for(fmt, gqa, 64, "e4m3", tiles, step).pivot_mma  # none by default
    with cute_switches(monkeypatch, PIVOT_MMA_COLS=(16, 32)):
        assert config_for(fmt, gqa, 64, "e4m3", tiles, step).pivot_mma is taken


@pytest.mark.parametrize("bits,gqa,step", [(2, 32, 1), (4, 32, 1), (2, 4, 8)])
def test_the_kernel_keeps_its_wgmma_pipelined(monkeypatch, bits, gqa, step):
    """GQA 32 on two consumers and a step of 8 on three (the own wgmma): the block's A registers, constants, must
    not be materialized inside the MMA group (there ptxas serialized every wgmma of three consumers)."""
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, PIVOT_MMA_COLS=(32,), **WITH):
        cfg = config_for(fmt, gqa, 64, "e4m3", 1, step)
        assert cfg.pivot_mma and cfg.wide == (step > 1)
        assert_pipelined_without_spills(cfg, 1)


@pytest.mark.parametrize("bits", (2, 4))
def test_every_row_sums_the_pivots_and_row_0_joins_them(monkeypatch, bits):
    """The block's A values laid out as PTX's ``m64nNk16`` A fragment (``_helpers.block_a_matrix``), times an FP16
    ``P'``: every row ``row0`` is ``sum_t c_h P'`` exactly (rows + 8 half of it), so the threads of row 0 alone join
    them (warp 0's lanes 0-3, ``pivot_corrections``), each its column slots' elements: together every column of 32,
    once."""
    from _helpers import block_a_matrix
    from foscar.cute.fragment import slot_column, slot_elements
    from foscar.cute.pivot import sum_values
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, PIVOT_MMA_COLS=(32,), **WITH):
        cfg = config_for(fmt, 32, 64, "e4m3", 1)
    assert cfg.pivot_mma and len(set(sum_values(cfg))) == 4
    A = block_a_matrix(cfg)
    c = torch.tensor(cfg.v_pivots, dtype=torch.float64)[(torch.arange(16) >= 8).long()]  # each token's half
    gen = torch.Generator().manual_seed(bits)
    p = (torch.rand(16, 32, generator=gen, dtype=torch.float64) * 2 ** 12).to(torch.float16).double()  # P'
    got, want = A @ p, (c[:, None] * p).sum(0)
    row = torch.arange(64) % 16 < 8
    assert torch.equal(got[row], want.expand(int(row.sum()), 32))
    assert torch.equal(got[~row], (want / 2).expand(int((~row).sum()), 32))
    joined = sorted(slot_column(k, 2 * lane) for lane in range(4) for k in range(2 * cfg.nb))
    assert joined == list(range(32)) and all(slot_elements(k)[0] % 4 < 2 for k in range(2 * cfg.nb))


@pytest.mark.parametrize("gqa,step", [(32, 1), (4, 8)])
def test_the_blocks_wgmma_take_the_pivots(monkeypatch, gqa, step):
    """In the compiled kernel (GQA 32 on two consumers; a step of 8 on three, each consumer its own copy of the code,
    the own wgmma) every MMA of the extra block takes A registers holding ``(c_0, c_0 / 2, c_1, c_1 / 2)``, both
    halves of each register, and every consumer issues them (four a tile)."""
    from _helpers import constant_a_operands
    from foscar.cute.pivot import sum_values
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, PIVOT_MMA_COLS=(32,), **WITH):
        cfg = config_for(fmt, gqa, 64, "e4m3", 1, step)
        found = constant_a_operands(cfg, 1)
    assert found and all(a == list(sum_values(cfg)) for a in found), found
    assert len(found) == 4 * (3 if step > 1 else 2), len(found)


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
