"""The split merge by stage 1's last CTA of each (sequence, KV head) (``foscar.cute.config.FUSED_MERGE``,
``Sm90Config.fused_merge``, :mod:`foscar.cute.tail_merge`): no combine launch where a format has no BF16 windows
and no rotation.

CPU: the launch's choice (``fused_merge_to``: which calls fuse, what stage 1 takes), and the compiled kernel's
protocol in its SASS (the GPU-scope fence and acquire-release add on the counter, the partials read at L2, the
counter set back to zero). GPU (sm_90): against the float64 oracle (INT2 and INT4, one and two CTAs an SM, one
split and many, BF16 and FP32 outputs, the LSE and none, a step of 4 tokens, channel-wise K), against the combine's
merge of the same partials, the counters left at zero, and CUDA-graph replays equal to the eager call."""
import dataclasses
import os
import re
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER, cute_against_the_oracle, cute_step_against_the_oracle, make  # noqa: E402
from _helpers import cute_switches  # noqa: E402

FMT = foscar.KVFormat(bits=4, head_dim=128, group_size=128)


def _fused(monkeypatch, fmt, out, lse, l_part, sem, warp_specialized=True, on=True):
    from foscar.cute.launch import fused_merge_to
    with cute_switches(monkeypatch, FUSED_MERGE=on):
        return fused_merge_to(fmt, warp_specialized, out, lse, l_part, sem, out.shape[0], out.shape[1])


def test_the_launch_fuses_the_merge_only_where_stage_one_can_write_the_output(monkeypatch):
    """v1, no windows, no rotation, an output (and LSE) stage 1 can write: ``(out, lse, counters)``; the LSE not
    asked for, a placeholder over the contiguous workspace (never written); else ``()``, the combine merges."""
    out, lse = torch.empty(3, 8, 128), torch.empty(3, 8)
    l_part, sem = torch.empty(3, 8, 10), torch.zeros(6, dtype=torch.int32)
    got = _fused(monkeypatch, FMT, out, lse, l_part, sem)
    assert len(got) == 3 and got[0].data_ptr() == out.data_ptr() and got[1] is not None and got[2] is sem
    placeholder = _fused(monkeypatch, FMT, out, None, l_part, sem)[1]
    assert placeholder.shape == (3, 8) and placeholder.data_ptr() == l_part.data_ptr()
    assert _fused(monkeypatch, FMT, out, lse, l_part, sem, on=False) == ()
    assert _fused(monkeypatch, FMT, out, lse, l_part, sem, warp_specialized=False) == ()
    for fmt in (foscar.KVFormat(bits=4, head_dim=128, group_size=128, sink=4, recent=32),
                foscar.KVFormat(bits=4, head_dim=128, group_size=128, rotation="hadamard")):
        assert _fused(monkeypatch, fmt, out, lse, l_part, sem) == ()
    assert _fused(monkeypatch, FMT, torch.empty(3 * 8 * 128 + 1)[1:].view(3, 8, 128), lse, l_part, sem) == ()  # base
    assert _fused(monkeypatch, FMT, out, None, l_part.transpose(0, 1), sem) == ()


def test_stage_one_takes_the_output_lse_and_counters_after_its_tensors():
    from foscar.cute.config import STAGE1_TENSORS, config_for
    from foscar.cute.launch import stage1_tensors
    cfg = dataclasses.replace(config_for(FMT, 4, 64), fused_merge=2, cluster_out="f32")
    assert stage1_tensors(cfg) == STAGE1_TENSORS + (("out", "f32", 3), ("lse", "f32", 2), ("counters", "i32", 1))


@pytest.mark.parametrize("bits,ctas,fused,out,gqa", [(4, 2, 2, "bf16", 4), (2, 1, 1, "f32", 4), (2, 1, 2, "bf16", 32)])
def test_the_kernel_counts_in_releases_and_resets_at_gpu_scope(bits, ctas, fused, out, gqa):
    """The compiled kernel (sm_90a; at 32 columns each consumer's code path its own): a GPU-scope fence before an acquire-release atomic add (the counter), the
    partials read at L2 (strong GPU-scope loads: other SMs wrote them), the output stored, the counter exchanged
    back to zero; no such instruction without the fused merge."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import sass_stats_cute as ss

    from foscar.cute.compile import compile_stage1
    from foscar.cute.config import config_for
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    base = config_for(fmt, gqa, 64, "e4m3", 2 if gqa == 4 else 1)  # GQA 32: a code path per consumer
    for f in (0, fused):
        cfg = dataclasses.replace(base, fused_merge=f, cluster_out=out)
        sass = ss.sass_of(compile_stage1(cfg, warp_specialized=True, ctas_per_sm=ctas, keep_cubin=True).__cubin__)
        adds = re.findall(r"MEMBAR\.ALL\.GPU[\s\S]{0,2000}?ATOMG\.E\.ADD\.STRONG\.GPU", sass)
        assert bool(adds) == bool(f) and ("ATOMG.E.EXCH.STRONG.GPU" in sass) == bool(f)
        assert (len(re.findall(r"LDG\.E\.STRONG\.GPU", sass)) >= 2) == bool(f)


def _decode(q, cache, fused: bool, monkeypatch, **launch):
    from foscar.cute.launch import decode
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    with cute_switches(monkeypatch, FUSED_MERGE=fused):
        decode(q, cache, out=out, lse=lse, warp_specialized=True, **launch)
    return out, lse


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("launch", [{"num_splits": 1, "ctas_per_sm": 2}, {"num_splits": 5, "ctas_per_sm": 2},
                                    {"num_splits": 33, "ctas_per_sm": 1, "k_operand": "e4m3", "tiles_per_pass": 2}])
def test_fused_merge_against_the_oracle_gpu(monkeypatch, bits, launch):
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, FUSED_MERGE=True):
        cute_against_the_oracle(fmt, [8192, 700, 1], 4, "fused merge: error", warp_specialized=True, **launch)
        gqa = 4 if launch.get("k_operand") == "e4m3" else 8  # E4M3 K operands take channel-wise K up to GQA 4
        group = 128 if launch.get("tiles_per_pass") == 2 else 64  # two tiles a pass: token groups of two tiles
        cute_against_the_oracle(foscar.KVFormat(bits=bits, head_dim=128, group_size=group, k_axis="channel"),
                                [3000, 65], gqa, "fused merge, channel-wise K: error", warp_specialized=True, **launch)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
def test_fused_merge_is_the_combines_merge_and_leaves_the_counters_at_zero_gpu(monkeypatch, bits):
    """The same partials merged by the last CTA and by the combine: equal within FP32 rounding (the sums' order
    differs); the output without the LSE too; the counters of this stream zero after the call."""
    from foscar.splitkv import _counters
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    q, cache = make(fmt, [6000, 300, 1, 64], Hkv=2, G=4, page=64, seed=3)
    ref, ref_lse = _decode(q, cache, False, monkeypatch, num_splits=7)
    got, got_lse = _decode(q, cache, True, monkeypatch, num_splits=7)
    assert torch.isfinite(got).all() and torch.isfinite(got_lse).all()
    assert float((got - ref).norm() / ref.norm()) <= 1e-6
    assert float((got_lse - ref_lse).abs().max()) <= 1e-5
    from foscar.cute.launch import decode
    alone = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    with cute_switches(monkeypatch, FUSED_MERGE=True):
        decode(q, cache, out=alone, warp_specialized=True, num_splits=7)
    assert float((alone.float() - ref).norm() / ref.norm()) <= 1e-2
    torch.cuda.synchronize()
    assert int(_counters(q.device, 8).abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
def test_fused_merge_replays_in_a_cuda_graph_gpu(monkeypatch):
    """Three replays of a captured decode equal the eager call: each launch finds the counters at zero."""
    from foscar.cute.launch import decode
    q, cache = make(FMT, [5000, 900], Hkv=2, G=4, page=64, seed=5)
    eager, _ = _decode(q, cache, True, monkeypatch, num_splits=9)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=q.device)
    with cute_switches(monkeypatch, FUSED_MERGE=True):
        decode(q, cache, out=out, warp_specialized=True, num_splits=9)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode(q, cache, out=out, warp_specialized=True, num_splits=9)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
def test_fused_merge_takes_a_step_gpu(monkeypatch, bits):
    with cute_switches(monkeypatch, FUSED_MERGE=True):
        cute_step_against_the_oracle(bits, 4, 4, 64, {})
