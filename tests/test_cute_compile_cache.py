"""The disk compile cache of the CuTe kernels (:mod:`foscar.cute.compile_cache`). CPU: a first call compiles
and writes one entry (a shared library where a C compiler is found, else the object), a fresh process
loads it without compiling (through TVM-FFI alone without importing cutlass-dsl, or
``cutlass.runtime.load_module``); keys are stable across processes and change with a source byte, a
version, the arch, the config or the variant; entries appear whole (temporary files and ``os.replace``,
concurrent writers included); a corrupt entry is ignored with one warning and rebuilt;
``FOSCAR_CACHE_DIR=off`` writes nothing; an unwritable folder warns once and still gives a kernel. GPU
(sm_90): a fresh process decodes with the loaded kernels (stage 1 and the combine), bit for bit what
the compiled ones give.

First-call time on the GPU, a fresh process with a cold and then a warm disk cache:
``benchmarks/first_call.py`` (``docs/results-h200.md`` holds the figures).
"""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar
from foscar.cute import compile_cache, launch
from foscar.cute.decode_sm90 import config_for
from _cases import HOPPER

REPO = Path(__file__).resolve().parent.parent
CFG = config_for(foscar.KVFormat(bits=4, head_dim=64, group_size=64), 4, 64)
OTHER = config_for(foscar.KVFormat(bits=2, head_dim=64, group_size=64), 4, 64)
REAL_LOAD = compile_cache._load

# A fresh process: the kernel through launch._compiled (FORBID_COMPILE=1: compiling raises).
FRESH = r"""
import json, os
import foscar
from foscar.cute import compile_cache, launch
from foscar.cute.config import config_for
if os.environ.get("FORBID_COMPILE") == "1":
    def refuse(*args, **kwargs):
        raise AssertionError("compiled, though the disk cache holds the entry")
    compile_cache._compile = refuse
cfg = config_for(foscar.KVFormat(bits=4, head_dim=64, group_size=64), 4, 64)
fn = launch._compiled(cfg, False, 1)
(rec,) = launch.compile_seconds(detail=True).values()
(seconds,) = launch.compile_seconds().values()
import sys
print(json.dumps({"source": rec.source, "path": rec.path, "seconds": seconds, "compile_s": rec.compile_s,
                  "load_s": rec.load_s, "callable": callable(fn), "type": type(fn).__name__,
                  "cutlass_imported": "cutlass" in sys.modules,
                  "key": compile_cache.entry_key(cfg, False, 1, compile_cache.current_toolchain())}))
"""


def run_fresh(script: str, cwd: Path, **env) -> dict:
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    done = subprocess.run([sys.executable, "-c", script], check=False, cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "foscar CuTe compile cache" not in done.stderr, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


class FakeKernel:
    """What compile_stage1 returns, as far as the cache uses it: callable, ``export_to_c``."""

    def __init__(self, payload: bytes = b"\x7fELF fake object", check=None):
        self.payload, self.check, self.exports = payload, check, []

    def __call__(self, *args):
        return "compiled"

    def export_to_c(self, path, function_name=None, *, enable_pic=True):
        assert enable_pic and function_name
        if self.check:
            self.check(Path(path))
        with open(path, "wb") as f:
            f.write(self.payload + function_name.encode())
        self.exports.append(path)


def loaded(path, symbol):
    data = Path(path).read_bytes()
    assert symbol.encode() in data
    return lambda *args: "loaded"


@pytest.fixture(autouse=True)
def cache_env(monkeypatch, tmp_path):
    """A cache folder of the test's own, no warnings given yet."""
    monkeypatch.setenv("FOSCAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compile_cache, "_WARNED", set())
    return tmp_path / "cache" / "cute"


@pytest.fixture
def fake(monkeypatch):
    """Compiling gives a FakeKernel, loading checks the entry's bytes: no cutlass work."""
    kernels = []

    def compile_(cfg, warp_specialized, ctas_per_sm):
        kernels.append(FakeKernel())
        return kernels[-1]
    monkeypatch.setattr(compile_cache, "_compile", compile_)
    monkeypatch.setattr(compile_cache, "_load", loaded)
    monkeypatch.setattr(compile_cache, "_c_compiler", lambda: None)  # object entries: nothing to link
    return kernels


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_first_call_writes_one_entry_and_a_fresh_process_loads_it(tmp_path, cache_env):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    first = run_fresh(FRESH, cwd, PYTHONHASHSEED="1")
    assert first["source"] == "compiled" and first["compile_s"] > 0 and first["callable"]
    (name,) = files(cache_env)  # one entry, no temporary file left
    linked = compile_cache._c_compiler() is not None  # a C compiler: the entry is a shared library
    assert first["path"] == str(cache_env / name) and not name.startswith(".")
    assert name.endswith(".so" if linked else ".o")
    entry = cache_env / name
    assert compile_cache.check_entry(entry.read_bytes(), first["key"]) is None
    assert entry.stat().st_mode & 0o777 == 0o644
    second = run_fresh(FRESH, cwd, PYTHONHASHSEED="2", FORBID_COMPILE="1")
    assert second["source"] == "disk" and second["compile_s"] == 0 and second["callable"]
    assert second["type"] == "Function" and second["seconds"] == second["load_s"] < first["seconds"]
    assert second["cutlass_imported"] is not linked, "a linked entry loads without importing cutlass-dsl"
    assert second["key"] == first["key"] == compile_cache.entry_key(CFG, False, 1, compile_cache.current_toolchain())
    assert files(cache_env) == [name]
    assert files(cwd) == [], "the compile wrote into the working directory"


def test_key_is_the_config_the_variant_and_the_toolchain(monkeypatch):
    tc = compile_cache.current_toolchain()
    assert tc.arch == os.environ["CUTE_DSL_ARCH"] and tc.cutlass_dsl and tc.tvm_ffi and len(tc.sources) == 64
    key = compile_cache.entry_key(CFG, False, 1, tc)
    assert json.loads(key)["fields"] == json.loads(json.dumps(dataclasses.asdict(CFG)))  # tuples as lists
    assert key == compile_cache.entry_key(dataclasses.replace(CFG), False, 2, tc), "v0 takes no CTAs per SM"
    others = [compile_cache.entry_key(OTHER, False, 1, tc), compile_cache.entry_key(CFG, True, 1, tc),
              compile_cache.entry_key(CFG, True, 2, tc),
              compile_cache.entry_key(dataclasses.replace(CFG, k_mid=CFG.k_mid + 0.5), False, 1, tc)]
    others += [compile_cache.entry_key(CFG, False, 1, dataclasses.replace(tc, **{field: "x"}))
               for field in ("sources", "cutlass_dsl", "tvm_ffi", "cutlass_libs", "compiler", "arch")]
    assert len({key, *others}) == len(others) + 1
    folder = Path("/c")
    assert len({compile_cache.entry_path(folder, k) for k in (key, *others)}) == len(others) + 1
    assert len({compile_cache.symbol_name(k) for k in (key, *others)}) == len(others) + 1
    assert compile_cache.symbol_name(key).isidentifier()

    from importlib import metadata
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "9.9" if name == "nvidia-cutlass-dsl" else real(name))
    assert compile_cache.entry_key(CFG, False, 1, compile_cache.current_toolchain()) != key
    monkeypatch.setattr(metadata, "version", lambda name: "9.9" if name == "apache-tvm-ffi" else real(name))
    assert compile_cache.entry_key(CFG, False, 1, compile_cache.current_toolchain()) != key
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    monkeypatch.setattr(metadata, "version", real)
    assert compile_cache.entry_key(CFG, False, 1, compile_cache.current_toolchain()) != key


def test_a_source_byte_changes_the_fingerprint(tmp_path):
    real = compile_cache.kernel_sources()
    names = {p.relative_to(compile_cache._PACKAGE).as_posix() for p in real}
    assert "format.py" in names and "cute/compile_cache.py" in names and "cute/launch.py" in names
    assert names >= {p.relative_to(compile_cache._PACKAGE).as_posix()
                     for p in (compile_cache._PACKAGE / "cute").rglob("*.py")}

    def copy(name: str) -> Path:
        root = tmp_path / name / "foscar"
        for path in real:
            (root / path.relative_to(compile_cache._PACKAGE)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, root / path.relative_to(compile_cache._PACKAGE))
        return root
    same = compile_cache.source_fingerprint(copy("same"))
    assert same == compile_cache.source_fingerprint() == compile_cache.current_toolchain().sources
    flipped = copy("flipped")
    for rel in ("format.py", "cute/launch.py"):
        data = bytearray((flipped / rel).read_bytes())
        data[len(data) // 2] ^= 1
        (flipped / rel).write_bytes(bytes(data))
        assert compile_cache.source_fingerprint(flipped) != same
        compile_cache._SOURCES.pop(flipped.resolve())  # read again: the fingerprint is kept per process
    added = copy("added")
    (added / "cute" / "stage2.py").write_text("")
    assert compile_cache.source_fingerprint(added) != same


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FOSCAR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.cache_dir() == tmp_path / "mine" / "cute"
    monkeypatch.delenv("FOSCAR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == tmp_path / "xdg" / "foscar" / "cute"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.cache_dir() == tmp_path / "home" / ".cache" / "foscar" / "cute"
    for off in ("off", "OFF", "0"):
        monkeypatch.setenv("FOSCAR_CACHE_DIR", off)
        assert compile_cache.cache_dir() is None


def test_entry_is_written_whole_through_a_temporary_file(monkeypatch, fake, cache_env):
    key = compile_cache.entry_key(CFG, True, 2, compile_cache.current_toolchain())
    final = compile_cache.entry_path(cache_env, key, ".o")  # no C compiler (the fake): the object entry

    def check(tmp: Path):  # while the object is exported: a hidden file of the same folder, no entry yet
        assert tmp.parent == cache_env and tmp.name.startswith(".") and not final.exists()
    monkeypatch.setattr(compile_cache, "_compile", lambda *a: FakeKernel(check=check))
    replaced = []
    real_replace = os.replace

    def replace(src, dst):
        assert compile_cache.check_entry(Path(src).read_bytes(), key) is None, "moved into place unfinished"
        replaced.append((Path(src), Path(dst)))
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    fn, rec = compile_cache.load_or_compile(CFG, True, 2)
    assert fn() == "compiled" and rec.source == "compiled" and rec.path == str(final)
    assert replaced == [(replaced[0][0], final)] and replaced[0][0].parent == cache_env
    assert files(cache_env) == [final.name]
    fn, rec = compile_cache.load_or_compile(CFG, True, 2)
    assert fn() == "loaded" and rec.from_disk and rec.compile_s == rec.store_s == 0


# A writer process: 20 entries of 600 kB under one key, each through compile_cache._write_entry.
WRITER = r"""
import sys
from pathlib import Path
from foscar.cute import compile_cache

class Kernel:
    def __init__(self, payload):
        self.payload = payload
    def export_to_c(self, path, function_name=None, *, enable_pic=True):
        with open(path, "wb") as f:
            f.write(self.payload)

folder, key, seed = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
compile_cache._c_compiler = lambda: None  # the object entry: these payloads are no objects to link
for i in range(20):
    assert compile_cache._write_entry(Kernel(bytes([seed, i]) * 300_000), folder, key) == compile_cache.entry_path(
        folder, key, ".o")
"""


def test_concurrent_writers_never_show_a_torn_entry(cache_env):
    key = compile_cache.entry_key(CFG, False, 1, compile_cache.current_toolchain())
    path = compile_cache.entry_path(cache_env, key, ".o")
    cache_env.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(cache_env), key, str(seed)], env=env,
                                stderr=subprocess.PIPE, text=True) for seed in range(3)]
    seen = 0
    while any(w.poll() is None for w in writers):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        assert compile_cache.check_entry(data, key) is None
        seen += 1
    assert [w.wait() for w in writers] == [0, 0, 0], [w.stderr.read()[-2000:] for w in writers]
    assert seen and compile_cache.check_entry(path.read_bytes(), key) is None and files(cache_env) == [path.name]


@pytest.mark.parametrize("damage", ("garbage", "truncated", "other key", "load error"))
def test_a_corrupt_entry_is_ignored_with_one_warning_and_rebuilt(monkeypatch, fake, cache_env, damage):
    key = compile_cache.entry_key(CFG, False, 1, compile_cache.current_toolchain())
    path = compile_cache.entry_path(cache_env, key, ".o")  # the fake: no C compiler
    compile_cache.load_or_compile(CFG, False, 1)  # a good entry
    good = path.read_bytes()

    def spoil():
        if damage == "garbage":
            path.write_bytes(os.urandom(len(good)))
        elif damage == "truncated":
            path.write_bytes(good[: len(good) // 2])
        elif damage == "other key":
            other = compile_cache.entry_key(OTHER, False, 1, compile_cache.current_toolchain())
            os.replace(compile_cache._write_entry(FakeKernel(), cache_env, other), path)
    if damage == "load error":
        def refuse(path_, symbol):
            raise RuntimeError("BinaryExecutionEngine: Failed to add object file")
        monkeypatch.setattr(compile_cache, "_load", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the second time: rebuilt (load error: corrupt again), no second warning
            spoil()
            fn, rec = compile_cache.load_or_compile(CFG, False, 1)
            assert fn() == "compiled" and rec.source == "compiled" and rec.path == str(path)
            assert compile_cache.check_entry(path.read_bytes(), key) is None
    ours = [w for w in caught if "foscar CuTe compile cache" in str(w.message)]
    assert len(ours) == 1 and str(path) in str(ours[0].message) and "ignoring entry" in str(ours[0].message)
    assert files(cache_env) == [path.name]


def test_a_real_load_error_is_caught(cache_env, fake, monkeypatch):
    """Foreign bytes behind a valid trailer reach cutlass.runtime.load_module, whose error rebuilds the entry."""
    monkeypatch.setattr(compile_cache, "_load", REAL_LOAD)
    key = compile_cache.entry_key(CFG, False, 1, compile_cache.current_toolchain())
    compile_cache._write_entry(FakeKernel(b"not an object file"), cache_env, key)
    with pytest.warns(RuntimeWarning, match=r"ignoring entry .*load error"):
        fn, rec = compile_cache.load_or_compile(CFG, False, 1)
    assert rec.source == "compiled" and callable(fn)


def test_disabled_cache_writes_nothing(monkeypatch, fake, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    for off in ("off", "0"):
        monkeypatch.setenv("FOSCAR_CACHE_DIR", off)
        fn, rec = compile_cache.load_or_compile(CFG, False, 1)
        assert fn() == "compiled" and rec.source == "compiled" and rec.path is None and rec.load_s == 0
    assert files(tmp_path) == [] and fake[0].exports == []


def test_no_target_arch_compiles_in_memory(monkeypatch, fake, cache_env):
    monkeypatch.delenv("CUTE_DSL_ARCH")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fn, rec = compile_cache.load_or_compile(CFG, False, 1)
    assert fn() == "compiled" and rec.path is None and not cache_env.exists()


def test_unwritable_folder_warns_once_and_still_compiles(monkeypatch, fake, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FOSCAR_CACHE_DIR", str(blocker))  # <file>/cute cannot be made
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for cfg in (CFG, OTHER):
            fn, rec = compile_cache.load_or_compile(cfg, False, 1)
            assert fn() == "compiled" and rec.source == "compiled" and rec.path is None
    ours = [w for w in caught if "foscar CuTe compile cache" in str(w.message)]
    assert len(ours) == 1 and str(blocker / "cute") in str(ours[0].message) and "in memory" in str(ours[0].message)
    assert fake[0].exports == [] and blocker.read_text() == ""


def test_launch_keeps_the_first_level_in_process(monkeypatch):
    calls = []

    def load_or_compile(cfg, warp_specialized, ctas_per_sm):
        calls.append((cfg, warp_specialized, ctas_per_sm))
        return (lambda *a: None), compile_cache.CompileRecord("disk", 0.0, 0.25, 0.0, "/x.o")
    monkeypatch.setattr(compile_cache, "load_or_compile", load_or_compile)
    monkeypatch.setattr(launch, "_COMPILED", {})
    monkeypatch.setattr(launch, "_COMPILE_RECORDS", {})
    fn = launch._compiled(CFG, True, 2)
    assert launch._compiled(CFG, True, 2) is fn and calls == [(CFG, True, 2)]
    assert launch.compile_seconds() == {(CFG, True, 2): 0.25}
    (rec,) = launch.compile_seconds(detail=True).values()
    assert rec.from_disk and rec.path == "/x.o"
    launch._compiled(CFG, False, 2)
    launch._compiled(CFG, False, 1)  # v0: the same kernel whatever the CTAs per SM
    assert len(calls) == 2 and set(launch.compile_seconds()) == {(CFG, True, 2), (CFG, False, 0)}


DECODE = r"""
import json, sys, torch, foscar
from foscar.cute.launch import compile_seconds
torch.manual_seed(0)
fmt = foscar.KVFormat(bits=4, head_dim=128, group_size=128)
k, v = torch.randn(2, 2, 2, 3000, 128, device="cuda", dtype=torch.bfloat16).unbind(0)
cache = foscar.quantize_kv(k, v, fmt, page_size=64)
q = torch.randn(2, 8, 128, device="cuda", dtype=torch.bfloat16)
out = foscar.decode(q, cache, backend="cute")
torch.cuda.synchronize()
torch.save(out.cpu(), sys.argv[1])
print(json.dumps([[r.source for r in compile_seconds(detail=True).values()], "cutlass" in sys.modules]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
def test_a_fresh_process_decodes_with_the_loaded_kernel_gpu(tmp_path, cache_env):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CUTE_DSL_ARCH", None)  # the device's arch, as a serving process has it
    sources = []
    for run in ("cold", "warm"):
        done = subprocess.run([sys.executable, "-c", DECODE, str(tmp_path / f"{run}.pt")], check=False,
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        sources.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (cold_src, _), (warm_src, warm_cutlass) = sources
    assert cold_src == ["compiled", "compiled"] and warm_src == ["disk", "disk"]  # stage 1, the combine
    assert len(files(cache_env)) == 2
    assert warm_cutlass is (compile_cache._c_compiler() is None), "a linked entry loads without cutlass-dsl"
    cold, warm = torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt")
    assert torch.isfinite(cold).all() and torch.equal(cold, warm)
