"""CPU tests of the decode benchmark's driver (foscar.bench): check, then time; its read-ceiling kernel (Triton
interpreter); the driver end to end with fake CUDA timing and a fake foscar.triton; interleaved timing rounds."""
import csv
import functools
import json
import math
import os
import subprocess
import sys
import time
import types

import pytest
import torch
from _fake_gpu import CPU_TARGET, FakeEvent, fake_triton_module, stand_in, use_triton
from _helpers import bench_record, bench_result

import foscar
import foscar.bench.decode as bd
from foscar import backends
from foscar.backends import BackendStatus
from foscar.bench.kernels import problem_key
K = 1024


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
                     "foscar_cute_e4m3x3": "BackendKernel", "foscar_cute_e4m3d4": "BackendKernel",
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
@pytest.fixture
def fake_gpu(monkeypatch):
    """``use(module)``: foscar.triton replaced by ``module``, CUDA's host calls stood in for
    (:func:`_fake_gpu.stand_in`); run the driver with ``bd.main(argv, target=CPU_TARGET)``."""
    stand_in(monkeypatch)
    return functools.partial(use_triton, monkeypatch)


def test_driver_end_to_end(fake_gpu, tmp_path, capsys):
    fake_gpu(fake_triton_module())
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
    fake_gpu(fake_triton_module(folded_ok=False))
    argv = ["--grid", "quick", "--bits", "4", "--check", "--out", str(tmp_path), "--max-gb", "100"]
    assert bd.main(argv, target=CPU_TARGET) == 1
    result = json.loads((tmp_path / "bench_decode.json").read_text())
    assert result["records"] == [] and result["checks"][0]["status"].startswith("FAIL: ")
    assert "--check failed" in capsys.readouterr().err


def test_driver_flags_wrong_outputs_untimed_and_skips_loudly(fake_gpu, tmp_path):
    fake_gpu(fake_triton_module(folded_ok=False))
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
    recs = [dict(bench_record(1, 8 * K, 2, "foscar_folded", 5.0), host_sync=True)]
    recs.append(dict(bench_record(1, 8 * K, 4, "foscar_folded", 5.0), kernel_time_error="RuntimeError: no CUPTI"))
    md = bd.render_markdown(bench_result(recs))
    assert "- note: foscar_folded waits for the GPU inside the call" in md
    assert "- note: foscar_folded: no profiled kernel time: RuntimeError: no CUPTI" in md
    assert bd.failures(bench_result(recs)) == []  # a note, not a failure


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
              "foscar_cute_e4m3d4", "foscar_auto",
              "foscar_auto_rotated", "flashinfer_fp8",
              "flashinfer_nvfp4", "fa4")  # named
    assert args.kernels == [k for k in bd.KERNELS if k not in opt_in]


# ---- interleaved rounds -----------------------------------------------------------------------
def test_interleaved_timing_takes_every_call_once_a_round_after_a_flush(monkeypatch):
    """``time_interleaved``: the warm-up calls first, then rounds in which each call runs once, in order, right
    after an L2 flush, timed alone; a call slowed in one round only moves its own median."""
    import foscar.bench.common as common
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
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
