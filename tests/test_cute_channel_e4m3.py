"""Channel-wise K with E4M3 K operands (``foscar.cute.config.CHANNEL_K_E4M3``): each token group's ``Q' = Q s'``
folded into two E4M3 terms (``foscar.cute.folds.fold_q_terms``). CPU: refused while the switch is off; with it,
v1 compiles for sm_90a with the E4M3 QK product and no BF16 one, no local memory; v0 refuses it; the fold's
contraction index is the inverse of the fragment's order. GPU (sm_90): decodes against the float64 oracle."""
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _helpers import cute_switches  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402
from foscar.cute.config import config_for, consumer_code_paths  # noqa: E402
from foscar.errors import UnsupportedError  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
E4M3_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n8k32\.f32\.e4m3\.e4m3")


@pytest.fixture
def switch(monkeypatch):
    with cute_switches(monkeypatch, CHANNEL_K_E4M3=True):
        yield


def test_refused_while_the_switch_is_off():
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128, k_axis="channel")
    with pytest.raises(UnsupportedError, match="CHANNEL_K_E4M3"):
        config_for(fmt, 4, 64, "e4m3")


def test_the_fold_writes_each_channel_at_its_contraction_index():
    from foscar.cute.operands_e4m3 import contraction_index
    from foscar.e4m3 import contraction_order
    for bits in (2, 4):
        for D in (64, 128):
            order = contraction_order(bits, D).tolist()
            assert [contraction_index(bits, order[k]) for k in range(D)] == list(range(D))


@pytest.mark.parametrize("bits,head_dim,group_size,gqa,v_axis", [
    (2, 128, 128, 4, "token"), (4, 128, 128, 3, "channel"), (2, 64, 64, 1, "token")])
def test_compiles_for_sm90a(switch, bits, head_dim, group_size, gqa, v_axis):
    fmt = foscar.KVFormat(bits=bits, head_dim=head_dim, group_size=group_size, k_axis="channel", v_axis=v_axis)
    cfg = config_for(fmt, gqa, 64, "e4m3")
    assert cfg.k_e4m3 and cfg.k_channel and not cfg.q_as_terms
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__
    copies = consumer_code_paths(cfg, 2)  # one chain per copy of the consumers' code
    assert len(E4M3_WGMMA.findall(ptx)) == copies * head_dim // 32
    assert not re.search(r"m64n8k16\.f32\.bf16", ptx), "no BF16 QK product left"
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"
    with pytest.raises(ValueError, match="v0"):
        compile_stage1(cfg, warp_specialized=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,fmt_kw", [
    ([5000, 700, 130], 4, None, {}), ([3000, 900], 1, 2, {"v_axis": "channel"}),
    ([2500, 64], 2, None, {"v_axis": "channel", "group_size": 64}), ([2000, 3], 4, 3, {"sink": 2, "recent": 7}),
    ([1500, 90], 3, 2, {"group_size": 64, "head_dim": 64}), ([4000, 260], 4, None, {"group_size": 256, "v_axis": "channel"})])
def test_against_the_oracle_gpu(switch, bits, lens, G, num_splits, fmt_kw):
    from test_cute_decode import _decode_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, k_axis="channel", **{"head_dim": 128, "group_size": 128, **fmt_kw})
    _decode_against_the_oracle(fmt, lens, G, "channel-wise K, E4M3 terms of Q': error", num_splits=num_splits,
                               warp_specialized=True, k_operand="e4m3")
