"""The autotune cache (foscar.autotune): keys, buckets, lookup order, nearest bucket, bad files, validity
per entry and backend, the shipped H200 file, the report of ``foscar info``, merges and concurrent
writers. CPU only."""
import json
import multiprocessing as mp
import os
import warnings
from collections import Counter
from dataclasses import asdict
from importlib import resources
from pathlib import Path

import pytest
import torch

import foscar
from foscar import autotune as at
from foscar.errors import InvalidArgumentError

FMT = foscar.KVFormat(bits=4, head_dim=128, group_size=128)
GPU = "NVIDIA H200"
ROOT = Path(__file__).resolve().parents[1]
SHIPPED_FOLDER = at.shipped_folder  # the package data, which the fixture below hides


@pytest.fixture(autouse=True)
def dirs(tmp_path, monkeypatch):
    """An empty $FOSCAR_TUNING_DIR, user cache and package data folder (the tests that read the shipped
    file put :data:`SHIPPED_FOLDER` back)."""
    monkeypatch.setenv("FOSCAR_TUNING_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(at, "shipped_folder", lambda: tmp_path / "shipped")
    at._WARNED.clear()
    return tmp_path


def installed(monkeypatch, triton, cutlass_dsl):
    """Stand in for the installed Triton and nvidia-cutlass-dsl versions."""
    monkeypatch.setattr(at, "_dist_version", {"triton": triton, "nvidia-cutlass-dsl": cutlass_dsl}.get)
    at._WARNED.clear()


def tuning_doc(meta, entries) -> str:
    return json.dumps({"schema": at.SCHEMA, "meta": {"gpu": "NVIDIA_H200", **meta}, "entries": entries})


def key(batch=8, length=32768, **kw):
    return at.make_key(kw.pop("backend", "triton"), kw.pop("gpu", GPU), kw.pop("fmt", FMT), kw.pop("gqa", 4),
                       kw.pop("page", 64), batch, length, kw.pop("q_len", 1))


@pytest.mark.parametrize("name,want", [("NVIDIA H200", "NVIDIA_H200"), ("NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3"),
                                       (" NVIDIA  A100-SXM4-40GB ", "NVIDIA_A100-SXM4-40GB"), ("a/b\\c", "a_b_c")])
def test_gpu_names_are_normalised(name, want):
    assert at.normalize_gpu_name(name) == want


def test_buckets():
    assert [at.bucket(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert at.bucket(100, at.CTX_MIN) == 1024 and at.bucket(131072, at.CTX_MIN) == 131072
    k = key(batch=9, length=40000)
    assert (k.batch_bucket, k.ctx_bucket, k.gpu) == (16, 65536, "NVIDIA_H200")
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="^n: expected"):
            at.bucket(bad)
    with pytest.raises(InvalidArgumentError, match="^name: expected"):
        at.normalize_gpu_name("  ")


def test_round_trip_and_nearest_bucket(dirs):
    at.write_entries(dirs / "env", GPU, [(key(8, 32768), {"num_splits": 16}, {"us": 1.0}),
                                         (key(64, 131072), {"num_splits": 2}, {})])
    assert at.lookup(key(8, 32768))[0] == {"num_splits": 16}
    assert at.lookup(key(16, 65536))[0] == {"num_splits": 16}  # 2 powers of two from the first, 4 from the second
    assert at.lookup(key(64, 100000))[0] == {"num_splits": 2}
    config, source = at.lookup(key(8, 32768, gqa=8))  # another family: nothing tuned
    assert (config, source) == ({}, "heuristic")


def test_lookup_order_env_then_user_cache_then_heuristic(dirs, monkeypatch):
    at.write_entries(dirs / "xdg" / "foscar" / "tuning", GPU, [(key(), {"num_warps": 8}, {})])
    config, source = at.lookup(key())
    assert config == {"num_warps": 8} and "xdg" in source
    at.write_entries(dirs / "env", GPU, [(key(), {"num_warps": 4}, {})])
    assert at.lookup(key())[0] == {"num_warps": 4}
    monkeypatch.delenv("FOSCAR_TUNING_DIR")
    assert at.lookup(key())[0] == {"num_warps": 8}


@pytest.mark.parametrize("content,why", [
    ('{"schema": "foscar-tuning-v1", "meta": {"gpu": "NVIDIA_H200"}, "entries": [{"key": ', "malformed"),
    ('{"schema": "something-else"}', "not a foscar-tuning-v1 file"),
    ("[1, 2, 3]", "not a foscar-tuning-v1 file"),
    ('{"schema": "foscar-tuning-v1", "meta": {"gpu": "NVIDIA A100"}, "entries": []}', "written for GPU"),
    ('{"schema": "foscar-tuning-v1", "meta": {"gpu": "NVIDIA_H200", "foscar": "9.9.0"}, "entries": []}',
     "written by another version: foscar 9.9.0"),
    ('{"schema": "foscar-tuning-v1", "meta": {"gpu": "NVIDIA_H200"}, "entries": [{"key": {"backend": "triton"}, '
     '"config": {}}]}', "malformed"),
    (tuning_doc({}, [{"key": {**asdict(key()), "batch_bucket": 0}, "config": {}}]), "malformed"),
    (tuning_doc({}, [{"key": asdict(key()), "config": {}, "versions": "3.6.0"}]), "malformed"),
])
def test_a_bad_file_warns_once_and_falls_back(dirs, content, why):
    at.write_entries(dirs / "xdg" / "foscar" / "tuning", GPU, [(key(), {"num_splits": 3}, {})])
    bad = dirs / "env" / "NVIDIA_H200.json"
    bad.parent.mkdir(parents=True)
    bad.write_text(content)
    with pytest.warns(RuntimeWarning, match=why) as record:
        assert at.lookup(key())[0] == {"num_splits": 3}  # the whole bad file skipped, the next folder used
    assert str(bad) in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert at.lookup(key())[0] == {"num_splits": 3}  # one warning per file


def test_a_file_that_is_not_utf8_is_skipped_whole(dirs):
    bad = dirs / "env" / "NVIDIA_H200.json"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b'{"schema": "\xff"}')
    with pytest.warns(RuntimeWarning, match="not UTF-8"):
        assert at.lookup(key()) == ({}, "heuristic")


def test_search_path_env_then_user_cache_then_package_data(dirs, monkeypatch):
    monkeypatch.setattr(at, "shipped_folder", SHIPPED_FOLDER)
    path = at.search_path()
    assert [s.origin for s in path] == ["$FOSCAR_TUNING_DIR", "user cache", "package data"]
    assert (path[0].folder, path[1].folder) == (dirs / "env", dirs / "xdg" / "foscar" / "tuning")
    assert path[2].file(GPU).is_file() and at.user_dir() == dirs / "env"
    monkeypatch.delenv("FOSCAR_TUNING_DIR")
    assert [s.origin for s in at.search_path()] == ["user cache", "package data"]
    assert at.user_dir() == dirs / "xdg" / "foscar" / "tuning"


def test_validity_is_per_entry_and_backend(dirs):
    """A Triton entry from another Triton and a CuTe entry from the installed cutlass-dsl, in one file whose
    metadata records both versions: the CuTe entry applies, the Triton one does not (one warning)."""
    here = at.current_meta(GPU)
    cute_config = {"warp_specialized": True, "ctas_per_sm": 2, "num_splits": 5}
    path = dirs / "env" / "NVIDIA_H200.json"
    path.parent.mkdir(parents=True)
    path.write_text(tuning_doc({"foscar": foscar.__version__, "triton": "2.0.0", "cutlass_dsl": here["cutlass_dsl"]},
                               [{"key": asdict(key()), "config": {"num_splits": 7}},
                                {"key": asdict(key(backend="cute")), "config": cute_config, "us": 1.0}]))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            config, source = at.lookup(key(backend="cute"))
            assert config == cute_config and source.startswith(str(path))
            assert at.lookup(key()) == ({}, "heuristic")
    assert len(record) == 1
    message = str(record[0].message)
    assert str(path) in message and "1 triton entry tuned with triton 2.0.0" in message
    assert at.read_file(path, GPU) == [(key(backend="cute"), cute_config)]
    # the stale Triton entry does not hide a valid one in the next folder
    at.write_entries(dirs / "xdg" / "foscar" / "tuning", GPU, [(key(), {"num_splits": 3}, {})])
    config, source = at.lookup(key())
    assert config == {"num_splits": 3} and "xdg" in source


def test_a_merge_keeps_the_versions_entries_were_tuned_with(dirs, monkeypatch):
    installed(monkeypatch, "3.6.0", "4.8.1")
    at.write_entries(dirs / "env", GPU, [(key(), {"num_splits": 1}, {}), (key(backend="cute"), {"num_splits": 2}, {})])
    installed(monkeypatch, "3.8.1", "4.8.1")
    path = at.write_entries(dirs / "env", GPU, [(key(64), {"num_splits": 3}, {"us": 2.0})])
    doc = json.loads(path.read_text())
    assert doc["meta"]["triton"] == "3.8.1"
    assert {(e["key"]["backend"], e["key"]["batch_bucket"]): e["versions"] for e in doc["entries"]} == {
        ("triton", 8): {"triton": "3.6.0"}, ("cute", 8): {"cutlass_dsl": "4.8.1"}, ("triton", 64): {"triton": "3.8.1"}}
    with pytest.warns(RuntimeWarning, match=r"1 triton entry tuned with triton 3\.6\.0 \(installed: 3\.8\.1\)"):
        assert at.lookup(key())[0] == {"num_splits": 3}  # the nearest entry that applies
    assert at.lookup(key(backend="cute"))[0] == {"num_splits": 2}
    installed(monkeypatch, "3.6.2", "4.8.2")  # Triton: major.minor; cutlass-dsl: the exact version
    with pytest.warns(RuntimeWarning, match=r"1 triton entry tuned with triton 3\.8\.1 \(installed: 3\.6\.2\)"):
        assert at.lookup(key())[0] == {"num_splits": 1}
    with pytest.warns(RuntimeWarning, match=r"1 cute entry tuned with nvidia-cutlass-dsl 4\.8\.1 \(installed: 4\.8\.2"):
        assert at.lookup(key(backend="cute")) == ({}, "heuristic")
    installed(monkeypatch, "3.6.2", None)
    with pytest.warns(RuntimeWarning, match="which is not installed"):
        assert at.lookup(key(backend="cute")) == ({}, "heuristic")


def test_the_shipped_h200_file_is_package_data_and_applies_per_backend(monkeypatch):
    monkeypatch.setattr(at, "shipped_folder", SHIPPED_FOLDER)
    res = resources.files("foscar.tuning").joinpath("NVIDIA_H200.json")
    assert res.is_file() and not (ROOT / "tuning" / "configs").exists()  # one copy, in the package
    doc = json.loads(res.read_text())
    meta = doc["meta"]
    assert doc["schema"] == at.SCHEMA and (meta["gpu"], meta["triton"], meta["cutlass_dsl"]) == (
        "NVIDIA_H200", "3.6.0", "4.8.1")
    assert at.meta_mismatch(meta, {"foscar": foscar.__version__}) is None  # this foscar reads it
    # the paper grid's 26 cases a backend; GQA 16 and 32 at B 8, L 128K (INT2 and INT4) of both backends; the CuTe
    # kernel's channel-wise axes of the axes grid (24); its steps of 2, 4 and 8 tokens at GQA 4 (24: B 8 and 64, L 32K
    # and 128K, INT2 and INT4)
    assert Counter(e["key"]["backend"] for e in doc["entries"]) == {"triton": 30, "cute": 78}
    assert Counter(e["key"].get("q_len", 1) for e in doc["entries"]) == {1: 84, 2: 8, 4: 8, 8: 8}
    assert sorted((e["key"]["gqa"], e["key"]["bits"]) for e in doc["entries"] if e["key"]["gqa"] != 4) == sorted(
        2 * [(16, 2), (16, 4), (32, 2), (32, 4)])
    assert sum(e["key"]["backend"] == "cute" and "channel" in (e["key"]["k_axis"], e["key"]["v_axis"])
               for e in doc["entries"]) == 24
    # every CuTe entry names the variant it was timed as (a default left open would be another entry's)
    from foscar.cute.config import config_for  # plain Python: the variant is one the kernels take
    for e in (e for e in doc["entries"] if e["key"]["backend"] == "cute"):
        k, c = e["key"], e["config"]
        assert {"warp_specialized", "k_operand", "tiles_per_pass"} <= set(c), e
        fmt = foscar.KVFormat(bits=k["bits"], head_dim=k["head_dim"], group_size=k["group"], k_axis=k["k_axis"],
                              v_axis=k["v_axis"])
        config_for(fmt, k["gqa"], k["page"], c["k_operand"], c["tiles_per_pass"], k.get("q_len", 1))
    tuned = {e["key"]["backend"]: e["config"] for e in doc["entries"]
             if {"q_len": 1, **e["key"], "backend": "triton"} == asdict(key())}  # B = 8, L = 32K, INT4, GQA 4, page 64
    installed(monkeypatch, "3.6.1", "4.8.1")
    for backend in ("triton", "cute"):
        config, source = at.lookup(key(backend=backend))
        assert config == tuned[backend] and source.startswith(str(res))
    installed(monkeypatch, "3.8.0", "4.8.1")
    with pytest.warns(RuntimeWarning, match="30 triton entries tuned with triton 3.6.0"):
        assert at.lookup(key()) == ({}, "heuristic")
    assert at.lookup(key(backend="cute"))[0] == tuned["cute"]


def test_tuning_report(dirs, monkeypatch):
    monkeypatch.setattr(at, "shipped_folder", SHIPPED_FOLDER)
    installed(monkeypatch, "3.8.0", "4.8.1")
    at.write_entries(dirs / "env", GPU, [(key(), {"num_splits": 2}, {})])
    (dirs / "xdg" / "foscar" / "tuning").mkdir(parents=True)
    (dirs / "xdg" / "foscar" / "tuning" / "NVIDIA_H200.json").write_text("{")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = at.tuning_report(GPU)
    env, user, shipped = report.files
    assert [f.origin for f in report.files] == ["$FOSCAR_TUNING_DIR", "user cache", "package data"]
    assert (report.gpu, env.backends) == ("NVIDIA_H200", (at.BackendTuning("triton", 1, 1),))
    assert user.exists and "malformed JSON" in user.skipped
    assert shipped.location.endswith(os.path.join("foscar", "tuning", "NVIDIA_H200.json"))
    assert shipped.meta["triton"] == "3.6.0" and shipped.backends == (
        at.BackendTuning("triton", 30, 0, (("tuned with triton 3.6.0 (installed: 3.8.0)", 30),)),
        at.BackendTuning("cute", 78, 78))
    assert report.in_use("triton") is env and report.in_use("cute") is shipped
    text = "\n".join(report.lines())
    assert "tuning files for NVIDIA_H200 (triton 3.8.0, nvidia-cutlass-dsl 4.8.1)" in text
    assert f"user cache: {user.location}: skipped as a whole: malformed JSON" in text
    assert f"package data: {shipped.location} (written with foscar 0.1.0, triton 3.6.0" in text
    assert "triton: 30 entries, 0 apply here; not: 30 tuned with triton 3.6.0 (installed: 3.8.0)" in text
    assert "cute: 78 entries, 78 apply here" in text
    assert "in use: triton: $FOSCAR_TUNING_DIR; cute: package data" in text
    monkeypatch.delenv("FOSCAR_TUNING_DIR")
    monkeypatch.setattr(at, "shipped_folder", lambda: dirs / "shipped")
    lines = at.tuning_report("NVIDIA A100-SXM4-40GB").lines()
    assert "$FOSCAR_TUNING_DIR: not set" in lines[1] and lines[-2].endswith("NVIDIA_A100-SXM4-40GB.json: none")
    assert lines[-1] == "  in use: triton: none (the launcher heuristic); cute: none (the launcher heuristic)"


def test_merge_replaces_equal_keys_and_keeps_the_rest(dirs):
    at.write_entries(dirs / "env", GPU, [(key(8), {"num_splits": 1}, {}), (key(64), {"num_splits": 2}, {"us": 5.0})])
    path = at.write_entries(dirs / "env", GPU, [(key(8), {"num_splits": 9}, {"us": 3.0})])
    doc = json.loads(path.read_text())
    assert doc["schema"] == at.SCHEMA and doc["meta"]["foscar"] == foscar.__version__
    got = {e["key"]["batch_bucket"]: (e["config"]["num_splits"], e.get("us")) for e in doc["entries"]}
    assert got == {8: (9, 3.0), 64: (2, 5.0)}  # a kept entry keeps its measured times
    assert {p.name for p in (dirs / "env").iterdir()} == {path.name, path.name + ".lock"}  # no temporary left


def _writer(directory, i):
    at.write_entries(directory, GPU, [(key(batch=2 ** i), {"num_splits": i}, {})])


def test_concurrent_writers_never_tear_the_file(dirs):
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(dirs / "env", i)) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    entries = at.read_file(dirs / "env" / "NVIDIA_H200.json", GPU)
    assert sorted(c["num_splits"] for _, c in entries) == list(range(8))


def test_the_launchers_read_their_backends_tuned_config(dirs, monkeypatch):
    """Each backend reads its own entries: a Triton entry is not a CuTe one."""
    from foscar.cute import launch as cute_launch
    from foscar.triton import launch
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: GPU)
    at.clear_lookup_cache()
    q = torch.zeros(8, 32, 128)
    cache = foscar.quantize_kv(torch.randn(8, 8, 64, 128), torch.randn(8, 8, 64, 128), FMT, page_size=64)
    assert at.tuned_config("triton", q, cache, 4) == {}
    at.write_entries(dirs / "env", GPU, [(key(8, 64), {"num_splits": 5, "num_warps": 8}, {}),
                                         (key(8, 64, backend="cute"), {"warp_specialized": True, "ctas_per_sm": 2,
                                                                        "num_splits": 3}, {})])
    at.clear_lookup_cache()
    assert at.tuned_config("triton", q, cache, 4) == {"num_splits": 5, "num_warps": 8}
    assert launch.launch_config(q, cache, 4)[1:3] == (5, 8)
    assert cute_launch.launch_config(q, cache, 4) == (True, 2, 3, "bf16", 1, None)
    assert cute_launch.launch_config(q, cache, 4, num_splits=7, warp_specialized=False) == (False, 2, 7, "bf16", 1, None)
    # another variant than the tuned one: the heuristic split count, not the one tuned for v1 at 2 CTAs
    heuristic = cute_launch.default_num_splits(8, 8, 1, q.device, cute_launch.V0_RESIDENT)
    assert cute_launch.launch_config(q, cache, 4, warp_specialized=False) == (False, 2, heuristic, "bf16", 1, None)
    assert cute_launch.launch_config(q, cache, 4, ctas_per_sm=1)[1:3] == (
        1, cute_launch.default_num_splits(8, 8, 1, q.device, 1))
    assert cute_launch.launch_config(q, cache, 4, warp_specialized=True, ctas_per_sm=2) == (True, 2, 3, "bf16", 1, None)
    # E4M3 K operands or two tiles per pass asked for: the entry tuned for BF16 ones, one tile a pass, does not
    # apply; the untuned v1 default is E4M3 K with two tiles a pass where the format takes them
    assert cute_launch.launch_config(q, cache, 4, k_operand="e4m3")[2:5] == (
        cute_launch.default_num_splits(8, 8, 1, q.device, 2), "e4m3", 2)
    assert cute_launch.launch_config(q, cache, 4, tiles_per_pass=2)[2:5] == (
        cute_launch.default_num_splits(8, 8, 1, q.device, 2), "e4m3", 2)
    assert cute_launch.launch_config(q, cache, 4, k_operand="bf16", tiles_per_pass=1)[3:5] == ("bf16", 1)
    assert cute_launch.launch_config(q, cache, 4, use_tuned=False)[3:] == ("e4m3", 2, None)
    assert cute_launch.default_variant(cache.fmt, 8, cache.page_size) == ("e4m3", 1)  # gqa 8: term blocks, one tile
    assert cute_launch.default_variant(cache.fmt, 32, cache.page_size) == ("e4m3", 1)  # gqa 32: term blocks too
    assert cute_launch.default_variant(cache.fmt, 2, cache.page_size, step=2) == ("bf16", 1)  # 4 rows, 2 tokens: neither
    assert cute_launch.default_variant(cache.fmt, 4, cache.page_size, "bf16") == ("bf16", 2)
    assert cute_launch.launch_config(q, cache, 4, use_tuned=False)[0] is cute_launch.DEFAULT_WARP_SPECIALIZED
    with pytest.raises(InvalidArgumentError, match="^warp_specialized: expected"):
        cute_launch.launch_config(q, cache, 4, warp_specialized=1)
    with pytest.raises(InvalidArgumentError, match="^ctas_per_sm: expected"):
        cute_launch.launch_config(q, cache, 4, ctas_per_sm=3)
    with pytest.raises(InvalidArgumentError, match="^tiles_per_pass: expected"):
        cute_launch.launch_config(q, cache, 4, tiles_per_pass=3)
    with pytest.raises(InvalidArgumentError, match="^tiles_per_pass: expected 1 with warp_specialized=False"):
        cute_launch.launch_config(q, cache, 4, warp_specialized=False, tiles_per_pass=2)
    with pytest.raises(InvalidArgumentError, match="^stages: expected None with warp_specialized=False"):
        cute_launch.launch_config(q, cache, 4, warp_specialized=False, stages=8)
    with pytest.raises(InvalidArgumentError, match="^stages: expected an int"):
        cute_launch.launch_config(q, cache, 4, stages=8.0)
    with pytest.raises(InvalidArgumentError, match=r"^stages: expected one of \(4, 8, 16\)"):
        cute_launch.launch_config(q, cache, 4, stages=6)
    at.clear_lookup_cache()

def test_cute_tuning_candidates_name_their_variant(dirs, monkeypatch):
    """Every candidate of ``foscar tune --backend cute`` gives the K operands and tiles per pass, so that a
    tuned entry already on file for the case (here E4M3 K, two tiles a pass) does not decide what a
    candidate runs: each launches the variant it is recorded as."""
    from foscar import backends, tune
    from foscar.cute import launch as cute_launch
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: GPU)
    argv = ["--backend", "cute", "--shapes", "8:4096", "--bits", "2", "--out", str(dirs / "env")]
    case = tune.cases(tune.build_parser().parse_args(argv))[0]
    q = torch.zeros(8, 32, 128)
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128)
    cache = foscar.quantize_kv(torch.randn(8, 8, 64, 128), torch.randn(8, 8, 64, 128), fmt, page_size=64)
    at.write_entries(dirs / "env", GPU, [(key(8, 64, backend="cute", fmt=fmt),
                                          {"warp_specialized": True, "ctas_per_sm": 2, "num_splits": 3,
                                           "k_operand": "e4m3", "tiles_per_pass": 2}, {})])
    at.clear_lookup_cache()
    assert cute_launch.launch_config(q, cache, 4)[3:] == ("e4m3", 2, None)
    cands = backends.get("cute").candidates(case, torch.device("cpu"))
    assert {(c["k_operand"], c["tiles_per_pass"]) for c in cands} == {("bf16", 1), ("e4m3", 1), ("bf16", 2),
                                                                      ("e4m3", 2)}
    # v1 at the format's stages (INT2, head dim 128: 8), and at 16 where the ring fits its CTAs (one an SM)
    assert {(c["ctas_per_sm"], c["stages"]) for c in cands if c["warp_specialized"]} == {(1, 8), (1, 16), (2, 8)}
    for c in cands:
        got = cute_launch.launch_config(q, cache, 4, **c)
        assert (got.k_operand, got.tiles_per_pass, got.num_splits, got.stages) == (
            c["k_operand"], c["tiles_per_pass"], c["num_splits"], c.get("stages"))


def test_cute_candidates_take_a_ring_their_ctas_hold():
    """With channel-wise K and V (two buffers of Q' a consumer) two CTAs an SM do not hold INT2's default ring of
    8: their candidates take 4, and every candidate's ring fits its CTAs (none is refused before it is timed)."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    from foscar import backends, tune
    from foscar.cute.budget import fits_shared_memory
    from foscar.cute.config import config_for
    argv = ["--backend", "cute", "--shapes", "8:128K", "--bits", "2", "--k-axis", "channel", "--v-axis", "channel"]
    case = tune.cases(tune.build_parser().parse_args(argv))[0]
    cands = [c for c in backends.get("cute").candidates(case, torch.device("cpu")) if c["warp_specialized"]]
    assert {(c["ctas_per_sm"], c["stages"]) for c in cands} == {(1, 8), (1, 16), (2, 4)}
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128, k_axis="channel", v_axis="channel")
    for c in cands:
        assert fits_shared_memory(config_for(fmt, 4, 64, c["k_operand"], c["tiles_per_pass"], stages=c["stages"]),
                                  c["ctas_per_sm"])


@pytest.mark.parametrize("producer", (False, True))
def test_cute_candidates_of_channel_wise_k_passes(monkeypatch, producer):
    """With the channel-wise switches on, ``foscar tune`` tries E4M3 K's passes of two tiles for channel-wise K and
    V (each at the BF16 kernel's splits), and one tile a pass only where the format takes it (not where the producer
    folds ``Q'``); every candidate's config is one ``config_for`` takes and its ring fits its CTAs."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    from _helpers import cute_switches
    from foscar import backends, tune
    from foscar.cute.budget import fits_shared_memory
    from foscar.cute.config import config_for
    argv = ["--backend", "cute", "--shapes", "8:32K", "--bits", "4", "--k-axis", "channel", "--v-axis", "channel"]
    case = tune.cases(tune.build_parser().parse_args(argv))[0]
    with cute_switches(monkeypatch, CHANNEL_K_E4M3=True, PAIR_CHANNEL_V=True, PRODUCER_Q_FOLD=producer):
        cands = [c for c in backends.get("cute").candidates(case, torch.device("cpu")) if c["warp_specialized"]]
        variants = {(c["k_operand"], c["tiles_per_pass"]) for c in cands}
        assert variants == ({("bf16", 1), ("e4m3", 2)} if producer else {("bf16", 1), ("e4m3", 1), ("e4m3", 2)})
        bf16 = {(c["ctas_per_sm"], c["num_splits"]) for c in cands if c["k_operand"] == "bf16"}
        assert bf16 <= {(c["ctas_per_sm"], c["num_splits"]) for c in cands if c["tiles_per_pass"] == 2}
        fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128, k_axis="channel", v_axis="channel")
        for c in cands:
            assert fits_shared_memory(config_for(fmt, 4, 64, c["k_operand"], c["tiles_per_pass"], stages=c["stages"]),
                                      c["ctas_per_sm"])


def test_a_launch_that_names_no_stages_takes_a_ring_its_ctas_hold():
    """``default_ring``: the format's default stages where the CTAs of an SM hold them, else the deepest choice
    below that they hold (what a decode without a tuned entry runs)."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    from foscar.cute.budget import default_ring, fits_shared_memory
    from foscar.cute.config import STAGE_CHOICES, config_for
    chan = foscar.KVFormat(bits=2, head_dim=128, group_size=128, k_axis="channel", v_axis="channel")
    assert config_for(chan, 4, 64).stages == 8 and not fits_shared_memory(config_for(chan, 4, 64), 2)
    assert default_ring(chan, 4, 64, ctas_per_sm=2).stages == 4
    assert default_ring(chan, 4, 64, ctas_per_sm=1).stages == 8
    with pytest.raises(InvalidArgumentError, match="ctas_per_sm"):
        default_ring(chan, 4, 64, ctas_per_sm=3)
    for fmt, gqa in ((foscar.KVFormat(bits=2, head_dim=128, group_size=128), 4),
                     (foscar.KVFormat(bits=4, head_dim=128, group_size=64, k_axis="channel"), 8),
                     (foscar.KVFormat(bits=2, head_dim=128, group_size=128), 32)):
        for ctas in (1, 2):
            cfg = default_ring(fmt, gqa, 64, ctas_per_sm=ctas)
            assert fits_shared_memory(cfg, ctas) or cfg.stages == min(STAGE_CHOICES)
            assert cfg.stages == config_for(fmt, gqa, 64).stages or not fits_shared_memory(
                config_for(fmt, gqa, 64, stages=2 * cfg.stages), ctas)


def test_triton_candidates_and_entries_name_the_lazy_rescale(dirs, monkeypatch):
    """``foscar tune --backend triton`` times the lazy rescale where the format takes it (token-wise V of one
    channel group) and records it in each candidate; an entry that names it decides a launch that does not, one
    that does not leaves the launcher's default; a call's own choice wins."""
    from foscar import backends, tune
    from foscar.triton import launch
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: GPU)
    argv = ["--backend", "triton", "--shapes", "8:4096", "--bits", "2", "--out", str(dirs / "env")]
    case = tune.cases(tune.build_parser().parse_args(argv))[0]
    cands = backends.get("triton").candidates(case, torch.device("cpu"))
    assert all(isinstance(c["lazy_rescale"], bool) for c in cands) and sum(c["lazy_rescale"] for c in cands) == 2
    channel = tune.cases(tune.build_parser().parse_args(argv + ["--v-axis", "channel"]))[0]
    assert not any(c["lazy_rescale"] for c in backends.get("triton").candidates(channel, torch.device("cpu")))
    q = torch.zeros(8, 32, 128)
    cache = foscar.quantize_kv(torch.randn(8, 8, 64, 128), torch.randn(8, 8, 64, 128), FMT, page_size=64)
    at.clear_lookup_cache()
    assert launch.launch_config(q, cache, 4).lazy_rescale is launch.LAZY_RESCALE
    at.write_entries(dirs / "env", GPU, [(key(8, 64), {"num_splits": 5, "num_warps": 4, "lazy_rescale": True}, {})])
    at.clear_lookup_cache()
    assert launch.launch_config(q, cache, 4).lazy_rescale is True
    assert launch.launch_config(q, cache, 4, lazy_rescale=False).lazy_rescale is False
    with pytest.raises(foscar.InvalidArgumentError, match="^lazy_rescale: expected True, False or None"):
        launch.launch_config(q, cache, 4, lazy_rescale=1)


@pytest.mark.parametrize("heads,shape,q_len", [("32:8", "8:32K", 1), ("32:8", "1:128K", 1), ("32:4", "8:16K", 1),
                                               ("32:1", "8:32K", 1), ("32:8", "8:32K", 2), ("32:8", "16:16K", 4),
                                               ("32:8", "8:128K", 8), ("32:4", "1:8K", 2)])
def test_the_cute_tuners_first_candidate_is_the_untuned_launch(heads, shape, q_len):
    """``foscar tune``'s first CuTe candidate (the time a tuned entry is held against) is what
    ``foscar.cute.launch.launch_config`` gives an untuned call of the same case, a step's included: variant, CTAs
    an SM, K operands, passes and split count."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")
    from foscar import backends, tune
    from foscar.bench import make_block_table, random_cache
    from foscar.cute import launch as cute_launch
    argv = ["--backend", "cute", "--shapes", shape, "--bits", "2", "--heads", heads, "--q-len", str(q_len)]
    case = tune.cases(tune.build_parser().parse_args(argv))[0]
    first = backends.get("cute").candidates(case, torch.device("cpu"))[0]
    table = make_block_table(case.batch, case.seq_len // case.page, "shuffled", 0)
    cache = random_cache(case.fmt, table, case.seq_len, kv_heads=case.kv_heads, page=case.page)
    q = torch.zeros(case.batch * q_len, case.q_heads, case.fmt.head_dim, dtype=torch.bfloat16)
    want = cute_launch.launch_config(q, cache, case.q_heads // case.kv_heads, use_tuned=False, step=q_len)
    assert (first["warp_specialized"], first["ctas_per_sm"], first["num_splits"], first["k_operand"],
            first["tiles_per_pass"]) == tuple(want)[:5]


def test_a_steps_entries_are_its_own_and_one_tokens_keys_are_written_as_before(dirs):
    """A step's entries (``q_len > 1``) are a family of their own: a one-token decode never reads them, a step
    reads only its length's; a one-token key is written without ``q_len``, as files always had it, and a key
    without it reads as ``q_len`` 1."""
    one, four = {"num_splits": 3}, {"num_splits": 9}
    path = at.write_entries(dirs / "env", GPU, [(key(8, 32768), one, {}), (key(8, 32768, q_len=4), four, {})])
    written = {json.dumps(e["key"], sort_keys=True): e["config"] for e in json.loads(path.read_text())["entries"]}
    assert sorted(written.values(), key=str) == [one, four]
    keys = [json.loads(k) for k in written]
    assert [k.get("q_len") for k in keys if "q_len" in k] == [4] and sum("q_len" not in k for k in keys) == 1
    assert at.lookup(key(8, 32768))[0] == one and at.lookup(key(8, 32768, q_len=4))[0] == four
    assert at.lookup(key(8, 32768, q_len=2)) == ({}, "heuristic")
    assert at.read_file(path, GPU)[0][0].q_len in (1, 4)


def test_a_step_reads_its_entry_in_each_launcher(dirs, monkeypatch):
    """The CuTe launcher reads a step's entry for a step and the one-token entry for one token; the Triton
    launcher a step's entry, else the one-token decode's."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")
    from foscar.cute import launch as cute_launch
    from foscar.triton import launch
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: GPU)
    cache = foscar.quantize_kv(torch.randn(8, 8, 64, 128), torch.randn(8, 8, 64, 128), FMT, page_size=64)
    rows = torch.zeros(8 * 2, 32, 128)  # a step of 2 tokens: its B q_len rows
    v1 = {"warp_specialized": True, "ctas_per_sm": 1, "k_operand": "bf16", "tiles_per_pass": 1}
    at.write_entries(dirs / "env", GPU, [(key(8, 64, backend="cute"), {**v1, "num_splits": 3}, {}),
                                         (key(8, 64, backend="cute", q_len=2), {**v1, "num_splits": 5}, {}),
                                         (key(8, 64), {"num_splits": 6, "num_warps": 4}, {})])
    at.clear_lookup_cache()
    assert cute_launch.launch_config(rows[:8], cache, 4).num_splits == 3
    assert cute_launch.launch_config(rows, cache, 4, step=2).num_splits == 5
    assert cute_launch.launch_config(rows[:8], cache, 4, step=4).num_splits != 5  # no entry of 4 tokens
    assert launch.launch_config(rows[:8], cache, 4, step=2).num_splits == 6  # the one-token entry
    at.write_entries(dirs / "env", GPU, [(key(8, 64, q_len=2), {"num_splits": 7, "num_warps": 4}, {})])
    at.clear_lookup_cache()
    assert launch.launch_config(rows[:8], cache, 4, step=2).num_splits == 7 and launch.launch_config(
        rows[:8], cache, 4).num_splits == 6


def test_foscar_tuning_0_turns_the_launchers_lookups_off(dirs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: GPU)
    cache = foscar.quantize_kv(torch.randn(8, 8, 64, 128), torch.randn(8, 8, 64, 128), FMT, page_size=64)
    q = torch.zeros(8, 32, 128)
    at.write_entries(dirs / "env", GPU, [(key(8, 64), {"num_splits": 5, "num_warps": 8}, {})])
    at.clear_lookup_cache()
    assert at.tuned_config("triton", q, cache, 4) == {"num_splits": 5, "num_warps": 8}
    monkeypatch.setenv("FOSCAR_TUNING", "0")
    assert at.tuned_config("triton", q, cache, 4) == {}
    monkeypatch.setenv("FOSCAR_TUNING", "1")
    assert at.tuned_config("triton", q, cache, 4) == {"num_splits": 5, "num_warps": 8}
