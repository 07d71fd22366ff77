"""CPU tests of the decode benchmark's ``--head-dim`` (foscar.bench.decode): the parsed option, the cases,
formats, bytes, softmax scale and memory plan it sets, and driver runs end to end at D = 64 and 256 with fake
CUDA timing and a fake foscar.triton (the fakes of tests/_fake_gpu.py)."""
import json
import math

import pytest
import torch
from _fake_gpu import CPU_TARGET, fake_triton_module, stand_in

import foscar
import foscar.bench.decode as bd

K = 1024


def test_the_parser_takes_the_supported_head_dims(capsys):
    assert bd.parse_args([]).head_dim == bd.HEAD_DIM == 128
    for d in (64, 128, 256):
        assert bd.parse_args(["--head-dim", str(d)]).head_dim == d
    with pytest.raises(SystemExit):
        bd.parse_args(["--head-dim", "96"])
    err = capsys.readouterr().err
    assert "--head-dim" in err and "96" in err and "64, 128, 256" in err
    assert "--head-dim {64,128,256}" in bd.build_parser().format_help()


@pytest.mark.parametrize("d, g", [(64, 64), (128, 128), (256, 128)])
def test_cases_formats_and_scale_follow_the_head_dim(d, g):
    cases = bd.build_grid("axes", (2, 4), ((8, 32 * K),), (16, 8), d)
    assert len(cases) == 8 and {(c.q_heads, c.kv_heads, c.head_dim) for c in cases} == {(16, 8, d)}
    for c in cases:
        fmt = c.fmt()
        assert (fmt.bits, fmt.head_dim, fmt.group_size, fmt.k_axis, fmt.v_axis) == (c.bits, d, g, c.k_axis, c.v_axis)
    assert bd.group_for(d) == g and bd.sm_scale(d) == pytest.approx(1 / math.sqrt(d))
    assert bd.Case(1, 128, 4).head_dim == 128 and bd.sm_scale() == bd.SM_SCALE


@pytest.mark.parametrize("d", (64, 128, 256))
def test_bytes_follow_the_head_dim(d):
    assert bd.kv_bytes_per_token(16, d) == bd.bf16_bytes_per_token(d) == 4 * d
    for bits in (2, 4):
        want = 2 * (d * bits // 8 + (d // bd.group_for(d)) * 8)  # K and V: codes, FP32 (s', z') per group
        assert bd.kv_bytes_per_token(bits, d) == want
        for ka, va in bd.AXIS_COMBOS:
            assert foscar.KVFormat(bits, d, bd.group_for(d), ka, va).bytes_per_token() == want
        q_out = 2 * 8 * 16 * d * 2
        assert bd.bytes_read(8, 32 * K, bits, 16, 8, d) == 8 * 32 * K * 8 * want + q_out
    assert bd.kv_bytes_per_token(4, 256) == 288 and bd.kv_bytes_per_token(2, 64) == 48


def test_the_memory_plan_follows_the_head_dim():
    shape = (64, 128 * K)
    peaks = [bd.peak_bytes(*shape, (4,), head_dim=d) for d in (64, 128, 256)]
    assert peaks[0] < peaks[1] == bd.peak_bytes(*shape, (4,)) < peaks[2]
    budget = bd.peak_bytes(*shape, (2, 4)) + 1
    assert bd.plan_shapes([shape], (2, 4), budget)[0] == [shape]
    run, skipped = bd.plan_shapes([shape], (2, 4), budget, kv_heads=8, head_dim=256)
    assert run == [] and skipped[0]["B"] == 64 and "(--max-gb)" in skipped[0]["reason"]


def test_the_bf16_inputs_and_their_reference_take_the_queries_head_dim():
    torch.manual_seed(0)
    table = bd.make_block_table(2, 2, "shuffled", 1)
    q = torch.randn(2, 4, 256).to(torch.bfloat16)
    inp = bd.make_bf16_inputs(q, table, 2 * bd.PAGE, 2)
    assert inp.k_cache.shape == (4, bd.PAGE, 2, 256)
    ref = bd.bf16_slice_reference(inp)
    assert ref.exact.shape == (2, 256) and 0 < ref.bf16_err < 2e-2


@pytest.fixture
def fake_gpu_at_any_head_dim(monkeypatch):
    """The CPU stands in for the GPU (:func:`_fake_gpu.stand_in`), with :func:`_fake_gpu.fake_triton_module` (any
    head dim) as foscar.triton."""
    stand_in(monkeypatch, fake_triton_module())


@pytest.mark.parametrize("d, g", [(64, 64), (256, 128)])
def test_driver_at_another_head_dim(d, g, fake_gpu_at_any_head_dim, tmp_path, capsys):
    argv = ["--shapes", "1:1K,2:1K", "--heads", "4:2", "--head-dim", str(d), "--bits", "4", "--check",
            "--kernels", "foscar_folded", "foscar_bf16", "cudnn_sdpa", "--out", str(tmp_path),
            "--ceiling-gib", "0.01", "--max-gb", "100", "--warmup", "1"]
    assert bd.main(argv, target=CPU_TARGET) == 0
    result = json.loads((tmp_path / "bench_decode.json").read_text())
    assert result["meta"]["problem"] == {"Hq": 4, "Hkv": 2, "D": d, "g": g, "page": bd.PAGE}
    assert result["meta"]["args"]["head_dim"] == d
    assert [c["status"] for c in result["checks"]] == ["pass"]
    recs = {(r["B"], r["kernel"]): r for r in result["records"]}
    assert len(recs) == 2 * 3 and all(r["D"] == d for r in recs.values())
    for b in (1, 2):
        for kernel, bits in (("foscar_folded", 4), ("foscar_bf16", 16)):
            r = recs[(b, kernel)]
            assert r["status"] == "ok" and r["err_ratio"] < 1.5, r
            assert r["bytes"] == bd.bytes_read(b, 1 * K, bits, 4, 2, d)
        assert recs[(b, "cudnn_sdpa")]["status"].startswith("missing:")
    assert f"Problem: Hq 4, Hkv 2, D {d}, g {g}, page 64." in capsys.readouterr().out
    header = (tmp_path / "bench_decode.csv").read_text().splitlines()[0].split(",")
    assert header[:5] == ["B", "L", "Hq", "Hkv", "D"]
