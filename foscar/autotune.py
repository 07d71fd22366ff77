"""The autotune cache: per-GPU kernel configurations, looked up by shape and quantization axis (issue 5).

A **key** (:class:`TuneKey`) names the backend, the GPU (normalised like vLLM's device names), the cache
format (bits, K axis, V axis, group size, head dim), the GQA ratio, the page size and two buckets:
batch (powers of two) and context length (powers of two from 1K). A **config** is a dict of the
backend's launch parameters (Triton: ``num_splits``, ``num_warps``, ``block_n``, ``prefetch``; CuTe:
``warp_specialized``, ``ctas_per_sm``, ``num_splits``; ``None`` values leave the kernel's heuristic in
charge). :func:`tuned_config` is what the launchers call.

Files: ``<dir>/<GPU>.json``, schema :data:`SCHEMA`, with metadata (foscar, Triton, cutlass-dsl and CUDA
versions, GPU name) and a list of entries. :func:`lookup` reads, in order, ``$FOSCAR_TUNING_DIR``, the
user cache folder (``$XDG_CACHE_HOME/foscar/tuning``, default ``~/.cache/foscar/tuning``), the
repository's ``tuning/configs`` (a source checkout or editable install) and the copy installed with the
wheel (``<prefix>/share/foscar/tuning/configs``); the first folder with a usable file for the GPU wins,
and within it the entry of the same key with the nearest buckets. Nothing found: the built-in
heuristic (an empty config). A corrupt, truncated, foreign or version-mismatched file gives one warning
naming it and is skipped as a whole: never a crash, never half-read.

:func:`write_entries` merges entries into a file atomically (a lock file, a temporary file and
``os.replace``), so concurrent tuners never leave a torn file.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ._version import __version__ as FOSCAR_VERSION
from .errors import InvalidArgumentError

SCHEMA = "foscar-tuning-v1"
ENV_DIR = "FOSCAR_TUNING_DIR"
CTX_MIN = 1024


@dataclass(frozen=True)
class TuneKey:
    backend: str
    gpu: str
    bits: int
    k_axis: str
    v_axis: str
    group: int
    head_dim: int
    gqa: int
    page: int
    batch_bucket: int
    ctx_bucket: int

    def same_family(self, other: TuneKey) -> bool:
        """Equal in everything but the two buckets."""
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(self)
                   if f.name not in ("batch_bucket", "ctx_bucket"))

    def distance(self, other: TuneKey) -> float:
        """How far apart the buckets are, in powers of two (batch and context alike)."""
        return (abs(math.log2(self.batch_bucket) - math.log2(other.batch_bucket))
                + abs(math.log2(self.ctx_bucket) - math.log2(other.ctx_bucket)))


def normalize_gpu_name(name: str) -> str:
    """A file-name-safe GPU name: ``"NVIDIA H200"`` -> ``"NVIDIA_H200"``, ``"NVIDIA H100 80GB HBM3"`` ->
    ``"NVIDIA_H100_80GB_HBM3"`` (spaces and path-hostile characters become ``_``, as vLLM names its
    tuned-config files)."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidArgumentError("name", "a non-empty GPU name", repr(name))
    out = "".join(c if c.isalnum() or c in "-." else "_" for c in name.strip())
    while "__" in out:
        out = out.replace("__", "_")
    return out.strip("_")


def bucket(n: int, minimum: int = 1) -> int:
    """The power of two at or above ``n`` (at least ``minimum``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InvalidArgumentError("n", "an int >= 0", n)
    return max(minimum, 1 << max(0, n - 1).bit_length())


def make_key(backend: str, gpu: str, fmt, gqa: int, page: int, batch: int, max_len: int) -> TuneKey:
    return TuneKey(backend, normalize_gpu_name(gpu), fmt.bits, fmt.k_axis, fmt.v_axis, fmt.group_size, fmt.head_dim,
                   gqa, page, bucket(batch), bucket(max_len, CTX_MIN))


# --------------------------------------------------------------------------------------------
# Versions and folders
# --------------------------------------------------------------------------------------------
def _dist_version(name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def current_meta(gpu: str) -> dict:
    """The metadata a file written now carries."""
    import torch
    return {"foscar": FOSCAR_VERSION, "triton": _dist_version("triton"),
            "cutlass_dsl": _dist_version("nvidia-cutlass-dsl"), "cuda": torch.version.cuda,
            "gpu": normalize_gpu_name(gpu)}


def _major_minor(v: str | None) -> str | None:
    return None if v is None else ".".join(v.split(".")[:2])


def meta_mismatch(meta: dict, here: dict) -> str | None:
    """Why a file's metadata does not fit this install, or ``None``: same foscar and Triton major.minor,
    same cutlass-dsl version (CuTe configs are static kernel parameters)."""
    for name, norm in (("foscar", _major_minor), ("triton", _major_minor), ("cutlass_dsl", lambda v: v)):
        if meta.get(name) is not None and here.get(name) is not None and norm(meta[name]) != norm(here[name]):
            return f"{name} {meta[name]} (this install: {here[name]})"
    return None


def search_dirs() -> list[Path]:
    """Where :func:`lookup` looks, in order."""
    dirs = []
    if os.environ.get(ENV_DIR):
        dirs.append(Path(os.environ[ENV_DIR]))
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    dirs.append(cache_home / "foscar" / "tuning")
    dirs.append(Path(__file__).resolve().parents[1] / "tuning" / "configs")
    dirs.append(Path(sys.prefix) / "share" / "foscar" / "tuning" / "configs")
    return dirs


def user_dir() -> Path:
    """Where ``foscar tune`` writes by default: ``$FOSCAR_TUNING_DIR``, else the user cache folder."""
    return search_dirs()[0]


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
_WARNED: set[str] = set()


def _warn_once(path: Path, why: str) -> None:
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        warnings.warn(f"foscar tuning file {path}: {why}; ignored (the next folder or the heuristic applies)",
                      RuntimeWarning, stacklevel=3)


def read_file(path: Path, gpu: str, *, with_extra: bool = False) -> list[tuple] | None:
    """The entries of ``path``, ``(key, config)`` (``with_extra``: ``(key, config, extra)``, the entry's
    other fields, such as its measured times), if the whole file is usable here, else ``None`` (with one
    warning if it exists but is corrupt, foreign or from another version)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn_once(path, f"unreadable ({e})")
        return None
    try:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed JSON (truncated or corrupt: {e})") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} file")
        meta = doc["meta"]
        if normalize_gpu_name(meta["gpu"]) != normalize_gpu_name(gpu):
            raise ValueError(f"written for GPU {meta['gpu']!r}, not {normalize_gpu_name(gpu)!r}")
        why = meta_mismatch(meta, current_meta(gpu))
        if why:
            raise ValueError(f"written by another version: {why}")
        entries = []
        for e in doc["entries"]:
            key = TuneKey(**e["key"])
            if not isinstance(e["config"], dict):
                raise ValueError("an entry's config is not an object")
            extra = {k: v for k, v in e.items() if k not in ("key", "config")}
            entries.append((key, dict(e["config"]), extra) if with_extra else (key, dict(e["config"])))
        return entries
    except (ValueError, KeyError, TypeError) as e:
        _warn_once(path, str(e) if isinstance(e, ValueError) else f"malformed ({type(e).__name__}: {e})")
        return None


def lookup(key: TuneKey) -> tuple[dict, str]:
    """``(config, source)``: the tuned config of the nearest-bucket entry of ``key``'s family in the first
    folder with a usable file for the GPU, or ``({}, "heuristic")``."""
    for d in search_dirs():
        entries = read_file(d / f"{key.gpu}.json", key.gpu)
        if not entries:
            continue
        family = [(k, c) for k, c in entries if k.same_family(key)]
        if family:
            k, c = min(family, key=lambda kc: (key.distance(kc[0]), kc[0].batch_bucket, kc[0].ctx_bucket))
            return c, f"{d / f'{key.gpu}.json'} (B<={k.batch_bucket}, L<={k.ctx_bucket})"
    return {}, "heuristic"


def tuned_config(backend: str, q, cache, G: int) -> dict:
    """The tuned launch config of ``backend`` for a decode of ``q`` over ``cache`` (``{}``: none tuned),
    keyed by GPU, format, GQA, page size and the batch and capacity buckets: host facts only, no device
    read. Each kernel's launcher reads its own keys from it."""
    import torch
    index = q.device.index
    if index is None:
        index = torch.cuda.current_device() if q.device.type == "cuda" else 0
    return _cached_lookup(backend, index, cache.fmt, G, cache.page_size, q.shape[0], cache.table_capacity)


@functools.lru_cache(maxsize=1024)
def _cached_lookup(backend: str, device_index: int, fmt, G: int, page: int, batch: int, capacity: int) -> dict:
    """Looked up once per process and call shape (files written later in the same process are not seen:
    :func:`clear_lookup_cache`)."""
    import torch
    return lookup(make_key(backend, torch.cuda.get_device_name(device_index), fmt, G, page, batch, capacity))[0]


def clear_lookup_cache() -> None:
    _cached_lookup.cache_clear()


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(path: Path):
    lock = path.with_suffix(path.suffix + ".lock")
    with open(lock, "a+") as f:
        try:
            import fcntl
            fcntl.flock(f, fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - not POSIX: the atomic replace still avoids torn files
            pass
        yield


def write_entries(directory: Path, gpu: str, entries: list[tuple[TuneKey, dict, dict]]) -> Path:
    """Merge ``(key, config, extra)`` entries into ``directory/<GPU>.json`` (replacing equal keys), under
    a lock, through a temporary file and ``os.replace``: readers see the old or the new file, whole.
    An existing file that is not usable here is replaced (it was ignored anyway)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    gpu = normalize_gpu_name(gpu)
    path = directory / f"{gpu}.json"
    with _locked(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            old = read_file(path, gpu, with_extra=True) or []
        merged = {k: {"key": asdict(k), "config": c, **extra} for k, c, extra in old}
        for k, c, extra in entries:
            merged[k] = {"key": asdict(k), "config": c, **extra}
        doc = {"schema": SCHEMA, "meta": current_meta(gpu),
               "entries": [merged[k] for k in sorted(merged, key=lambda k: tuple(asdict(k).values()))]}
        fd, tmp = tempfile.mkstemp(prefix=path.name, dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return path
