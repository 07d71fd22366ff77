"""CPU tests of the decode benchmark (foscar.bench.decode, benchmarks/bench_decode.py): grids, bytes, statistics, bars, Markdown, the inputs and
references it builds, its read-ceiling kernel (Triton interpreter) and its driver end to end with
fake CUDA timing and a fake foscar.triton. The GPU timings themselves need the GPU machine."""
import csv
import json
import math
import os
import re
import subprocess
import sys
import time
import types

import pytest
import torch

import foscar
import foscar.bench.decode as bd
from foscar import backends
from foscar.backends import BackendStatus
from foscar.bench.kernels import problem_key
K = 1024


# ---- grids ---------------------------------------------------------------------------------
def test_imports_without_flashinfer_or_the_kernels():
    code = ("import sys, importlib.util\n"
            "sys.modules['flashinfer'] = None\n"  # as on a machine without the wheel: importing it fails
            "import foscar.bench.decode as bd\n"
            "assert 'foscar.triton' not in sys.modules\n"
            "print(sorted(bd.KERNELS))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "flashinfer_tc" in proc.stdout


def test_paper_grid_has_the_13_shapes_for_each_bits():
    cases = bd.build_grid("paper", (2, 4))
    shapes = list(dict.fromkeys(c.shape for c in cases))
    assert shapes == [(1, 8 * K), (1, 32 * K), (1, 128 * K), (1, 512 * K), (8, 8 * K), (8, 32 * K), (8, 128 * K),
                      (8, 512 * K), (64, 8 * K), (64, 16 * K), (64, 32 * K), (64, 64 * K), (64, 128 * K)]
    for bits in (2, 4):
        mine = [c for c in cases if c.bits == bits]
        assert len(mine) == 13 and {(c.k_axis, c.v_axis) for c in mine} == {("token", "token")}


def test_axes_grid_is_4_shapes_by_4_axis_combinations_per_bits():
    cases = bd.build_grid("axes", (2, 4))
    for bits in (2, 4):
        mine = [c for c in cases if c.bits == bits]
        assert len(mine) == 16
        assert {c.shape for c in mine} == {(1, 32 * K), (1, 128 * K), (8, 32 * K), (8, 128 * K)}
        for shape in {c.shape for c in mine}:
            combos = {(c.k_axis, c.v_axis) for c in mine if c.shape == shape}
            assert combos == {("token", "token"), ("token", "channel"), ("channel", "token"), ("channel", "channel")}
    assert all(c.fmt().group_size == 128 and c.fmt().head_dim == 128 for c in cases)


def test_quick_grid_and_shape_override():
    assert len({c.shape for c in bd.build_grid("quick", (2,))}) == 2
    shapes = bd.parse_shapes("1:8K, 64:128k,2:4096")
    assert shapes == ((1, 8 * K), (64, 128 * K), (2, 4096))
    cases = bd.build_grid("axes", (4,), shapes)
    assert [c.shape for c in cases[:4]] == [(1, 8 * K)] * 4 and len(cases) == 12
    assert bd.parse_length("1M") == K * K


@pytest.mark.parametrize("bad", ["8", "x:8K", "0:8K", "8:100", "8:0", "8:-128", "8:1.5K"])
def test_bad_shapes_are_rejected(bad):
    with pytest.raises(Exception):
        bd.parse_shapes(bad)


def test_group_by_shape_keeps_order():
    groups = bd.group_by_shape(bd.build_grid("paper", (2, 4)))
    assert list(groups) == list(bd.PAPER_SHAPES)
    assert [c.bits for c in groups[(8, 128 * K)]] == [2, 4]


# ---- bytes and memory ----------------------------------------------------------------------
def test_bytes_per_token():
    assert bd.kv_bytes_per_token(2) == 80 and bd.kv_bytes_per_token(4) == 144 and bd.kv_bytes_per_token(16) == 512
    for bits in (2, 4):
        for ka, va in bd.AXIS_COMBOS:
            assert foscar.KVFormat(bits, 128, 128, ka, va).bytes_per_token() == bd.kv_bytes_per_token(bits)


def test_bytes_read_counts_cache_q_and_out():
    q_out = 2 * 8 * 32 * 128 * 2
    assert bd.bytes_read(8, 128 * K, 2) == 8 * 128 * K * 8 * 80 + q_out
    assert bd.bytes_read(8, 128 * K, 4) == 8 * 128 * K * 8 * 144 + q_out
    assert bd.bytes_read(8, 128 * K, 16) == 8 * 128 * K * 8 * 512 + q_out


def test_memory_guard_skips_with_a_reason():
    need = bd.peak_bytes(64, 128 * K, (2, 4))
    assert 2 * 64 * 128 * K * 8 * 128 * 2 < need < 40e9  # the 34 GB of BF16 KV plus workspaces
    run, skipped = bd.plan_shapes([(1, 8 * K), (64, 128 * K)], (2, 4), 20e9)
    assert run == [(1, 8 * K)]
    assert skipped[0]["B"] == 64 and "GB" in skipped[0]["reason"] and "budget 20.0" in skipped[0]["reason"]
    run, skipped = bd.plan_shapes(list(bd.PAPER_SHAPES), (2, 4), 130e9)
    assert run == list(bd.PAPER_SHAPES) and not skipped


# ---- statistics, bars, Markdown ------------------------------------------------------------
def test_summarize_and_geomean():
    from foscar.bench import summarize_us
    s = summarize_us([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s == {"median_us": 3.0, "min_us": 1.0, "all_us": [5.0, 1.0, 3.0, 2.0, 4.0]}
    assert bd.geomean([1.0, 4.0]) == pytest.approx(2.0) and bd.geomean([2.0] * 13) == pytest.approx(2.0)
    assert bd.geomean([]) is None
    with pytest.raises(ValueError):
        bd.geomean([1.0, 0.0])


def _rec(B, L, bits, kernel, us, status="ok", axes=("token", "token")):
    ka, va = (None, None) if bits == 16 else axes
    return {"B": B, "L": L, "bits": bits, "k_axis": ka, "v_axis": va, "kernel": kernel, "status": status,
            "median_us": us, "min_us": us, "all_us": [us] * 5}


def _synthetic(shapes, fracs, ceiling=4.0):
    """FlashInfer-tc at 90% of the ceiling; folded at fracs[bits] of it; reconstruct 1.2x slower (INT2)."""
    recs = []
    for B, L in shapes:
        recs.append(_rec(B, L, 16, "flashinfer_tc", bd.bytes_read(B, L, 16) / (0.9 * ceiling * 1e12) * 1e6))
        for bits, frac in fracs.items():
            us = bd.bytes_read(B, L, bits) / (frac * ceiling * 1e12) * 1e6
            recs.append(_rec(B, L, bits, "foscar_folded", us))
            recs.append(_rec(B, L, bits, "foscar_reconstruct", 1.2 * us))
    bd.annotate(recs, ceiling)
    return recs


def test_annotate_derives_rates_fractions_and_speedups():
    recs = _synthetic([(8, 128 * K)], {2: 0.3, 4: 0.5})
    fi, fold2 = recs[0], recs[1]
    assert fi["ceiling_frac"] == pytest.approx(0.9) and fi["speedup_vs_baseline"] == pytest.approx(1.0)
    assert fold2["tbps"] == pytest.approx(1.2) and fold2["ceiling_frac"] == pytest.approx(0.3)
    want = fi["median_us"] / fold2["median_us"]
    assert fold2["speedup_vs_baseline"] == pytest.approx(want)
    assert want == pytest.approx((0.3 / 0.9) * bd.bytes_read(8, 128 * K, 16) / bd.bytes_read(8, 128 * K, 2))


def test_bars_on_the_full_paper_grid():
    recs = _synthetic(bd.PAPER_SHAPES, {2: 0.22, 4: 0.45})
    bars = {b["bar"]: b for b in bd.evaluate_bars(recs)}
    read4 = next(b for n, b in bars.items() if n.startswith("INT4 read"))
    read2 = next(b for n, b in bars.items() if n.startswith("INT2 read"))
    assert read4["verdict"] == "PASS" and read4["value"] == pytest.approx(0.45) and read4["shapes"] == "6/6"
    assert read2["verdict"] == "FAIL" and read2["value"] == pytest.approx(0.22)
    geo4 = next(b for n, b in bars.items() if n.startswith("INT4 geomean"))
    geo2 = next(b for n, b in bars.items() if n.startswith("INT2 geomean"))
    # speedup = (frac / 0.9) * 512/bpt, up to the tiny q/out bytes
    assert geo4["value"] == pytest.approx(0.45 / 0.9 * 512 / 144, rel=1e-3) and geo4["verdict"] == "PASS"
    assert geo2["value"] == pytest.approx(0.22 / 0.9 * 512 / 80, rel=1e-3) and geo2["verdict"] == "FAIL"
    assert geo4["shapes"] == "13/13" and geo4["complete"]
    fold = next(b for n, b in bars.items() if "reconstruct" in n)
    assert fold["value"] == pytest.approx(1.2) and fold["verdict"] == "PASS"


def test_bars_partial_missing_and_wrong_records():
    recs = _synthetic([(8, 32 * K), (1, 8 * K)], {2: 0.5})
    recs.append(_rec(8, 128 * K, 2, "foscar_folded", 10.0, status="wrong: 3 non-finite outputs"))
    recs.append(_rec(8, 128 * K, 2, "foscar_reconstruct", None, status="missing: not written"))
    bd.annotate(recs, 4.0)
    bars = bd.evaluate_bars(recs)
    by = {b["bar"].split(" ")[0] + b["bar"].split(" ")[1]: b for b in bars}
    assert by["INT2read"]["shapes"] == "1/6" and not by["INT2read"]["complete"]
    assert by["INT4read"]["verdict"] == "n/a" and by["INT4geomean"]["verdict"] == "n/a"
    assert by["INT2geomean"]["shapes"] == "2/13"
    fold = next(b for b in bars if "reconstruct" in b["bar"])
    assert fold["verdict"] == "n/a" and fold["value"] is None  # a wrong or missing kernel proves nothing


def _result(records, **extra):
    result = {"meta": {"gpu": "NVIDIA H200", "timing": "eager", "command": "python3 bench_decode.py"},
              "ceiling": {"tbps": 4.0, "source": "triton, 8 GiB"}, "checks": [], "records": records,
              "skipped": [], "fatal": []}
    result.update(extra)
    bd.annotate(result["records"], 4.0)
    result["bars"] = bd.evaluate_bars(result["records"])
    return result


def test_markdown_rendering():
    recs = _synthetic([(8, 128 * K)], {2: 0.3, 4: 0.5})
    recs.append(_rec(8, 128 * K, 16, "cudnn_sdpa", None, status="missing: No available kernel"))
    recs.append(_rec(8, 128 * K, 16, "foscar_bf16", 777.0, status="wrong: slice error 1.0"))
    skipped = [{"B": 64, "L": 128 * K, "reason": "needs 36.0 GB > budget 20.0 GB (--max-gb)"}]
    checks = [{"bits": 2, "k_axis": "token", "v_axis": "token", "kernel": "foscar_folded", "status": "pass",
               "err": 1e-3, "bf16_err": 3e-3, "ratio": 0.33}]
    md = bd.render_markdown(_result(recs, skipped=skipped, checks=checks), detailed=True)
    fold2 = recs[1]
    assert f"| 8 | 128K | INT2 | tok/tok | {fold2['median_us']:.1f} | 30% | " in md
    assert "| 8 | 128K | INT4 | tok/tok |" in md and "1.20x" in md  # recon/folded
    assert "missing" in md and "777.0!" in md
    assert "| 64 | 128K | skipped: needs 36.0 GB" in md
    assert "- cudnn_sdpa: missing: No available kernel" in md
    assert "- foscar_bf16: B=8 L=128K wrong: slice error 1.0" in md
    assert "Read ceiling: 4.00 TB/s" in md and "| pass | 1.00e-03 |" in md
    assert "### Every record" in md and "Command: `python3 bench_decode.py`" in md
    compact = bd.render_markdown(_result(recs))
    assert "### Every record" not in compact and "profiled kernel time (no host gaps" not in compact
    recs[0]["kernel_us"], recs[1]["kernel_us"] = 900.0, 300.0  # FlashInfer-tc and folded INT2
    timed = bd.render_markdown(_result(recs))
    assert f"| {fold2['median_us']:.1f} (300.0) |" in timed
    assert "by profiled kernel time (no host gaps; not what the bars use): foscar_folded INT2 3.00x (1/13)" in timed
    table = [line for line in compact.splitlines() if line.startswith("| 8 | 128K |")]
    assert len(table) == 2  # one row per (shape, bits)
    assert all(line.count("|") == len(table[0].split("|")) - 1 for line in table)


def test_failures_are_wrong_error_and_failed_checks_not_missing():
    recs = [_rec(1, 8 * K, 2, "foscar_folded", 1.0), _rec(1, 8 * K, 16, "flashinfer", None, "missing: no wheel")]
    assert bd.failures(_result(recs)) == []
    recs.append(_rec(1, 8 * K, 16, "cudnn_sdpa", None, "error: first call: RuntimeError: x"))
    recs.append(_rec(1, 8 * K, 4, "foscar_folded", 2.0, "wrong: 1 non-finite outputs"))
    checks = [{"bits": 2, "k_axis": "token", "v_axis": "token", "kernel": "foscar_reconstruct", "status": "FAIL: x"}]
    assert len(bd.failures(_result(recs, checks=checks, fatal=["lost"]))) == 4


# ---- inputs and references -----------------------------------------------------------------
def test_block_tables():
    ident = bd.make_block_table(3, 5, "identity", 0)
    assert ident.dtype == torch.int32 and ident.tolist()[2] == [10, 11, 12, 13, 14]
    shuf = bd.make_block_table(3, 64, "shuffled", 7)
    for b in range(3):
        assert sorted(shuf[b].tolist()) == list(range(64 * b, 64 * (b + 1)))
    assert not torch.equal(shuf, bd.make_block_table(3, 64, "identity", 7))
    assert torch.equal(shuf, bd.make_block_table(3, 64, "shuffled", 7))


@pytest.mark.parametrize("axes", bd.AXIS_COMBOS)
@pytest.mark.parametrize("bits", (2, 4))
def test_random_cache_and_its_slice_reference(bits, axes):
    torch.manual_seed(bits)
    case = bd.Case(2, 256, bits, *axes)
    table = bd.make_block_table(2, 256 // bd.PAGE, "shuffled", 3)
    cache = bd.make_random_cache(case, table)
    assert cache.k_codes.shape == (2 * 4, bd.HKV, 64 * 128 * bits // 32)  # pool of B x 4 pages
    k, v = cache.dequantize(torch.float64)
    assert torch.isfinite(k).all() and torch.isfinite(v).all() and k.abs().max() <= 2.0 + 1e-6
    assert k.std() > 0.5 and v.std() > 0.5  # min-max groups over about [-2, 2], not zeros
    for tensor, params in (("k", cache.k_params), ("v", cache.v_params)):
        if cache.fmt.axis(tensor) == "channel":  # a group of 128 tokens spans two pages: both hold its row
            for b in range(2):
                pages = table[b].long()
                assert torch.equal(params[pages[0::2]], params[pages[1::2]])
    q = torch.randn(2, bd.HQ, bd.HEAD_DIM).to(torch.bfloat16)
    ref = bd.quant_slice_reference(bd.QuantInputs(q, cache))
    exact = foscar.decode_exact(q, cache)
    assert (ref.b, ref.h) == (1, bd.HKV - 1)
    assert torch.allclose(ref.exact, exact[1, 28:32], rtol=0, atol=1e-12)
    assert 1e-4 < ref.bf16_err < 2e-2
    one = bd.one_head_cache(cache, 1, 7)
    assert torch.equal(one.dequantize(torch.float64)[0][0, 0], k[1, 7])


def test_cache_to_round_trip_keeps_contents():
    k, v = torch.randn(2, 8, 300, 128), torch.randn(2, 8, 300, 128)
    fmt = foscar.KVFormat(2, 128, 128, "channel", "token")
    cache = foscar.quantize_kv(k, v, fmt, seq_lens=torch.tensor([300, 200], dtype=torch.int32), page_size=64)
    moved = bd.cache_to(cache, "cpu")
    assert moved is not cache
    for a, b in zip(cache.dequantize(), moved.dequantize()):
        assert torch.equal(a, b)


def test_bf16_slice_reference_matches_the_dense_view_sdpa_reads():
    torch.manual_seed(0)
    table = bd.make_block_table(3, 8, "shuffled", 1)
    q = torch.randn(3, bd.HQ, bd.HEAD_DIM).to(torch.bfloat16)
    inp = bd.make_bf16_inputs(q, table, 8 * bd.PAGE)
    ref = bd.bf16_slice_reference(inp)
    k4, v4 = (c.view(3, -1, bd.HKV, bd.HEAD_DIM).transpose(1, 2).double() for c in (inp.k_cache, inp.v_cache))
    dense = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2).double(), k4, v4, enable_gqa=True)
    assert bd.rel_l2(dense[2, 28:32, 0], ref.exact) < 1e-12
    assert bd.check_output(dense.squeeze(2).to(torch.bfloat16), ref, 3.0)["status"] == "ok"


def test_check_output_flags_unwritten_and_wrong_outputs():
    torch.manual_seed(1)
    case = bd.Case(2, 128, 4)
    cache = bd.make_random_cache(case, bd.make_block_table(2, 2, "identity", 0))
    q = torch.randn(2, bd.HQ, bd.HEAD_DIM).to(torch.bfloat16)
    ref = bd.quant_slice_reference(bd.QuantInputs(q, cache))
    good = foscar.decode_exact(q, cache).to(torch.bfloat16)
    assert bd.check_output(good, ref, 3.0)["status"] == "ok"
    unwritten = good.clone()
    unwritten[0, 3, 5] = float("nan")  # outside the checked slice: still caught
    assert bd.check_output(unwritten, ref, 3.0)["status"].startswith("wrong: 1 non-finite")
    swapped = good.flip(0)  # right values, wrong sequence
    status = bd.check_output(swapped, ref, 3.0)["status"]
    assert status.startswith("wrong: slice error") and "BF16 attention" in status


def test_foscar_auto_runs_what_decode_picks():
    """``foscar_auto`` times the user's call: foscar.decode with its own choices (the reference on the
    CPU), into a NaN-poisoned output that the check then passes."""
    torch.manual_seed(2)
    cache = bd.make_random_cache(bd.Case(2, 128, 4), bd.make_block_table(2, 2, "identity", 0))
    q = torch.randn(2, bd.HQ, bd.HEAD_DIM).to(torch.bfloat16)
    inp = bd.QuantInputs(q, cache)
    runner = bd.KERNELS["foscar_auto"].build(inp, bd.parse_args([]))
    assert torch.isnan(runner.out).all()
    runner.fn()
    assert bd.check_output(runner.out, bd.quant_slice_reference(inp), 3.0)["status"] == "ok"


def test_foscar_auto_rotated_decodes_a_rotated_centred_view_of_the_codes():
    """``foscar_auto_rotated`` times foscar.decode over the same codes read as a rotated, centred cache (a
    view: no copy), its output that of the exact decode of that view; timing only in the bench's check."""
    torch.manual_seed(2)
    cache = bd.make_random_cache(bd.Case(2, 128, 4), bd.make_block_table(2, 2, "identity", 0))
    q = torch.randn(2, bd.HQ, bd.HEAD_DIM).to(torch.bfloat16)
    runner = bd.KERNELS["foscar_auto_rotated"].build(bd.QuantInputs(q, cache), bd.parse_args([]))
    (view,) = runner.keep
    assert view.fmt.rotation == "hadamard" and view.k_mean is not None and cache.fmt.rotation is None
    assert view.k_codes is cache.k_codes and runner.judged
    runner.fn()
    exact = foscar.decode_exact(q, view)
    assert float((runner.out.double() - exact.double()).norm() / exact.double().norm()) < 1e-2


# ---- the one driver: check, then time -------------------------------------------------------
def _driver_case():
    torch.manual_seed(3)
    cache = bd.make_random_cache(bd.Case(2, 128, 4), bd.make_block_table(2, 2, "identity", 0))
    q = torch.randn(2, bd.HQ, bd.HEAD_DIM).to(torch.bfloat16)
    return q, cache, foscar.decode_exact(q, cache).to(torch.bfloat16)


def test_measure_times_only_what_passes_its_check(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    q, cache, good = _driver_case()
    check = bd.slice_check(q, cache)
    assert check.factor == bd.SLICE_FACTOR == bd.SHAPE_FACTOR == 3.0
    timed = []

    def timer(run, *, iters, warmup, flush, cuda_graph):
        timed.append((iters, warmup, cuda_graph))
        run()
        return {"median_us": 1.0, "min_us": 1.0, "all_us": [1.0] * iters}
    kw = dict(iters=5, warmup=1, flush=torch.empty(8, dtype=torch.uint8), timer=timer)
    got = bd.measure(lambda: good, check, cuda_graph=True, **kw)
    assert got["status"] == "ok" and got["median_us"] == 1.0 and got["first_call_s"] >= 0 and timed == [(5, 1, True)]
    assert list(got)[:5] == ["nonfinite", "err", "bf16_err", "err_ratio", "status"]
    unwritten = torch.full_like(good, float("nan"))
    for out, word in ((unwritten, "wrong: 8192 non-finite"), (good.flip(0), "wrong: slice error"),
                      (good[:1], "wrong: the check failed")):
        got = bd.measure(lambda out=out: out, check, **kw)
        assert got["status"].startswith(word) and "median_us" not in got, got["status"]
    assert len(timed) == 1  # none of them was timed

    def boom():
        raise NotImplementedError("not written")
    assert bd.measure(boom, check, **kw)["status"] == "error: first call: NotImplementedError: not written"
    assert bd.measure(boom, check, unavailable=lambda e: True, **kw)["status"].startswith("missing: NotImpl")
    assert bd.measure(lambda: unwritten, bd.NotHeld("timing only"), **kw)["note"] == "timing only"
    assert len(timed) == 2  # a peer not held to the check is timed

    def broken_timer(run, **kw):
        raise RuntimeError("capture failed")
    got = bd.measure(lambda: good, check, **{**kw, "timer": broken_timer})
    assert got["status"] == "error: timing: RuntimeError: capture failed" and got["err_ratio"] <= 3.0


def test_foscar_kernels_go_through_the_backend_registry(monkeypatch):
    """A foscar kernel's availability is its backend's status (its ``why`` when not usable); its call is the
    backend's ``launch`` with the kernel's options and a NaN-poisoned ``out``. Baselines are kernels of their
    own."""
    kinds = {name: type(k).__name__ for name, k in bd.KERNELS.items()}
    assert kinds == {"foscar_folded": "BackendKernel", "foscar_reconstruct": "Baseline",
                     "foscar_cute": "BackendKernel", "foscar_cute_ws": "BackendKernel",
                     "foscar_cute_e4m3": "BackendKernel", "foscar_cute_pair": "BackendKernel",
                     "foscar_cute_e4m3x3": "BackendKernel",
                     "foscar_auto": "AutoKernel", "foscar_auto_rotated": "AutoKernel",
                     "foscar_bf16": "Baseline", "flashinfer_tc": "Baseline", "flashinfer": "Baseline",
                     "cudnn_sdpa": "Baseline", "flashinfer_fp8": "Baseline", "flashinfer_nvfp4": "Baseline",
                     "fa4": "Baseline"}
    q, cache, good = _driver_case()
    inp, args = bd.QuantInputs(q, cache), bd.parse_args(["--num-splits", "3"])
    for name in ("foscar_folded", "foscar_cute_ws"):
        kernel = bd.KERNELS[name]
        why = backends.get(kernel.backend).status(problem_key(inp)).why
        with pytest.raises(bd.KernelMissing, match=why.split("(")[0]):  # on the CPU: needs a GPU
            kernel.build(inp, args)
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def launch(q, cache, config):
        calls.append(config)
        return config["out"].copy_(good)
    cute = backends.get("cute")
    monkeypatch.setattr(cute, "status", lambda key: BackendStatus("cute", True, "fake"))
    monkeypatch.setattr(cute, "launch", launch)
    runner = bd.KERNELS["foscar_cute"].build(inp, args)
    assert not calls and torch.isnan(runner.keep[0]).all()  # built, not called: its output poisoned
    got = bd.measure(runner.fn, bd.slice_check(q, cache), output=runner.output, iters=5, warmup=1,
                     flush=torch.empty(8, dtype=torch.uint8),
                     timer=lambda run, **kw: {"median_us": 2.0, "min_us": 2.0, "all_us": [2.0]})
    assert got["status"] == "ok" and calls[0]["warp_specialized"] is False and calls[0]["num_splits"] == 3
    assert calls[0]["out"] is runner.keep[0]


def test_the_sweeps_import():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import sweep_common
    assert sweep_common.measure is bd.measure and sweep_common.slice_check is bd.slice_check


# ---- the read-ceiling kernel -----------------------------------------------------------------
def test_read_kernel_under_the_triton_interpreter():
    pytest.importorskip("triton")
    code = ("import sys, torch\n"
            "import foscar.bench.decode as bd\n"
            "chunk = 2 * 4096\n"
            "x = torch.randint(-2**31, 2**31, (3 * chunk,), dtype=torch.int32)\n"
            "out = torch.empty(3, dtype=torch.int32)\n"
            "bd.read_kernel()[(3,)](x, out, chunk, BLOCK=4096)\n"
            "want = [bd.xor_reduce(x[p * chunk:(p + 1) * chunk]) for p in range(3)]\n"
            "assert out.tolist() == want, (out.tolist(), want)\n"
            "print('ok')\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_xor_reduce():
    x = torch.tensor([1, 2, 4, 8, 3, 3, 0, -1], dtype=torch.int32)
    assert bd.xor_reduce(x) == (1 ^ 2 ^ 4 ^ 8 ^ -1)


# ---- the driver, end to end on the CPU --------------------------------------------------------
class _FakeEvent:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def _fake_triton_module(folded_ok=True):
    """foscar.triton stand-in: decode = the folded reference with BF16 operands; no reconstruct kernel."""
    mod = types.ModuleType("foscar.triton")

    def decode(q, cache, *, sm_scale=None, out=None, num_splits=None, kernel="folded"):
        if kernel != "folded":
            raise NotImplementedError(f"kernel={kernel!r} not written yet")
        o = foscar.decode_folded(q, cache, dtype=torch.float32, operand_dtype=torch.bfloat16)
        if not folded_ok:
            o[-1, -1] = float("nan")  # one unwritten row
        out.copy_(o)
        return out

    def decode_bf16(q, k_cache, v_cache, block_table, seq_lens, *, out):  # caches [pages, Hkv, page, D]
        for b in range(q.shape[0]):
            pages = block_table[b].long()
            k, v = (c[pages].transpose(0, 1).reshape(bd.HKV, -1, bd.HEAD_DIM).float() for c in (k_cache, v_cache))
            o = torch.nn.functional.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v, enable_gqa=True)
            out[b] = o.squeeze(1)
        return out

    mod.decode, mod.decode_bf16 = decode, decode_bf16
    return mod


def _no_triton_reader():
    raise RuntimeError("no GPU for the Triton reader here")  # (its own test runs it interpreted)


#: The CPU stands in for the GPU: a small L2 flush, no Triton reader.
CPU_TARGET = bd.Target(device="cpu", flush_bytes=1 << 20, read_kernel=_no_triton_reader)


@pytest.fixture
def fake_gpu(monkeypatch):
    """``use(module)``: foscar.triton replaced by ``module``, CUDA's host calls stood in for, the Triton
    backend usable on the CPU; run the driver with ``bd.main(argv, target=CPU_TARGET)``."""
    triton_backend = backends.get("triton")
    monkeypatch.setattr(triton_backend, "status", lambda key: BackendStatus("triton", True, "fake Triton on the CPU"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake CPU device")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: types.SimpleNamespace(multi_processor_count=0, total_memory=0))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: None)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails as on a machine without the wheel

    def use(module):
        monkeypatch.setitem(sys.modules, "foscar.triton", module)
        monkeypatch.setattr(foscar, "triton", module, raising=False)
    return use


def test_driver_end_to_end(fake_gpu, tmp_path, capsys):
    fake_gpu(_fake_triton_module())
    argv = ["--shapes", "1:1K,2:2K", "--check", "--out", str(tmp_path), "--ceiling-gib", "0.01", "--max-gb", "100",
            "--warmup", "1"]
    assert bd.main(argv, target=CPU_TARGET) == 0
    result = json.loads((tmp_path / "bench_decode.json").read_text())
    recs = result["records"]
    assert len(recs) == 2 * (4 + 2 * 2)  # per shape: 4 BF16 kernels, then 2 quantized kernels x 2 bits
    by = {(r["B"], r["bits"], r["kernel"]): r for r in recs}
    for b in (1, 2):
        assert by[(b, 16, "foscar_bf16")]["status"] == "ok"
        assert by[(b, 16, "flashinfer_tc")]["status"].startswith("missing: import flashinfer failed")
        assert by[(b, 16, "cudnn_sdpa")]["status"].startswith("missing:")
        for bits in (2, 4):
            fold = by[(b, bits, "foscar_folded")]
            assert fold["status"] == "ok" and fold["err_ratio"] < 1.5 and len(fold["all_us"]) == 5
            assert fold["median_us"] > 0 and fold["bytes"] == bd.bytes_read(b, fold["L"], bits)
            assert fold["speedup_vs_baseline"] is None  # no FlashInfer here
            assert fold["host_sync"] in (True, False)  # (everything waits on the CPU)
            assert by[(b, bits, "foscar_reconstruct")]["status"].startswith("missing: NotImplementedError")
    assert [c["status"] for c in result["checks"]] == ["pass", "missing: NotImplementedError: kernel='reconstruct' "
                                                       "not written yet"] * 2
    assert result["ceiling"]["source"].startswith("torch_sum, 0.00977 GiB")  # whole 1 MiB chunks
    assert result["ceiling"]["triton_error"] == "RuntimeError: no GPU for the Triton reader here"
    assert result["meta"]["command"] == "python3 -m foscar.bench.decode " + " ".join(argv)
    assert all(b["verdict"] == "n/a" for b in result["bars"])
    out = capsys.readouterr()
    assert "### Times" in out.out and "| bar |" in out.out and "### Every record" not in out.out
    assert "[2/2] B=2 L=2K done" in out.err and "[########################] 2/2 " in out.err  # and the bar
    rows = list(csv.DictReader((tmp_path / "bench_decode.csv").open()))
    assert len(rows) == len(recs) and rows[0].keys() == set(bd.CSV_COLUMNS)
    assert [(int(r["B"]), r["kernel"], r["status"]) for r in rows] == [(r["B"], r["kernel"], r["status"]) for r in recs]
    assert (tmp_path / "bench_decode.md").read_text().count("### Every record") == 1


def test_driver_fails_on_a_wrong_kernel_before_timing(fake_gpu, tmp_path, capsys):
    fake_gpu(_fake_triton_module(folded_ok=False))
    argv = ["--grid", "quick", "--bits", "4", "--check", "--out", str(tmp_path), "--max-gb", "100"]
    assert bd.main(argv, target=CPU_TARGET) == 1
    result = json.loads((tmp_path / "bench_decode.json").read_text())
    assert result["records"] == [] and result["checks"][0]["status"].startswith("FAIL: ")
    assert "--check failed" in capsys.readouterr().err


def test_driver_flags_wrong_outputs_untimed_and_skips_loudly(fake_gpu, tmp_path):
    fake_gpu(_fake_triton_module(folded_ok=False))
    argv = ["--shapes", "1:1K,64:128K", "--bits", "2", "--kernels", "foscar_folded", "--out", str(tmp_path),
            "--max-gb", "1", "--ceiling-gib", "0.01", "--warmup", "1"]
    assert bd.main(argv, target=CPU_TARGET) == 1
    result = json.loads((tmp_path / "bench_decode.json").read_text())
    assert [r["status"][:26] for r in result["records"]] == ["wrong: 128 non-finite outp"]
    assert result["skipped"][0]["B"] == 64 and "budget 1.0 GB" in result["skipped"][0]["reason"]
    wrong = result["records"][0]
    assert "median_us" not in wrong and "host_sync" not in wrong and wrong["first_call_s"] >= 0  # never timed
    assert wrong["nonfinite"] == 128 and not math.isfinite(wrong["err"])


def test_host_sync_detector(monkeypatch):
    busy = {"until": 0.0}

    def sleep(cycles):  # the "GPU" is busy for 50 ms
        busy["until"] = time.perf_counter() + 0.05

    def synchronize():
        time.sleep(max(0.0, busy["until"] - time.perf_counter()))
    monkeypatch.setattr(torch.cuda, "_sleep", sleep, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    assert bd.syncs_with_host(lambda: None) is False
    assert bd.syncs_with_host(lambda: torch.cuda.synchronize()) is True
    recs = [dict(_rec(1, 8 * K, 2, "foscar_folded", 5.0), host_sync=True)]
    recs.append(dict(_rec(1, 8 * K, 4, "foscar_folded", 5.0), kernel_time_error="RuntimeError: no CUPTI"))
    md = bd.render_markdown(_result(recs))
    assert "- note: foscar_folded waits for the GPU inside the call" in md
    assert "- note: foscar_folded: no profiled kernel time: RuntimeError: no CUPTI" in md
    assert bd.failures(_result(recs)) == []  # a note, not a failure


def test_kernel_time_sums_the_calls_gpu_events(monkeypatch):
    import torch.profiler
    from torch.autograd import DeviceType

    def event(device, start, end, annotation=False):
        span = types.SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return types.SimpleNamespace(device_type=device, time_range=span, is_user_annotation=annotation)

    class FakeProfile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return [event(DeviceType.CPU, 0.0, 500.0), event(DeviceType.CUDA, 100.0, 130.0),
                    event(DeviceType.CUDA, 90.0, 200.0, annotation=True), event(DeviceType.CUDA, 150.0, 160.0)]
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    got = bd.kernel_time_fn(lambda: calls.append(1), iters=5, flush=torch.empty(8, dtype=torch.uint8))
    assert len(calls) == 5 and got["kernel_us"] == 40.0 and got["kernel_span_us"] == 60.0
    assert got["kernels_per_call"] == 2 and got["kernel_all_us"] == [40.0] * 5


def test_the_l2_flush_writes_or_reads_its_buffer(monkeypatch):
    from foscar.bench.common import flush_l2, l2_flush_mode
    from foscar.errors import InvalidArgumentError
    monkeypatch.delenv("FOSCAR_L2_FLUSH", raising=False)
    buf = torch.full((64,), 7, dtype=torch.uint8)
    assert l2_flush_mode() == "write"
    flush_l2(buf)
    assert not buf.any()  # written
    monkeypatch.setenv("FOSCAR_L2_FLUSH", "read")
    buf.fill_(7)
    flush_l2(buf)
    assert (buf == 7).all()  # read, left as it was
    monkeypatch.setenv("FOSCAR_L2_FLUSH", "zero")
    with pytest.raises(InvalidArgumentError, match="FOSCAR_L2_FLUSH"):
        flush_l2(buf)
    monkeypatch.setenv("FOSCAR_L2_FLUSH", "write")  # restored after the test: parse_args sets it for the run
    assert bd.parse_args(["--flush", "read"]).flush == "read" and l2_flush_mode() == "read"
    with pytest.raises(SystemExit):
        bd.parse_args(["--flush", "zero"])


def test_iters_below_five_are_refused():
    with pytest.raises(SystemExit):
        bd.parse_args(["--iters", "3"])
    args = bd.parse_args(["--bits", "4", "2", "2"])
    assert args.bits == (2, 4) and args.grid == "paper"
    opt_in = ("foscar_cute", "foscar_cute_ws", "foscar_cute_e4m3", "foscar_cute_pair", "foscar_cute_e4m3x3",
              "foscar_auto",
              "foscar_auto_rotated", "flashinfer_fp8",
              "flashinfer_nvfp4", "fa4")  # named
    assert args.kernels == [k for k in bd.KERNELS if k not in opt_in]


def test_compare_kernels_table():
    """benchmarks/compare_kernels.py: each kernel's time beside the base kernel's, the ratio base / kernel,
    ``-`` where a kernel did not run, and the ratios per bit width for the range and geomean."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import compare_kernels
    rec = lambda kernel, us, status="ok": {"B": 8, "L": 8192, "Hq": 32, "Hkv": 8, "bits": 4, "k_axis": "token",  # noqa: E731
                                           "v_axis": "token", "kernel": kernel, "median_us": us, "ceiling_frac": 0.5,
                                           "status": status}
    lines, ratios = compare_kernels.table([rec("foscar_folded", 30.0), rec("foscar_cute_ws", 20.0),
                                           rec("foscar_cute", 1.0, "FAIL: x")],
                                          ["foscar_folded", "foscar_cute", "foscar_cute_ws"])
    assert lines[2] == "| 4 | tok/tok | INT4 | 8 | 8K | 30.0 (50%) | - | 20.0 (50%), 1.50x |"
    assert dict(ratios) == {("foscar_cute_ws", 4): [1.5]}


@pytest.mark.parametrize("script,words", [("first_call.py", ("--shapes", "cold")),
                                          ("cluster_smoke.py", ("--timeout", "TIMEOUT"))])
def test_the_gpu_scripts_parse_their_options(script, words):
    """``benchmarks/first_call.py`` and ``benchmarks/cluster_smoke.py`` (run on an sm_90 GPU) at least parse and
    document their options here."""
    import subprocess
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    res = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and all(w in res.stdout for w in words)


def test_ptxas_reports_a_cute_kernels_registers_spills_and_injected_waits():
    """``benchmarks/ptxas_info.py`` (CPU: the kernel's PTX through Triton's bundled ptxas): the shipped INT2 kernel of
    two tiles a pass at two CTAs an SM spills nothing under its launch bound."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root), CUTE_DSL_ARCH="sm_90a")
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "ptxas_info.py"), "--bits", "2", "--k-operand",
                          "e4m3", "--tiles-per-pass", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    m = re.search(r"registers (\d+) .* spill stores (\d+) B, loads (\d+) B; injected wgmma\.wait_group: (\d+)",
                  res.stdout)
    assert m and int(m.group(1)) <= 80 and m.group(2) == m.group(3) == "0", res.stdout


def test_run_with_takes_every_kernel_switch_and_refuses_others():
    """``benchmarks/run_with.py`` reads its switches from ``foscar.cute.config.SWITCHES``: each is a module
    constant of a kind the words can set, and a word naming anything else is refused."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import run_with
    finally:
        sys.path.pop(0)
    from foscar.cute import config
    assert set(run_with.SWITCHES) == set(config.SWITCHES)
    assert all(kind in (bool, tuple, dict) for kind in run_with.SWITCHES.values())
    words = {bool: "1", tuple: "2,4", dict: "2:q_first"}
    chosen = run_with.settings([f"{name}={words[kind]}" for name, kind in run_with.SWITCHES.items()])
    assert chosen["QK_PROMOTE_BITS"] == (2, 4) and chosen["PROLOGUE_BY_BITS"] == {2: "q_first"}
    assert chosen["P_COLUMN_MAJOR_COLS"] == (2, 4) and chosen["MASK_BRANCH"] is True
    for bad in ("STAGES=8", "MASK_BRANCH=2", "QK_PROMOTE_BITS=a"):
        with pytest.raises(SystemExit, match="run_with: expected NAME=VALUE"):
            run_with.settings([bad])


def test_sass_tile_loop_finds_each_consumers_loop():
    """``benchmarks/sass_stats_cute.py``'s ``tile_loop``: of the backward-branch spans holding MMAs, the innermost whole
    loop, also where three consumers' loops sit under longer spans (rare paths laid out after them branching back)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        from sass_stats_cute import tile_loop
    finally:
        sys.path.pop(0)
    lines, addr = [], 0

    def emit(op):
        nonlocal addr
        lines.append(f"        /*{addr:04x}*/                   {op} ;")
        addr += 16
        return addr - 16
    loops = []
    for _ in range(3):  # three consumers' loops: 2 MMAs and 3 other instructions each
        start = emit("FADD R0, R0, R1")
        emit("HGMMA.64x8x16.F32 R8, R24, gdesc[UR4], R8")
        emit("HGMMA.64x8x16.F32 R8, R28, gdesc[UR4], R8")
        emit("FMUL R2, R2, R3")
        emit(f"@P0 BRA 0x{start:x}")
        loops.append(start)
    for start in loops:  # rare paths after the loops, branching back into them: spans holding several loops
        emit("MOV R4, R5")
        emit(f"BRA 0x{start + 16:x}")
    body = tile_loop("\n".join(lines))
    assert body == ["FADD", "HGMMA.64", "HGMMA.64", "FMUL", "BRA"]


def test_sass_rare_paths_are_told_apart():
    """``sass_stats_cute.rare_paths``: of the tile loop's forward branches, the lazy rescale's (after its vote), the
    masks' (``-inf`` selects only), the correction fold's (the first past the PV product's wait) and an mbarrier
    wait's retry are the blocks a full tile skips; any other branch's block is the common path's."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        from sass_stats_cute import rare_paths, tile_loop
    finally:
        sys.path.pop(0)
    ops = []

    def block(*body):  # a forward branch over body
        at = len(ops)
        ops.append(None)
        ops.extend(body)
        ops[at] = f"@!P0 BRA 0x{16 * len(ops):x}"
    ops.append("FADD R0, R0, R1")
    block("SYNCS.PHASECHK.TRANS64 P0, [R5], R4", "NANOSLEEP 0x10")
    ops.append("HGMMA.64x8x16.F32 R8, R24, gdesc[UR4], R8")
    ops.append("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    block("ISETP.GE.AND P2, PT, R9, R10, PT", "FSEL R24, R24, -INF , !P2", "FSEL R25, R25, -INF , !P2")
    block("FMUL R3, R3, R4")  # a branch of the common path
    ops.append("BAR.RED.OR.DEFER_BLOCKING 0x1, 0x80, P0")
    block("SHFL.BFLY PT, R8, R24, 0x4, 0x1f", "FMNMX R1, R1, R8, !PT", "FMUL R2, R2, R1")
    ops.append("HGMMA.64x8x16.F32 R8, R28, gdesc[UR4], R8")
    ops.append("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    block("SHFL.BFLY PT, R8, R24, 0x4, 0x1f", "FFMA R1, R8, R2, R1", "FADD R3, R3, R1", "FADD R4, R4, R1")
    ops.append("@P1 BRA 0x0")
    sass = "\n".join(f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(ops))
    assert len(tile_loop(sass)) == len(ops)
    assert rare_paths(sass) == {"rescale": 3, "masks": 3, "fold": 4, "waits": 2}


def test_run_with_forgets_the_variants_chosen_under_other_switches():
    """``run_with.apply`` clears every cache the switches decide (``clear_switch_caches``): a sweep that sets a
    switch after the shipped ones were used (``sweep_switches.py``'s variants, one process) gets the kernel variant
    the new switches choose, not the one chosen before (channel-wise K on E4M3 terms, two tiles a pass)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import run_with
    finally:
        sys.path.pop(0)
    import foscar
    from foscar.cute import config
    from foscar.cute.launch import default_variant
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128, k_axis="channel")
    shipped = {name: getattr(config, name) for name in run_with.SWITCHES}
    try:
        run_with.apply({"CHANNEL_K_E4M3": False}, shipped)
        assert default_variant(fmt, 4, 64)[0] == "bf16"
        run_with.apply({"CHANNEL_K_E4M3": True}, shipped)
        assert default_variant(fmt, 4, 64) == ("e4m3", 2)
    finally:
        run_with.apply({}, shipped)
    assert default_variant(fmt, 4, 64) == (("e4m3", 2) if config.CHANNEL_K_E4M3 else ("bf16", 1))


def test_interleaved_timing_takes_every_call_once_a_round_after_a_flush(monkeypatch):
    """``time_interleaved``: the warm-up calls first, then rounds in which each call runs once, in order, right
    after an L2 flush, timed alone; a call slowed in one round only moves its own median."""
    import foscar.bench.common as common
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    log = []
    monkeypatch.setattr(common, "flush_l2", lambda buf: log.append("flush"))
    slow = iter([0, 0, 0.02, 0])  # b's second timed call sleeps

    def a():
        log.append("a")

    def b():
        log.append("b")
        if len([x for x in log if x == "b"]) > 1:
            time.sleep(next(slow))
    res = common.time_interleaved({"a": a, "b": b}, iters=3, warmup=1, flush=torch.empty(1))
    assert log == ["a", "b"] + ["flush", "a", "flush", "b"] * 3
    assert set(res) == {"a", "b"} and all(len(r["all_us"]) == 3 for r in res.values())
    assert max(res["b"]["all_us"]) > 15_000 > res["b"]["median_us"]  # one slow round, not the median


@pytest.mark.parametrize("kw,name", [({"fns": {}}, "fns"), ({"fns": {"a": 1}}, "fns"), ({"iters": 0}, "iters"),
                                     ({"warmup": -1}, "warmup")])
def test_interleaved_timing_refuses_bad_arguments_by_name(kw, name):
    from foscar.bench import time_interleaved
    from foscar.errors import InvalidArgumentError
    args = {"fns": {"a": lambda: None}, "iters": 3, "warmup": 1, "flush": torch.empty(1), **kw}
    with pytest.raises(InvalidArgumentError, match=name):
        time_interleaved(**args)
