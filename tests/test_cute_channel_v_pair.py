"""Channel-wise V on two tiles of one token group a pass (``foscar.cute.config.PAIR_CHANNEL_V``): the pass's
``P~`` of both tiles published once, both tiles' PV products in one partial, one acc-fold a pass
(``foscar.cute.pair.pair_step``). CPU: refused while the switch is off and where a pass would span two token
groups; with it, v1 compiles for sm_90a with both tiles' QK products and PV chains, no local memory, with either K
axis (channel-wise K on E4M3 terms, its ``Q'`` folded by the consumer or the producer). GPU (sm_90): decodes
against the float64 oracle."""
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER, sum_block_mmas  # noqa: E402
from _helpers import cute_switches  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402
from foscar.cute.config import config_for  # noqa: E402
from foscar.errors import UnsupportedError  # noqa: E402

QK_E4M3 = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n8k32\.f32\.e4m3\.e4m3")
PV_F16 = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n8k16\.f32\.f16\.f16")
K_AXES = [("token", False), ("channel", False), ("channel", True)]  # (K axis, the producer folds Q')
K_IDS = ("token_k", "channel_k", "channel_k_producer_fold")


@pytest.fixture(params=K_AXES, ids=K_IDS)
def k_axis(monkeypatch, request):
    """The K axis with the switches it takes: channel-wise K on E4M3 terms (``CHANNEL_K_E4M3``), its ``Q'``
    folded by each consumer or by the producer (``PRODUCER_Q_FOLD``)."""
    axis, producer = request.param
    with cute_switches(monkeypatch, PAIR_CHANNEL_V=True, CHANNEL_K_E4M3=axis == "channel",
                       PRODUCER_Q_FOLD=producer):
        yield axis


def test_refused_while_the_switch_is_off(monkeypatch):
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128, v_axis="channel")
    with cute_switches(monkeypatch, PAIR_CHANNEL_V=False):
        with pytest.raises(UnsupportedError, match="PAIR_CHANNEL_V"):
            config_for(fmt, 4, 64, "e4m3", 2)


def test_a_pass_stays_within_one_token_group(k_axis):
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=64, k_axis=k_axis, v_axis="channel")
    with pytest.raises(UnsupportedError, match="token groups of two tiles or more"):
        config_for(fmt, 4, 64, "e4m3", 2)
    cfg = config_for(foscar.KVFormat(bits=2, head_dim=128, group_size=128, k_axis=k_axis, v_axis="channel"), 4, 64,
                     "e4m3", 2)
    assert cfg.tile_run == 2 and cfg.lazy_rescale and cfg.v_channel
    from foscar.cute.launch import default_variant  # an untuned launch takes the pass
    assert default_variant(foscar.KVFormat(bits=4, head_dim=128, group_size=128, k_axis=k_axis, v_axis="channel"), 2,
                           64) == ("e4m3", 2)


@pytest.mark.parametrize("bits,gqa", [(2, 4), (4, 3), (2, 1)])
def test_compiles_for_sm90a(k_axis, bits, gqa):
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis=k_axis, v_axis="channel")
    cfg = config_for(fmt, gqa, 64, "e4m3", 2)
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__
    assert len(QK_E4M3.findall(ptx)) == 2 * 128 // 32  # one code path for both consumers: both tiles' QK products
    # both tiles' PV chains (two m64 blocks of the head dim), and the column sums' block
    assert len(PV_F16.findall(ptx)) == 2 * 2 * 64 // 16 + sum_block_mmas(cfg)
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,fmt_kw,ctas", [
    ([5000, 700, 130], 4, None, {}, 2), ([700, 129, 1], 4, 7, {}, 2), ([2000, 3], 4, 3, {"sink": 2, "recent": 7}, 2),
    ([3000, 900], 1, 2, {}, 1)])
def test_against_the_oracle_gpu(k_axis, bits, lens, G, num_splits, fmt_kw, ctas):
    """Lengths past, at and short of a pass, splits of a tile or two, windows, one head at one CTA an SM (three
    kernels a bit width and K variant)."""
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, k_axis=k_axis, v_axis="channel", **{"head_dim": 128, "group_size": 128,
                                                                         **fmt_kw})
    cute_against_the_oracle(fmt, lens, G, f"channel-wise V, {k_axis}-wise K, two tiles a pass: error",
                               num_splits=num_splits, warp_specialized=True, k_operand="e4m3", tiles_per_pass=2,
                               ctas_per_sm=ctas)
