"""The autotune cache (foscar.autotune): keys, buckets, lookup order, nearest bucket, bad files, merges and
concurrent writers. CPU only."""
import json
import multiprocessing as mp
import warnings

import pytest
import torch

import foscar
from foscar import autotune as at
from foscar.errors import InvalidArgumentError

FMT = foscar.KVFormat(bits=4, head_dim=128, group_size=128)
GPU = "NVIDIA H200"


@pytest.fixture(autouse=True)
def dirs(tmp_path, monkeypatch):
    """An empty $FOSCAR_TUNING_DIR and user cache; the repository's tuning/configs stays where it is."""
    monkeypatch.setenv("FOSCAR_TUNING_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    at._WARNED.clear()
    return tmp_path


def key(batch=8, length=32768, **kw):
    return at.make_key(kw.pop("backend", "triton"), kw.pop("gpu", GPU), kw.pop("fmt", FMT), kw.pop("gqa", 4),
                       kw.pop("page", 64), batch, length)


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
    assert cute_launch.launch_config(q, cache, 4) == (True, 2, 3)
    assert cute_launch.launch_config(q, cache, 4, num_splits=7, warp_specialized=False) == (False, 2, 7)
    # another variant than the tuned one: the heuristic split count, not the one tuned for v1 at 2 CTAs
    heuristic = cute_launch.default_num_splits(8, 8, 1, q.device, cute_launch.V0_RESIDENT)
    assert cute_launch.launch_config(q, cache, 4, warp_specialized=False) == (False, 2, heuristic)
    assert cute_launch.launch_config(q, cache, 4, ctas_per_sm=1)[1:] == (
        1, cute_launch.default_num_splits(8, 8, 1, q.device, 1))
    assert cute_launch.launch_config(q, cache, 4, warp_specialized=True, ctas_per_sm=2) == (True, 2, 3)
    assert cute_launch.launch_config(q, cache, 4, use_tuned=False)[0] is cute_launch.DEFAULT_WARP_SPECIALIZED
    with pytest.raises(InvalidArgumentError, match="^warp_specialized: expected"):
        cute_launch.launch_config(q, cache, 4, warp_specialized=1)
    with pytest.raises(InvalidArgumentError, match="^ctas_per_sm: expected"):
        cute_launch.launch_config(q, cache, 4, ctas_per_sm=3)
    at.clear_lookup_cache()