"""The split merge as a programmatic dependent launch of stage 1 (``foscar.cute.config.COMBINE_PDL``). CPU: the
combine waits for the grid before its first global read, every v1 CTA signals as it starts. GPU
(sm_90): decodes with it against the float64 oracle (windows between the launches, a rotated cache), and a
CUDA graph's replay equal to the eager call."""
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER  # noqa: E402
from _helpers import cute_switches  # noqa: E402
from foscar.cute.compile import compile_combine, compile_stage1  # noqa: E402
from foscar.cute.combine_config import CombineConfig  # noqa: E402
from foscar.cute.config import config_for  # noqa: E402


@pytest.fixture
def pdl(monkeypatch):
    """``COMBINE_PDL`` set, ``config_for``'s cache cleared around the test."""
    with cute_switches(monkeypatch, COMBINE_PDL=True):
        yield


@pytest.mark.parametrize("rotate", (False, True))
def test_the_dependent_combine_waits_before_its_first_read(rotate):
    ptx = compile_combine(CombineConfig(128, "bf16", True, 16, rotate, True), keep_ptx=True).__ptx__
    plain = compile_combine(CombineConfig(128, "bf16", True, 16, rotate), keep_ptx=True).__ptx__
    assert "griddepcontrol.wait" not in plain
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


def test_windows_take_the_dependent_launch_with_their_own_switch(monkeypatch):
    """``COMBINE_PDL_WINDOWS`` (on): stage 1 signals, and the combine waits, for windowed formats only, where v1
    runs two CTAs an SM; the combine attends the windows before its wait (they do not depend on stage 1)."""
    from foscar.cute.combine_config import dependent_combine
    windowed = foscar.KVFormat(bits=2, head_dim=128, group_size=128, sink=4, recent=64)
    plain = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    assert config_for(windowed, 4, 64).trigger_dependents and not config_for(plain, 4, 64).trigger_dependents
    assert dependent_combine(windowed, True, 2)
    assert not dependent_combine(windowed, True, 1) and not dependent_combine(windowed, False, 2)
    assert not dependent_combine(plain, True, 2)
    with cute_switches(monkeypatch, COMBINE_PDL_WINDOWS=False):
        assert not config_for(windowed, 4, 64).trigger_dependents and not dependent_combine(windowed, True, 2)
    ptx = compile_combine(CombineConfig(128, "bf16", True, 16, False, True, sink=4, recent=64, ring=64, gqa=4),
                          keep_ptx=True).__ptx__
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.index("ld.global") < ptx.index("griddepcontrol.wait")


def test_v1_signals_its_dependents_as_it_starts(pdl):
    cfg = config_for(foscar.KVFormat(bits=2, head_dim=128, group_size=128), 4, 64, "e4m3", 2)
    assert cfg.trigger_dependents
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__
    assert len(re.findall(r"griddepcontrol\.launch_dependents", ptx)) == 1  # every thread, before any branch
    assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("mbarrier.init")
    assert not re.search(r"\b(ld|st)\.local", ptx), "local memory (spills) in the kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,G,num_splits,fmt_kw", [
    ([8192, 4001, 129, 1], 4, None, {}), ([3000, 5], 4, 3, {"sink": 4, "recent": 100}),
    ([2000, 33], 4, 2, {"rotation": "hadamard"}), ([5000, 700], 8, None, {"k_axis": "channel"})])
def test_the_dependent_combine_against_the_oracle_gpu(pdl, bits, lens, G, num_splits, fmt_kw):
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    cute_against_the_oracle(fmt, lens, G, "dependent combine: error", num_splits=num_splits,
                               warp_specialized=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("fmt_kw", ({"sink": 4, "recent": 64}, {"sink": 2, "recent": 7, "k_axis": "channel"},
                                    {"sink": 4, "recent": 16, "rotation": "hadamard"}))
def test_the_dependent_combine_with_windows_against_the_oracle_gpu(fmt_kw):
    """``COMBINE_PDL_WINDOWS`` (on): the combine attends the windows while stage 1 runs (two CTAs an SM), or
    launches after it (one)."""
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=2, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    for ctas in (2, 1):
        cute_against_the_oracle(fmt, [3000, 70, 5], 4, "dependent combine, windows: error", num_splits=3,
                                   warp_specialized=True, ctas_per_sm=ctas)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
def test_a_graph_of_the_dependent_combine_replays_the_eager_call_gpu(pdl):
    from _cases import make

    from foscar.cute.launch import decode
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    q, cache = make(fmt, [5000, 700], Hkv=2, G=4, page=64, seed=3)
    eager = decode(q, cache, warp_specialized=True)
    out = torch.full_like(eager, float("nan"))
    decode(q, cache, out=out, warp_specialized=True)  # compiled and loaded before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(q, cache, out=out, warp_specialized=True)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
