"""Each QK accumulator's first MMA overwriting it (``foscar.cute.config.QK_OVERWRITE``, ``Sm90Config.qk_overwrite``)
where several are in flight at once: a pass's two tiles, two channel groups' partials, INT4's promoted k-steps.
Zero-filled, those accumulators share one zero register and ptxas waits for each chain before the next. CPU: the
switch takes every injected wait out of such kernels (ptxas, sm_90a), leaves the wgmma instructions as they were
and a kernel of one accumulator unchanged. GPU (sm_90): against the float64 oracle, no worse than BF16 attention on
the same dequantized cache."""
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _helpers import cute_switches  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402
from foscar.cute.config import config_for  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
WGMMA = re.compile(r"wgmma\.mma_async\S*")


def _ptx(monkeypatch, fmt, gqa, k_operand, tiles, ctas, on: bool):
    with cute_switches(monkeypatch, QK_OVERWRITE=on):
        cfg = config_for(fmt, gqa, 64, k_operand, tiles)
        assert cfg.qk_overwrite is on
        return cfg, compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=ctas).__ptx__


def _injected_waits(ptx: str) -> int:
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from ptxas_info import ptxas_report
    finally:
        sys.path.pop(0)
    return len(re.findall(r"\(C7517\) wgmma\.wait_group is injected", ptxas_report(ptx)))


@pytest.mark.parametrize("bits,fmt_kw,k_operand,tiles,ctas", [
    (2, {}, "e4m3", 2, 2),  # a pass's two tiles
    (2, {"gqa": 1}, "e4m3", 2, 2),  # one query row: the terms in columns 0 and 1
    (4, {}, "e4m3", 2, 2),  # two tiles, each with INT4's promoted k-steps
    (4, {"group_size": 64}, "bf16", 1, 2),  # two channel groups' partials
    (4, {"head_dim": 256}, "bf16", 1, 1)])  # head dim 256: two channel groups of 128
def test_overwriting_first_mmas_take_out_the_injected_waits(monkeypatch, bits, fmt_kw, k_operand, tiles, ctas):
    fmt_kw = dict(fmt_kw)
    gqa = fmt_kw.pop("gqa", 4)
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    off_cfg, off = _ptx(monkeypatch, fmt, gqa, k_operand, tiles, ctas, False)
    on_cfg, on = _ptx(monkeypatch, fmt, gqa, k_operand, tiles, ctas, True)
    assert on_cfg.qk_overwrites and not off_cfg.qk_overwrites
    assert sorted(WGMMA.findall(on)) == sorted(WGMMA.findall(off))
    assert _injected_waits(off) > 0 and _injected_waits(on) == 0


def test_one_accumulator_compiles_as_before(monkeypatch):
    """One QK accumulator (one tile a pass, one channel group, no promotion): the switch changes nothing."""
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    _, off = _ptx(monkeypatch, fmt, 8, "e4m3", 1, 2, False)
    on_cfg, on = _ptx(monkeypatch, fmt, 8, "e4m3", 1, 2, True)
    assert not on_cfg.qk_overwrites and on == off


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,fmt_kw,launch", [
    ([5000, 700, 130, 1], 4, None, {}, {"warp_specialized": True, "k_operand": "e4m3", "tiles_per_pass": 2}),
    ([3000, 130], 1, None, {}, {"warp_specialized": True, "k_operand": "e4m3", "tiles_per_pass": 2}),
    ([3000, 65], 4, 3, {}, {"warp_specialized": True, "k_operand": "bf16", "tiles_per_pass": 2, "ctas_per_sm": 1}),
    ([3000, 5], 4, 3, {"sink": 4, "recent": 100}, {"warp_specialized": True, "k_operand": "e4m3",
                                                  "tiles_per_pass": 2}),
    ([4100, 700], 4, None, {"v_axis": "channel"}, {"warp_specialized": True, "k_operand": "e4m3",
                                                   "tiles_per_pass": 1}),
    ([5000, 129], 4, None, {"group_size": 64}, {"warp_specialized": True, "tiles_per_pass": 1}),
    ([3000, 64], 4, 2, {"head_dim": 256}, {"warp_specialized": True, "ctas_per_sm": 1})])
def test_overwriting_first_mmas_against_the_oracle_gpu(monkeypatch, bits, lens, G, num_splits, fmt_kw, launch):
    """Two tiles a pass (E4M3 K with INT4's promoted steps, BF16 K, windows), channel-wise V (one tile a pass, INT4's
    promoted steps), two channel groups of 64 and head dim 256 with the switch on: every element against the float64
    oracle within the kernels' bound, LSE within 1e-2."""
    from test_cute_decode import _decode_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    with cute_switches(monkeypatch, QK_OVERWRITE=True):
        _decode_against_the_oracle(fmt, lens, G, "QK overwrite: error", num_splits=num_splits, **launch)
