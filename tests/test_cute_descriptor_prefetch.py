"""The TMA descriptors prefetched as a v1 CTA starts (``foscar.cute.config.PREFETCH_DESCRIPTORS``,
``Sm90Config.prefetch_descriptors``), so that a short split's first copies do not wait for them. CPU: one
``prefetch.tensormap`` for each of the four descriptors, before the ring's barriers are initialised, and nothing
else of the kernel changed. GPU (sm_90): decodes with it against the float64 oracle, and a CUDA graph's replay."""
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


def _ptx(monkeypatch, on: bool) -> str:
    fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, PREFETCH_DESCRIPTORS=on):
        cfg = config_for(fmt, 4, 64, "e4m3", 2)
        assert cfg.prefetch_descriptors is on
        return compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__


def test_the_four_descriptors_are_prefetched_before_the_barriers(monkeypatch):
    on, off = _ptx(monkeypatch, True), _ptx(monkeypatch, False)
    assert "prefetch.tensormap" not in off
    assert on.count("prefetch.tensormap") == 4
    assert on.rindex("prefetch.tensormap") < on.index("mbarrier.init")
    # the rest as it was: without the prefetches, their addresses (conversions of the parameters' addresses, which
    # the copies also make) and the register declarations, with the registers' numbers (which they shift) dropped
    drop = re.compile(r"^\s*(cvta\.param\.u64|prefetch\.tensormap|\.reg)\b.*$\n?", re.M)
    names = re.compile(r"%(rd|rs|r|p)\d+")
    assert names.sub("%x", drop.sub("", on)) == names.sub("%x", drop.sub("", off))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,num_splits,fmt_kw,launch", [
    ([8192, 700, 1], 16, {}, {"warp_specialized": True, "k_operand": "e4m3", "tiles_per_pass": 2}),
    ([3000, 5], 3, {"sink": 4, "recent": 100}, {"warp_specialized": True, "tiles_per_pass": 1}),
    ([4100, 260], None, {"k_axis": "channel"}, {"warp_specialized": True})])
def test_prefetched_descriptors_against_the_oracle_gpu(monkeypatch, bits, lens, num_splits, fmt_kw, launch):
    from test_cute_decode import _decode_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    with cute_switches(monkeypatch, PREFETCH_DESCRIPTORS=True):
        _decode_against_the_oracle(fmt, lens, 4, "descriptors prefetched: error", num_splits=num_splits, **launch)
