"""CPU tests of the decode benchmark (foscar.bench.decode, benchmarks/bench_decode.py): grids, bytes, statistics,
bars, Markdown, and the inputs and references it builds. Its driver: ``test_bench_driver.py``; the GPU timings
themselves need the GPU machine."""
import subprocess
import sys

import pytest
import torch
from _helpers import bench_record, bench_result

import foscar
import foscar.bench.decode as bd
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


def _synthetic(shapes, fracs, ceiling=4.0):
    """FlashInfer-tc at 90% of the ceiling; folded at fracs[bits] of it; reconstruct 1.2x slower (INT2)."""
    recs = []
    for B, L in shapes:
        recs.append(bench_record(B, L, 16, "flashinfer_tc", bd.bytes_read(B, L, 16) / (0.9 * ceiling * 1e12) * 1e6))
        for bits, frac in fracs.items():
            us = bd.bytes_read(B, L, bits) / (frac * ceiling * 1e12) * 1e6
            recs.append(bench_record(B, L, bits, "foscar_folded", us))
            recs.append(bench_record(B, L, bits, "foscar_reconstruct", 1.2 * us))
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
    recs.append(bench_record(8, 128 * K, 2, "foscar_folded", 10.0, status="wrong: 3 non-finite outputs"))
    recs.append(bench_record(8, 128 * K, 2, "foscar_reconstruct", None, status="missing: not written"))
    bd.annotate(recs, 4.0)
    bars = bd.evaluate_bars(recs)
    by = {b["bar"].split(" ")[0] + b["bar"].split(" ")[1]: b for b in bars}
    assert by["INT2read"]["shapes"] == "1/6" and not by["INT2read"]["complete"]
    assert by["INT4read"]["verdict"] == "n/a" and by["INT4geomean"]["verdict"] == "n/a"
    assert by["INT2geomean"]["shapes"] == "2/13"
    fold = next(b for b in bars if "reconstruct" in b["bar"])
    assert fold["verdict"] == "n/a" and fold["value"] is None  # a wrong or missing kernel proves nothing


def test_markdown_rendering():
    recs = _synthetic([(8, 128 * K)], {2: 0.3, 4: 0.5})
    recs.append(bench_record(8, 128 * K, 16, "cudnn_sdpa", None, status="missing: No available kernel"))
    recs.append(bench_record(8, 128 * K, 16, "foscar_bf16", 777.0, status="wrong: slice error 1.0"))
    skipped = [{"B": 64, "L": 128 * K, "reason": "needs 36.0 GB > budget 20.0 GB (--max-gb)"}]
    checks = [{"bits": 2, "k_axis": "token", "v_axis": "token", "kernel": "foscar_folded", "status": "pass",
               "err": 1e-3, "bf16_err": 3e-3, "ratio": 0.33}]
    md = bd.render_markdown(bench_result(recs, skipped=skipped, checks=checks), detailed=True)
    fold2 = recs[1]
    assert f"| 8 | 128K | INT2 | tok/tok | {fold2['median_us']:.1f} | 30% | " in md
    assert "| 8 | 128K | INT4 | tok/tok |" in md and "1.20x" in md  # recon/folded
    assert "missing" in md and "777.0!" in md
    assert "| 64 | 128K | skipped: needs 36.0 GB" in md
    assert "- cudnn_sdpa: missing: No available kernel" in md
    assert "- foscar_bf16: B=8 L=128K wrong: slice error 1.0" in md
    assert "Read ceiling: 4.00 TB/s" in md and "| pass | 1.00e-03 |" in md
    assert "### Every record" in md and "Command: `python3 bench_decode.py`" in md
    compact = bd.render_markdown(bench_result(recs))
    assert "### Every record" not in compact and "profiled kernel time (no host gaps" not in compact
    recs[0]["kernel_us"], recs[1]["kernel_us"] = 900.0, 300.0  # FlashInfer-tc and folded INT2
    timed = bd.render_markdown(bench_result(recs))
    assert f"| {fold2['median_us']:.1f} (300.0) |" in timed
    assert "by profiled kernel time (no host gaps; not what the bars use): foscar_folded INT2 3.00x (1/13)" in timed
    table = [line for line in compact.splitlines() if line.startswith("| 8 | 128K |")]
    assert len(table) == 2  # one row per (shape, bits)
    assert all(line.count("|") == len(table[0].split("|")) - 1 for line in table)


def test_failures_are_wrong_error_and_failed_checks_not_missing():
    recs = [bench_record(1, 8 * K, 2, "foscar_folded", 1.0), bench_record(1, 8 * K, 16, "flashinfer", None, "missing: no wheel")]
    assert bd.failures(bench_result(recs)) == []
    recs.append(bench_record(1, 8 * K, 16, "cudnn_sdpa", None, "error: first call: RuntimeError: x"))
    recs.append(bench_record(1, 8 * K, 4, "foscar_folded", 2.0, "wrong: 1 non-finite outputs"))
    checks = [{"bits": 2, "k_axis": "token", "v_axis": "token", "kernel": "foscar_reconstruct", "status": "FAIL: x"}]
    assert len(bd.failures(bench_result(recs, checks=checks, fatal=["lost"]))) == 4


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
