"""Disk cache of the compiled CuTe DSL kernels (stage 1, and the combine): a process loads a
configuration compiled by an earlier one (milliseconds) instead of compiling it (seconds).

An **entry** is the compiled function exported ahead of time (``export_to_c``: an ELF object with the
host code, the cubin and the TVM-FFI entry point ``__tvm_ffi_<symbol>``), followed by a trailer
(:data:`TRAILER_MAGIC`, the key's sha256, the payload's sha256). Where a C compiler is found (``$CC``,
else ``cc``) the object is linked into a shared library against cutlass-dsl's runtime libraries (found
by ``cutlass.runtime.find_runtime_libraries``, named by absolute path and rpath): a ``.so`` entry, which
:func:`load_or_compile` loads with ``tvm_ffi.load_module`` without importing cutlass-dsl (about a
second of a process's first decode). Without a compiler the entry is the ``.o`` object, loaded with
``cutlass.runtime.load_module(path, enable_tvm_ffi=True)``. Either way the result is a
``tvm_ffi.Function``, called as the compiled function is (the :data:`~foscar.cute.config.STAGE1_TENSORS`
as torch tensors, then ``qk_scale``, ``num_splits``; it launches on torch's current stream, TVM-FFI's
environment stream, and loads its CUDA module on its first call).

The **key** (:func:`entry_key`, a JSON text; the file name is its sha256) holds the static config (its
type and every field: :class:`~foscar.cute.config.Sm90Config`, :class:`~foscar.cute.combine_config.CombineConfig`),
the variant (v0, or v1 and its CTAs per SM) and
the :class:`Toolchain`: the sha256 of foscar's kernel sources (every ``.py`` file under ``foscar/cute/``
and ``foscar/format.py``, as bytes), the versions of the nvidia-cutlass-dsl distributions (its libs
per CUDA flavour included) and of apache-tvm-ffi, the sha256 of the compiler libraries cutlass-dsl
records in its ``_cutlass_ir_version_*.py`` files, and the target arch (``CUTE_DSL_ARCH``, else the
current CUDA device's ``sm_XYa``); all read without importing cutlass-dsl. A change of any of them gives
another file; stale files stay until removed.

The **folder** (:func:`cache_dir`): ``$FOSCAR_CACHE_DIR/cute``, else ``$XDG_CACHE_HOME/foscar/cute``, else
``~/.cache/foscar/cute``; ``FOSCAR_CACHE_DIR=off`` (or ``0``) disables the disk cache. An entry is
written to a temporary file of the same folder and moved into place with ``os.replace``, so concurrent
processes see no entry or a whole one. A corrupt entry (truncated, foreign bytes, a checksum or load
error) gives one warning naming it, is removed where possible and rebuilt; a folder that cannot be
written gives one warning and the kernel is compiled in memory; a compiler that fails to link gives one
warning and the ``.o`` entry. The cache never fails a decode that a compile would serve.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

ENV_DIR = "FOSCAR_CACHE_DIR"
#: Values of ``$FOSCAR_CACHE_DIR`` that disable the disk cache (case-insensitive).
DISABLED = ("off", "0")
#: The entry format; part of the key, so that another format gives other files.
ENTRY_FORMAT = "foscar-cute-stage1-v2"
#: Entry file suffixes, in the order a load tries them: the linked library, then the object.
SUFFIXES = (".so", ".o")
TRAILER_MAGIC = b"\nFOSCAR-CUTE-ENTRY "
#: The trailer: magic, the key's sha256 (hex), a space, the object's sha256 (hex), a newline.
TRAILER_LEN = len(TRAILER_MAGIC) + 64 + 1 + 64 + 1

_PACKAGE = Path(__file__).resolve().parent.parent  # foscar/
_SOURCES: dict = {}  # package root -> sha256 of its kernel sources (one read per process)
_WARNED: set = set()  # (kind, path) of the warnings given in this process


@dataclass(frozen=True)
class Toolchain:
    """What a compiled kernel depends on besides its config: foscar's kernel sources and the compiler."""

    sources: str  # sha256 of the kernel sources (:func:`source_fingerprint`)
    cutlass_dsl: str | None  # nvidia-cutlass-dsl version
    tvm_ffi: str | None  # apache-tvm-ffi version
    cutlass_libs: tuple  # (distribution, version) of each nvidia-cutlass-dsl-libs-* installed
    compiler: tuple  # sha256 of each compiler library cutlass-dsl records (``_cutlass_ir_version_*.py``)
    arch: str | None  # target arch, e.g. "sm_90a"; None: unknown (no disk cache)


@dataclass(frozen=True)
class CompileRecord:
    """How :func:`load_or_compile` got a kernel. ``source``: ``"disk"`` (an entry loaded) or
    ``"compiled"`` (compiled in this process; ``path`` is the entry written, ``None`` where none was)."""

    source: str
    compile_s: float  # compiling (0 when loaded)
    load_s: float  # reading, checking and loading an entry (a corrupt one included)
    store_s: float  # exporting and writing the entry
    path: str | None

    @property
    def seconds(self) -> float:
        """The whole time the kernel took to get."""
        return self.compile_s + self.load_s + self.store_s

    @property
    def from_disk(self) -> bool:
        return self.source == "disk"


def cache_dir() -> Path | None:
    """The entries' folder; ``None`` when ``$FOSCAR_CACHE_DIR`` disables the disk cache."""
    root = os.environ.get(ENV_DIR, "").strip()
    if root.lower() in DISABLED:
        return None
    if root:
        return Path(root).expanduser() / "cute"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "foscar" / "cute"


def kernel_sources(package_root: Path | None = None) -> list[Path]:
    """The files whose bytes the kernels are built from: every ``.py`` under ``cute/``, and ``format.py``."""
    root = Path(package_root) if package_root is not None else _PACKAGE
    files = sorted(p for p in (root / "cute").rglob("*.py") if "__pycache__" not in p.parts)
    return files + [root / "format.py"]


def source_fingerprint(package_root: Path | None = None) -> str:
    """sha256 over the :func:`kernel_sources` (their paths relative to the package and their bytes); read
    once per process and package root."""
    root = Path(package_root).resolve() if package_root is not None else _PACKAGE
    digest = _SOURCES.get(root)
    if digest is None:
        h = hashlib.sha256()
        for path in kernel_sources(root):
            data = path.read_bytes()
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + str(len(data)).encode() + b"\0")
            h.update(data)
        digest = _SOURCES[root] = h.hexdigest()
    return digest


def _dist_version(name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cutlass_site() -> list[Path]:
    """The folders that hold the cutlass-dsl package (``.../nvidia_cutlass_dsl/dsl_packages/cutlass``):
    its ``_cutlass_ir_version_*.py`` files, and three levels up the site folder with its dist-info."""
    import importlib.util
    spec = importlib.util.find_spec("cutlass")
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []


@functools.lru_cache(maxsize=1)  # folder listings: once per process
def _cutlass_libs() -> tuple:
    """``(name, version)`` of each ``nvidia-cutlass-dsl-libs-*`` distribution beside the cutlass-dsl
    package, from the names of their dist-info folders, sorted."""
    found = set()
    for root in _cutlass_site():
        for info in root.parents[2].glob("nvidia_cutlass_dsl_libs*-*.dist-info"):
            name, _, version = info.name[: -len(".dist-info")].partition("-")
            found.add((name.lower().replace("_", "-"), version))
    return tuple(sorted(found))


@functools.lru_cache(maxsize=1)
def _cutlass_compiler() -> tuple:
    """The sha256 of each compiler library of cutlass-dsl, read from the ``DSO_SHA256`` tables of its
    ``_cutlass_ir_version_*.py`` files as text (importing cutlass-dsl takes about a second)."""
    sums = set()
    for root in _cutlass_site():
        for path in Path(root, "_mlir", "_mlir_libs").glob("_cutlass_ir_version_*.py"):
            sums.update(re.findall(r'"([^"]+\.so)":\s*"([0-9a-f]{64})"', path.read_text()))
    return tuple(sorted(sums))


def target_arch() -> str | None:
    """``$CUTE_DSL_ARCH``, else the current CUDA device's ``sm_XYa``; ``None`` without either."""
    arch = os.environ.get("CUTE_DSL_ARCH", "").strip()
    if arch:
        return arch
    import torch
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(torch.cuda.current_device())
    return f"sm_{major}{minor}a"


def current_toolchain() -> Toolchain:
    return Toolchain(source_fingerprint(), _dist_version("nvidia-cutlass-dsl"), _dist_version("apache-tvm-ffi"),
                     _cutlass_libs(), _cutlass_compiler(), target_arch())


def entry_key(cfg, warp_specialized: bool, ctas_per_sm: int, toolchain: Toolchain) -> str:
    """The key of a kernel, a JSON text with sorted keys (the same in every process). ``ctas_per_sm``
    counts for v1 only (v0 takes none)."""
    return json.dumps({"format": ENTRY_FORMAT, "config": type(cfg).__name__, "fields": dataclasses.asdict(cfg),
                       "warp_specialized": bool(warp_specialized),
                       "ctas_per_sm": int(ctas_per_sm) if warp_specialized else 0,
                       "toolchain": dataclasses.asdict(toolchain)}, sort_keys=True, separators=(",", ":"))


def entry_path(folder: Path, key: str, suffix: str = ".so") -> Path:
    """The entry file of ``key``: the linked library (``.so``) or the object (``.o``)."""
    if suffix not in SUFFIXES:
        raise ValueError(f"suffix: expected one of {SUFFIXES}, got {suffix!r}")
    return folder / f"kernel-{_digest(key)}{suffix}"


def symbol_name(key: str) -> str:
    """The exported function's name: one per key, so that the loaded modules of a process never share one."""
    return f"foscar_kernel_{_digest(key)[:16]}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _trailer(key: str, payload: bytes) -> bytes:
    return TRAILER_MAGIC + _digest(key).encode() + b" " + hashlib.sha256(payload).hexdigest().encode() + b"\n"


def check_entry(data: bytes, key: str) -> str | None:
    """Why ``data`` is not a whole entry of ``key`` (``None``: it is)."""
    if len(data) <= TRAILER_LEN:
        return f"{len(data)} bytes, shorter than an entry"
    payload, trailer = data[:-TRAILER_LEN], data[-TRAILER_LEN:]
    if not trailer.startswith(TRAILER_MAGIC):
        return "no foscar entry trailer (truncated or foreign bytes)"
    if trailer != _trailer(key, payload):
        return "checksum or key mismatch (corrupt, or written for another key)"
    return None


def _warn_once(kind: str, path, message: str) -> None:
    if (kind, str(path)) not in _WARNED:
        _WARNED.add((kind, str(path)))
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _compile(cfg, warp_specialized: bool, ctas_per_sm: int):
    from .combine_config import CombineConfig
    if isinstance(cfg, CombineConfig):
        from .compile import compile_combine
        return compile_combine(cfg)
    from .compile import compile_stage1
    return compile_stage1(cfg, warp_specialized=warp_specialized, ctas_per_sm=ctas_per_sm)


def _load(path: Path, symbol: str):
    """The exported function ``symbol`` of the entry at ``path`` (raises on a load error): a ``.so``
    through TVM-FFI alone, an ``.o`` through cutlass-dsl's loader (which links it in memory)."""
    if Path(path).suffix == ".so":
        import tvm_ffi
        return getattr(tvm_ffi.load_module(str(path)), symbol)
    import cutlass.runtime
    return getattr(cutlass.runtime.load_module(str(path), enable_tvm_ffi=True), symbol)


def _c_compiler() -> str | None:
    """``$CC``, else ``cc`` on the PATH; ``None`` without one (the entries are then objects)."""
    cc = os.environ.get("CC", "").strip()
    return shutil.which(cc) if cc else shutil.which("cc")


def _link(cc: str, obj: str, out: str) -> None:
    """Link the exported object ``obj`` into the shared library ``out`` with the C compiler ``cc``, against
    cutlass-dsl's runtime libraries (absolute paths, and their folders as the rpath); raises where the
    compiler fails."""
    import cutlass.runtime
    libs = [p for p in cutlass.runtime.find_runtime_libraries(enable_tvm_ffi=True) if Path(p).exists()]
    rpath = ":".join(dict.fromkeys(str(Path(p).resolve().parent) for p in libs))
    done = subprocess.run([cc, "-shared", "-o", out, obj, *libs, f"-Wl,-rpath,{rpath}"], capture_output=True,
                          text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"{cc} exited with {done.returncode}: {done.stderr.strip()[-500:]}")


def _read_entry(path: Path, key: str):
    """The loaded function of the entry at ``path``; ``None`` if it is absent, or corrupt (one warning
    naming it, removed where possible)."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # no entry (or no folder: the write says so)
        return None
    except OSError as e:
        _warn_once("unreadable", path, f"foscar CuTe compile cache: cannot read {path} ({e}); compiling the "
                                       f"kernel instead")
        return None
    why = check_entry(data, key)
    fn = None
    if why is None:
        try:
            fn = _load(path, symbol_name(key))
        except Exception as e:  # noqa: BLE001 - any load failure: the entry is rebuilt
            why = f"load error: {type(e).__name__}: {e}"
    if why is not None:
        _warn_once("corrupt", path, f"foscar CuTe compile cache: ignoring entry {path} ({why}); removing it and "
                                    f"compiling the kernel again")
        try:
            os.remove(path)
        except OSError:
            pass
    return fn


def _write_entry(fn, folder: Path, key: str) -> Path | None:
    """Export ``fn`` into ``folder`` as the entry of ``key`` (linked into a ``.so`` where a C compiler
    works, else the ``.o``) through temporary files of ``folder`` and ``os.replace``; the entry's path, or
    ``None`` (one warning per folder) where the folder cannot be written."""
    temps = []
    try:
        folder.mkdir(parents=True, exist_ok=True)

        def temp(suffix: str) -> str:
            fd, name = tempfile.mkstemp(prefix=f".kernel-{_digest(key)}.", suffix=f".tmp{suffix}", dir=folder)
            os.close(fd)
            temps.append(name)
            return name
        tmp, suffix = temp(".o"), ".o"
        fn.export_to_c(tmp, function_name=symbol_name(key), enable_pic=True)
        cc = _c_compiler()
        if cc is not None:
            lib = temp(".so")
            try:
                _link(cc, tmp, lib)
                tmp, suffix = lib, ".so"
            except Exception as e:  # noqa: BLE001 - the object entry still serves (through cutlass-dsl)
                _warn_once("link", folder, f"foscar CuTe compile cache: cannot link a shared library in {folder} "
                                           f"({type(e).__name__}: {e}); writing the object entry (its load "
                                           f"imports cutlass-dsl)")
        with open(tmp, "rb") as f:
            payload = f.read()
        with open(tmp, "ab") as f:
            f.write(_trailer(key, payload))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep the entry from the other users of a shared folder
        path = entry_path(folder, key, suffix)
        os.replace(tmp, path)
        return path
    except Exception as e:  # noqa: BLE001 - an unwritable folder or a failed export: the kernel stays in memory
        _warn_once("unwritable", folder, f"foscar CuTe compile cache: cannot write an entry to {folder} "
                                         f"({type(e).__name__}: {e}); kernels are compiled in memory (set "
                                         f"{ENV_DIR} to a writable folder, or to 'off')")
        return None
    finally:
        for name in temps:
            try:
                os.remove(name)
            except OSError:  # moved into place, or never made
                pass


def load_or_compile(cfg, warp_specialized: bool = False, ctas_per_sm: int = 1):
    """``(fn, record)``: the kernel of ``cfg`` and the variant (:func:`foscar.cute.compile.compile_stage1`
    for an ``Sm90Config``, :func:`~foscar.cute.compile.compile_combine` for a ``CombineConfig``), loaded from the disk cache, else compiled (and
    written to it); ``record`` is its :class:`CompileRecord`."""
    folder = cache_dir()
    toolchain = current_toolchain() if folder is not None else None
    if toolchain is None or toolchain.arch is None:  # disabled, or no target to key an entry by
        t0 = time.perf_counter()
        fn = _compile(cfg, warp_specialized, ctas_per_sm)
        return fn, CompileRecord("compiled", time.perf_counter() - t0, 0.0, 0.0, None)
    key = entry_key(cfg, warp_specialized, ctas_per_sm, toolchain)
    t0 = time.perf_counter()
    for suffix in SUFFIXES:
        path = entry_path(folder, key, suffix)
        fn = _read_entry(path, key)
        if fn is not None:
            return fn, CompileRecord("disk", 0.0, time.perf_counter() - t0, 0.0, str(path))
    t1 = time.perf_counter()
    fn = _compile(cfg, warp_specialized, ctas_per_sm)
    t2 = time.perf_counter()
    stored = _write_entry(fn, folder, key)
    return fn, CompileRecord("compiled", t2 - t1, t1 - t0, time.perf_counter() - t2,
                             str(stored) if stored is not None else None)
