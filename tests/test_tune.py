"""``foscar tune`` on the CPU: the dry run, the refusal without a GPU, and the whole loop with the GPU
hooks stood in (decode by the reference backend, fake times): checks before timing, the fastest
config chosen, the per-GPU file merged."""
import json

import pytest
import torch

import foscar
from foscar import autotune, cli, tune


def test_dry_run_lists_cases_and_candidates(capsys):
    assert cli.main(["tune", "--dry-run", "--shapes", "8:32K", "1:100", "--bits", "2", "4", "--k-axis", "token",
                     "channel"]) == 0
    out = capsys.readouterr().out
    assert out.count("B=8 L=32K") == 4 and "B=1 L=128 " in out  # 100 tokens rounded up to whole 128-token groups
    assert "'num_splits'" in out and "'num_warps': 8" in out


def test_refuses_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(["--preset", "quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("bad", (["--shapes", "8x32K"], ["--heads", "30:8"], ["--bits", "3"]))
def test_bad_flags_are_refused(bad):
    with pytest.raises(SystemExit):
        tune.main(bad + ["--dry-run"])


def _stand_in_for_the_gpu(monkeypatch):
    monkeypatch.setattr(tune, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU 9000")


def test_the_loop_checks_times_picks_and_writes(tmp_path, monkeypatch, capsys):
    _stand_in_for_the_gpu(monkeypatch)
    times, called, first_calls = {}, {}, []

    def fake_decode(q, cache, config, backend, out):
        called["config"] = config
        if str(config) not in first_calls:  # every candidate's first call writes a NaN-poisoned output
            first_calls.append(str(config))
            assert torch.isnan(out).all()
        if config["num_warps"] == 8:
            return out  # unwritten: caught by the check (non-finite outputs) and never timed
        out.copy_(foscar.decode(q, cache, backend="reference"))
        if config["prefetch"] == 2 and config["num_splits"] == 2:
            out.mul_(1.5)  # a wrong candidate: must be caught by the check and never timed
        return out

    def fake_time(run, *, iters, warmup, flush, cuda_graph):
        assert cuda_graph  # the tuner times graph replays
        run()
        cfg = called["config"]
        us = 100.0 / cfg["num_splits"] + cfg["num_warps"]  # more splits: faster here
        times[str(cfg)] = us
        return {"median_us": us, "min_us": us, "all_us": [us]}

    monkeypatch.setattr(tune, "_decode", fake_decode)
    monkeypatch.setattr(tune, "_time", fake_time)
    argv = ["--shapes", "2:256", "--bits", "4", "--heads", "4:2", "--head-dim", "64", "--group-size", "64",
            "--out", str(tmp_path)]
    assert tune.main(argv) == 0
    captured = capsys.readouterr()
    assert "wrong output (slice error" in captured.err and "| case |" in captured.out
    assert "wrong output (512 non-finite outputs" in captured.err  # all B * Hq * D = 2 * 4 * 64 unwritten
    assert all("'num_warps': 8" not in cfg and not ("'num_splits': 2" in cfg and "'prefetch': 2" in cfg)
               for cfg in times)  # the candidates that failed the check were never timed
    doc = json.loads((tmp_path / "Fake_GPU_9000.json").read_text())
    assert doc["schema"] == autotune.SCHEMA and len(doc["entries"]) == 1
    entry = doc["entries"][0]
    fastest = min((v, k) for k, v in times.items())
    assert entry["us"] == fastest[0] and entry["config"]["num_warps"] == 4
    assert entry["key"]["gpu"] == "Fake_GPU_9000" and entry["key"]["batch_bucket"] == 2
    assert entry["candidates"] == len(tune.candidates(tune.cases(tune.build_parser().parse_args(argv))[0],
                                                      torch.device("cpu")))
    # a second run merges, and the launcher's lookup finds the entry
    assert tune.main(argv) == 0
    assert len(json.loads((tmp_path / "Fake_GPU_9000.json").read_text())["entries"]) == 1
    monkeypatch.setenv("FOSCAR_TUNING_DIR", str(tmp_path))
    key = autotune.make_key("triton", "Fake GPU 9000", foscar.KVFormat(bits=4, head_dim=64, group_size=64), 2, 64,
                            2, 256)
    assert autotune.lookup(key)[0] == entry["config"]


def test_cute_candidates_and_entries(tmp_path, monkeypatch, capsys):
    """--backend cute: v0 first (the launcher's default), then v1 with two CTAs per SM and with one, each at
    its own split heuristic; the entries are keyed by backend 'cute', where the CuTe launcher reads them."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")
    assert tune.main(["--dry-run", "--backend", "cute", "--shapes", "8:32K", "--bits", "4"]) == 0
    out = capsys.readouterr().out
    assert "'warp_specialized': False" in out and "'ctas_per_sm': 2" in out and "'ctas_per_sm': 1" in out
    _stand_in_for_the_gpu(monkeypatch)
    called = {}

    def fake_decode(q, cache, config, backend, out):
        called["config"] = config
        return foscar.decode(q, cache, backend="reference", out=out)

    def fake_time(run, **kw):
        run()
        us = 10.0 - called["config"].get("ctas_per_sm", 0)
        return {"median_us": us, "min_us": us, "all_us": [us]}
    monkeypatch.setattr(tune, "_decode", fake_decode)
    monkeypatch.setattr(tune, "_time", fake_time)
    assert tune.main(["--backend", "cute", "--shapes", "2:256", "--bits", "4", "--heads", "4:2", "--head-dim", "64",
                      "--group-size", "64", "--out", str(tmp_path)]) == 0
    entry = json.loads((tmp_path / "Fake_GPU_9000.json").read_text())["entries"][0]
    assert entry["key"]["backend"] == "cute" and entry["config"]["ctas_per_sm"] == 2


def test_a_step_is_tuned_under_its_causal_mask(tmp_path, monkeypatch, capsys):
    """``--q-len 4``: each candidate decodes a step ``q [B, 4, Hq, D]`` into a NaN-poisoned output and is held to
    the oracle's causal step (a candidate that lets every token see the whole cache is caught, never timed); the
    entry is keyed by ``q_len``, apart from the one-token entry of the same shape."""
    _stand_in_for_the_gpu(monkeypatch)
    called = {}

    def fake_decode(q, cache, config, backend, out):
        called["config"] = config
        assert q.shape[1] == 4 and torch.isnan(out).all() or "timed" in called
        if config["num_splits"] == 1 and config["prefetch"] == 2:  # not causal: each token over the whole cache
            for j in range(q.shape[1]):
                out[:, j] = foscar.decode(q[:, j].contiguous(), cache, backend="reference")
            return out
        return foscar.decode(q, cache, backend="reference", out=out)

    def fake_time(run, **kw):
        called["timed"] = True
        run()
        cfg = called["config"]
        us = 10.0 + cfg["num_splits"] - cfg["prefetch"]  # the non-causal candidate would be the fastest
        return {"median_us": us, "min_us": us, "all_us": [us]}
    monkeypatch.setattr(tune, "_decode", fake_decode)
    monkeypatch.setattr(tune, "_time", fake_time)
    argv = ["--shapes", "2:64", "--bits", "4", "--heads", "4:2", "--head-dim", "64", "--group-size", "64",
            "--out", str(tmp_path), "--q-len", "1", "4"]
    assert tune.main(argv) == 0
    captured = capsys.readouterr()
    assert "q_len=4" in captured.out and captured.err.count("wrong output (slice error") == 1
    entries = json.loads((tmp_path / "Fake_GPU_9000.json").read_text())["entries"]
    assert sorted(e["key"].get("q_len", 1) for e in entries) == [1, 4]
    step = next(e for e in entries if e["key"].get("q_len") == 4)
    assert (step["config"]["num_splits"], step["config"]["prefetch"]) != (1, 2)


def test_a_step_the_backend_runs_in_parts_is_refused_by_name(capsys):
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")
    with pytest.raises(SystemExit):
        tune.main(["--backend", "cute", "--shapes", "8:32K", "--heads", "32:4", "--q-len", "8", "--dry-run"])
    assert "argument --q-len: 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--q-len", "9", "--dry-run"])


def test_a_backends_step_launch_writes_the_steps_output():
    """:meth:`foscar.backends.base.Backend.launch_step` (what the tuner times for a step): the decode of ``q [B,
    q_len, Hq, D]`` into the given output, as ``foscar.decode`` gives it."""
    from foscar import backends
    fmt = foscar.KVFormat(bits=4, head_dim=64, group_size=64)
    cache = foscar.quantize_kv(torch.randn(2, 2, 128, 64), torch.randn(2, 2, 128, 64), fmt, page_size=64)
    q = torch.randn(2, 3, 4, 64)
    out = torch.full_like(q, float("nan"))
    got = backends.get("reference").launch_step(q, cache, {"out": out})
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, foscar.decode(q, cache, backend="reference"))
