"""Every kernel switch of ``foscar.cute.config.SWITCHES`` that is off, switched on together: the v1 kernels of the
formats and shapes they touch still compile for sm_90a (a GPU session runs them; a combination that no longer
compiles is found here first), each configuration taking the switches it applies to."""
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _helpers import cute_switches  # noqa: E402
from foscar.cute import config  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402

OFF = {name: True for name in config.SWITCHES if getattr(config, name) is False}
OFF["PIVOT_MMA_COLS"] = (16, 32)  # the column counts it may take
OFF["COLUMN_SUM_MMA_COLS"] = (8, 16, 32)
OFF["P_COLUMN_MAJOR_COLS"] = (8, 16, 32)  # 8 columns too
OFF["OVERLAP_COLS"] = (16, 32)
OFF["PAIR_P_SCALE_COLS"] = (8, 16, 32)  # P' scaled in FP16 pairs at 8 columns too


@pytest.mark.parametrize("fmt_kw,gqa,k_operand,tiles,step,ctas", [
    ({"bits": 2}, 4, "e4m3", 2, 1, 2),  # two tiles a pass, P^T column-major
    ({"bits": 4}, 4, "e4m3", 2, 1, 2),  # INT4's promoted k-steps
    ({"bits": 2, "k_axis": "channel"}, 4, "e4m3", 2, 1, 2),  # channel-wise K on E4M3 terms, the producer's fold
    ({"bits": 4, "k_axis": "channel", "v_axis": "channel"}, 4, "e4m3", 2, 1, 2),  # and channel-wise V's pass
    ({"bits": 2}, 32, "e4m3", 1, 1, 1),  # 32 columns: stacked terms, one scale, three consumers
    ({"bits": 4}, 4, "e4m3", 1, 4, 2),  # a step of 4 tokens: 16 columns
    ({"bits": 2, "sink": 4, "recent": 16, "rollback": 8}, 8, "e4m3", 1, 4, 1),  # a step over windows: 32 columns
    ({"scheme": "nvfp4"}, 4, "bf16", 2, 1, 2)])  # NVFP4, two tiles a pass
def test_the_pending_switches_together_compile(monkeypatch, fmt_kw, gqa, k_operand, tiles, step, ctas):
    assert config.START_PREFETCH
    fmt = (foscar.KVFormat.fp4(fmt_kw["scheme"], 128) if "scheme" in fmt_kw
           else foscar.KVFormat(head_dim=128, group_size=128, **fmt_kw))
    with cute_switches(monkeypatch, **OFF):
        cfg = config.config_for(fmt, gqa, 64, k_operand, tiles, step)
        assert cfg.start_prefetch and cfg.p_column_major and cfg.pair_p_scale == (fmt.v_axis == "token")
        assert cfg.pair_vote == (cfg.pair_p_scale and cfg.lazy_rescale)
        assert cfg.stacked_terms == cfg.shared_q_scale == (gqa * step > config.HEADS)
        assert cfg.pivot_mma == (cfg.cols > config.HEADS and fmt.v_axis == "token" and cfg.vc == 1
                                 and (not cfg.wide or fmt.bits in config.OWN_WGMMA_BITS))  # three: own wgmma
        assert cfg.column_sum_mma == (fmt.v_axis == "channel")
        compile_stage1(cfg, warp_specialized=True, ctas_per_sm=ctas)


def test_the_pair_votes_thresholds_are_fp16_pairs_in_ps_domain():
    """The lazy rescale's vote on P's FP16 pairs (``PAIR_VOTE``) compares P with thresholds held as FP16 pairs: two
    empty columns' word is -1 in both halves (any P >= 0 votes, a masked score's 0 too), and ``2^headroom`` is exact
    in FP16, so a P that votes in FP32 by more than FP16's rounding votes in FP16 too."""
    import numpy as np

    from foscar.cute.lazy import EMPTY_PAIR
    from foscar.format import RESCALE_HEADROOM

    assert np.array([-1.0, -1.0], np.float16).view(np.uint32)[0] == EMPTY_PAIR
    t = np.float16(2.0 ** RESCALE_HEADROOM)
    assert float(t) == 2.0 ** RESCALE_HEADROOM
    p = np.nextafter(np.float32(t), np.float32(np.inf)) * np.float32(1 + 2 ** -11)  # past half an FP16 unit above
    assert np.float16(p) > t and not np.float16(np.float32(t) * np.float32(1 + 2 ** -12)) > t
