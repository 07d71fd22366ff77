"""P^T column-major in shared memory (``foscar.cute.config.P_COLUMN_MAJOR_COLS``: 16 and 32 columns as shipped;
``Sm90Config.p_column_major``): a thread's two columns of a token go in one 32-bit store. CPU: every P buffer kind compiles for sm_90a with its
16-bit stores paired and the same wgmma. GPU (sm_90): against the float64 oracle, no worse than BF16
attention on the same dequantized cache."""
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER  # noqa: E402
from _helpers import cute_switches  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402
from foscar.cute.config import OWN_WGMMA_BITS, config_for  # noqa: E402

STORES = re.compile(r"st\.shared\.(b16|b32)\b")
WGMMA = re.compile(r"wgmma\.mma_async\S*")


def _stores(ptx: str) -> dict:
    found = STORES.findall(ptx)
    return {w: found.count(w) for w in ("b16", "b32")}


@pytest.mark.parametrize("bits,gqa,k_operand,tiles,fmt_kw,ws,ctas", [
    (2, 4, "e4m3", 2, {}, True, 2),  # two tiles a pass: 8 columns
    (4, 16, "e4m3", 1, {}, True, 2),  # 16 columns
    (2, 32, "e4m3", 1, {}, True, 1),  # 32 columns
    (4, 8, "bf16", 1, {"v_axis": "channel"}, True, 2),  # channel-wise V's P~ (folds.publish_p)
    (2, 4, "bf16", 1, {}, False, 1)])  # v0
def test_column_major_p_compiles_for_sm90a(monkeypatch, bits, gqa, k_operand, tiles, fmt_kw, ws, ctas):
    """Column-major P^T: one 32-bit shared-memory store for every two 16-bit stores of P in the row-major layout,
    the same wgmma instructions."""
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    ptx = {}
    for on in (False, True):
        with cute_switches(monkeypatch, P_COLUMN_MAJOR_COLS=(8, 16, 32) if on else ()):
            cfg = config_for(fmt, gqa, 64, k_operand, tiles)
            assert cfg.p_column_major is on
            if tiles == 2:  # 8 columns' MN-major atom is not the own wgmma's (it crashed on an H100): the tiled MMA
                assert cfg.own_wgmma == (not on and bits in OWN_WGMMA_BITS)
            ptx[on] = compile_stage1(cfg, keep_ptx=True, warp_specialized=ws, ctas_per_sm=ctas).__ptx__
    rows, cols = _stores(ptx[False]), _stores(ptx[True])
    assert rows["b16"] - cols["b16"] == 2 * (cols["b32"] - rows["b32"]) > 0  # each two of P's stores one
    assert sorted(WGMMA.findall(ptx[True])) == sorted(WGMMA.findall(ptx[False]))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,fmt_kw,launch", [
    ([8192, 4001, 129, 1], 4, None, {}, {"warp_specialized": False}),
    ([5000, 700, 130], 4, None, {}, {"warp_specialized": True, "k_operand": "e4m3", "tiles_per_pass": 2}),
    ([3000, 5], 4, 3, {"sink": 4, "recent": 100}, {"warp_specialized": True, "tiles_per_pass": 1}),
    ([5000, 700, 130], 8, None, {"v_axis": "channel"}, {"warp_specialized": True}),
    ([3000, 64], 16, 3, {}, {"warp_specialized": True, "k_operand": "e4m3"}),
    ([2000, 33], 32, 2, {}, {"warp_specialized": True, "ctas_per_sm": 1})])
def test_column_major_p_against_the_oracle_gpu(monkeypatch, bits, lens, G, num_splits, fmt_kw, launch):
    """Column-major P^T (v0; two tiles a pass; windows; channel-wise V; 16 and 32 columns): every element
    against the float64 oracle within the kernels' bound, LSE within 1e-2."""
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    with cute_switches(monkeypatch, P_COLUMN_MAJOR_COLS=(8, 16, 32)):
        cute_against_the_oracle(fmt, lens, G, "column-major P: error", num_splits=num_splits, **launch)
