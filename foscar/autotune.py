"""The autotune cache: per-GPU kernel configurations, looked up by shape and quantization axis.

A **key** (:class:`TuneKey`) names the backend, the GPU (normalised like vLLM's device names), the cache
format (bits, K axis, V axis, group size, head dim), the GQA ratio, the page size, two buckets (batch,
powers of two; context length, powers of two from 1K) and the query tokens per sequence (``q_len``: 1 for a
decode, more for a step of speculative verification, :mod:`foscar.multitoken`; a file's key leaves it out
where it is 1). A **config** is a dict of the
backend's launch parameters (Triton: ``num_splits``, ``num_warps``, ``block_n``, ``prefetch``; CuTe:
``warp_specialized``, ``ctas_per_sm``, ``num_splits``; ``None`` values leave the kernel's heuristic in
charge). :func:`tuned_config` is what the launchers call.

Files: ``<GPU>.json``, schema :data:`SCHEMA`: metadata (the foscar, Triton, cutlass-dsl and CUDA
versions installed when it was last written, the GPU name) and a list of entries, each with its key, its
config, ``versions`` (the version of its backend's package it was tuned with, :data:`BACKEND_PACKAGES`;
an entry without it was tuned with the versions of the file's metadata) and its measured times.
:func:`lookup` reads, in order (:func:`search_path`), ``$FOSCAR_TUNING_DIR``, the user cache folder
(``$XDG_CACHE_HOME/foscar/tuning``, default ``~/.cache/foscar/tuning``) and the files shipped as package
data of :mod:`foscar.tuning` (through :mod:`importlib.resources`: a wheel, a zip or an editable
install, where they are the source tree's ``foscar/tuning``). The first file with an entry of the key's
family that applies here wins, and within it the entry with the nearest buckets. Nothing found: the
built-in heuristic (an empty config). ``FOSCAR_TUNING=0`` in the environment turns the launchers' lookups off.

Validity is per entry: a Triton entry applies when the installed Triton's major.minor is the one it was
tuned with, a CuTe entry when the installed nvidia-cutlass-dsl is the version it was tuned with (its
configs are static kernel parameters); other entries of the same file still apply. Entries skipped for
their version give one warning per file and backend. A corrupt, truncated or foreign file (another
schema, another GPU, another foscar major.minor) gives one warning naming it and is skipped as a whole:
never a crash, never half-read. :func:`tuning_report` says which files are found and which of their
entries apply here (``foscar info``).

:func:`write_entries` merges entries into a file atomically (a lock file, a temporary file and
``os.replace``), so concurrent tuners never leave a torn file; the entries it keeps keep the versions
they were tuned with.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path

from ._version import __version__ as FOSCAR_VERSION
from .errors import InvalidArgumentError

SCHEMA = "foscar-tuning-v1"
ENV_DIR = "FOSCAR_TUNING_DIR"
#: ``FOSCAR_TUNING=0``: the launchers read no tuned config (every call its heuristic), for A/B runs of the kernels
ENV_OFF = "FOSCAR_TUNING"
PACKAGE_DATA = "foscar.tuning"
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
    q_len: int = 1

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


def make_key(backend: str, gpu: str, fmt, gqa: int, page: int, batch: int, max_len: int, q_len: int = 1) -> TuneKey:
    return TuneKey(backend, normalize_gpu_name(gpu), fmt.bits, fmt.k_axis, fmt.v_axis, fmt.group_size, fmt.head_dim,
                   gqa, page, bucket(batch), bucket(max_len, CTX_MIN), q_len)


# --------------------------------------------------------------------------------------------
# Versions and folders
# --------------------------------------------------------------------------------------------
#: The package each backend's entries were tuned with: ``(metadata field, distribution, how many leading
#: version parts must match the installed one; None: all)``. Triton: major.minor; cutlass-dsl: exact.
BACKEND_PACKAGES = {"triton": ("triton", "triton", 2), "cute": ("cutlass_dsl", "nvidia-cutlass-dsl", None)}


def _dist_version(name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def current_meta(gpu: str) -> dict:
    """The metadata a file written now carries (also the installed versions entries are checked against)."""
    import torch
    return {"foscar": FOSCAR_VERSION, "triton": _dist_version("triton"),
            "cutlass_dsl": _dist_version("nvidia-cutlass-dsl"), "cuda": torch.version.cuda,
            "gpu": normalize_gpu_name(gpu)}


def _leading(v: str, parts: int | None) -> str:
    return v if parts is None else ".".join(v.split(".")[:parts])


def meta_mismatch(meta: dict, here: dict) -> str | None:
    """Why a whole file does not fit this install, or ``None``: written by another foscar major.minor
    (the kernels and their launch parameters change between them). The backends' package versions are
    checked per entry (:func:`entry_mismatch`)."""
    tuned, installed = meta.get("foscar"), here.get("foscar")
    if tuned is not None and installed is not None and _leading(str(tuned), 2) != _leading(str(installed), 2):
        return f"foscar {tuned} (this install: {installed})"
    return None


def entry_versions(backend: str, meta: dict) -> dict:
    """The version of ``backend``'s package in ``meta`` (a file's metadata, or :func:`current_meta`), as
    an entry records it: ``{"triton": "3.6.0"}``; ``{}`` for a backend without one."""
    pkg = BACKEND_PACKAGES.get(backend)
    return {} if pkg is None else {pkg[0]: meta.get(pkg[0])}


def entry_mismatch(backend: str, versions: dict, here: dict) -> str | None:
    """Why an entry of ``backend`` tuned with ``versions`` does not apply under the installed versions
    ``here`` (:func:`current_meta`), or ``None``. A backend without a package, or an entry without a
    recorded version, has nothing to check."""
    pkg = BACKEND_PACKAGES.get(backend)
    if pkg is None or versions.get(pkg[0]) is None:
        return None
    name, dist, parts = pkg
    tuned, installed = str(versions[name]), here.get(name)
    if installed is None:
        return f"tuned with {dist} {tuned}, which is not installed"
    if _leading(tuned, parts) != _leading(str(installed), parts):
        return f"tuned with {dist} {tuned} (installed: {installed})"
    return None


@dataclass(frozen=True)
class Source:
    """A folder :func:`lookup` reads: where it comes from (``$FOSCAR_TUNING_DIR``, ``user cache`` or
    ``package data``) and the folder (a :class:`~pathlib.Path` or an :mod:`importlib.resources`
    traversable, which may lie inside a zip)."""
    origin: str
    folder: object

    def file(self, gpu: str):
        return self.folder.joinpath(f"{normalize_gpu_name(gpu)}.json")


def shipped_folder():
    """The tuned configs shipped with foscar: the package data of :data:`PACKAGE_DATA`."""
    return resources.files(PACKAGE_DATA)


def _user_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "foscar" / "tuning"


def search_path() -> list[Source]:
    """Where :func:`lookup` looks, in order: ``$FOSCAR_TUNING_DIR`` (when set), the user cache folder,
    the package data."""
    out = [Source(f"${ENV_DIR}", Path(os.environ[ENV_DIR]))] if os.environ.get(ENV_DIR) else []
    return out + [Source("user cache", _user_cache()), Source("package data", shipped_folder())]


def search_dirs() -> list:
    """The folders of :func:`search_path`, in order."""
    return [s.folder for s in search_path()]


def user_dir() -> Path:
    """Where ``foscar tune`` writes by default: ``$FOSCAR_TUNING_DIR``, else the user cache folder."""
    return Path(os.environ[ENV_DIR]) if os.environ.get(ENV_DIR) else _user_cache()


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One entry of a file: its key, its config, the version of its backend's package it was tuned with
    (:func:`entry_versions`) and its other fields (such as its measured times)."""
    key: TuneKey
    config: dict
    versions: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        key = asdict(self.key)
        if key["q_len"] == 1:  # a one-token decode's key as files have always written it
            del key["q_len"]
        return {"key": key, "config": self.config, "versions": self.versions, **self.extra}


_RESERVED = ("key", "config", "versions")
_WARNED: set[str] = set()


class _Unusable(ValueError):
    """A file that is read as a whole or not at all: why not."""


def _warn_once(path: str, why: str, tag: str = "") -> None:
    if path + tag not in _WARNED:
        _WARNED.add(path + tag)
        warnings.warn(f"foscar tuning file {path}: {why}", RuntimeWarning, stacklevel=4)


def _parse(text: str, gpu: str) -> tuple[dict, list[Entry]]:
    """The metadata and every entry of a file's text (those that do not apply here included); raises
    :class:`_Unusable` for a file that is corrupt or not for this GPU and foscar version."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise _Unusable(f"malformed JSON (truncated or corrupt: {e})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise _Unusable(f"not a {SCHEMA} file")
    try:
        meta = doc["meta"]
        if normalize_gpu_name(meta["gpu"]) != normalize_gpu_name(gpu):
            raise _Unusable(f"written for GPU {meta['gpu']!r}, not {normalize_gpu_name(gpu)!r}")
        why = meta_mismatch(meta, {"foscar": FOSCAR_VERSION})
        if why:
            raise _Unusable(f"written by another version: {why}")
        entries = []
        for e in doc["entries"]:
            key = TuneKey(**e["key"])
            if not all(isinstance(v, (str, int)) for v in asdict(key).values()) or min(
                    key.batch_bucket, key.ctx_bucket, key.q_len) < 1:
                raise _Unusable(f"malformed (an entry's key: {e['key']})")
            versions = e.get("versions", entry_versions(key.backend, meta))
            if not isinstance(e["config"], dict) or not isinstance(versions, dict):
                raise _Unusable("malformed (an entry's config or versions is not an object)")
            extra = {k: v for k, v in e.items() if k not in _RESERVED}
            entries.append(Entry(key, dict(e["config"]), dict(versions), extra))
        return meta, entries
    except _Unusable:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _Unusable(f"malformed ({type(e).__name__}: {e})") from None


def _open(file, gpu: str) -> tuple[tuple[dict, list[Entry]] | None, str | None]:
    """``((meta, entries), None)``; ``(None, None)`` if ``file`` is absent; ``(None, why)`` if it is not
    usable here as a whole."""
    try:
        if not file.is_file():
            return None, None
        return _parse(file.read_text(encoding="utf-8"), gpu), None
    except FileNotFoundError:
        return None, None
    except UnicodeDecodeError:
        return None, "malformed (not UTF-8 text)"
    except OSError as e:
        return None, f"unreadable ({e})"
    except _Unusable as e:
        return None, str(e)


def _load(file, gpu: str) -> tuple[dict, list[Entry]] | None:
    """:func:`_open`, with one warning per file that exists but is not usable here."""
    loaded, why = _open(file, gpu)
    if why:
        _warn_once(str(file), f"{why}; ignored (the next folder or the heuristic applies)")
    return loaded


def read_file(path, gpu: str, *, with_extra: bool = False) -> list[tuple] | None:
    """The entries of the file ``path`` that apply here (:func:`entry_mismatch`), ``(key, config)``
    (``with_extra``: ``(key, config, extra)``, the entry's other fields, such as its measured times), or
    ``None`` if the file is absent or not usable here as a whole (with one warning if it exists)."""
    loaded = _load(Path(path) if isinstance(path, (str, os.PathLike)) else path, gpu)
    if loaded is None:
        return None
    here = current_meta(gpu)
    usable = [e for e in loaded[1] if entry_mismatch(e.key.backend, e.versions, here) is None]
    return [(e.key, e.config, e.extra) if with_extra else (e.key, e.config) for e in usable]


def _entries(n: int, backend: str = "") -> str:
    return f"{n} {backend + ' ' if backend else ''}{'entry' if n == 1 else 'entries'}"


def lookup(key: TuneKey) -> tuple[dict, str]:
    """``(config, source)``: the tuned config of the nearest-bucket entry of ``key``'s family that applies
    here, from the first file of :func:`search_path` that has one, or ``({}, "heuristic")``. A file's
    entries of ``key.backend`` tuned with another version of its package give one warning per file and
    backend."""
    here = current_meta(key.gpu)
    for source in search_path():
        file = source.file(key.gpu)
        loaded = _load(file, key.gpu)
        if loaded is None:
            continue
        family, stale = [], {}
        for e in loaded[1]:
            if e.key.backend != key.backend:
                continue
            why = entry_mismatch(key.backend, e.versions, here)
            if why is not None:
                stale[why] = stale.get(why, 0) + 1
            elif e.key.same_family(key):
                family.append(e)
        if stale:
            whys = "; ".join(f"{_entries(n, key.backend)} {why}" for why, n in stale.items())
            _warn_once(str(file), f"{whys}: not applied (for their shapes the next folder or the heuristic "
                                  f"applies; `foscar tune --backend {key.backend}` re-tunes them)",
                       tag="#" + key.backend)
        if family:
            best = min(family, key=lambda e: (key.distance(e.key), e.key.batch_bucket, e.key.ctx_bucket))
            return dict(best.config), f"{file} (B<={best.key.batch_bucket}, L<={best.key.ctx_bucket})"
    return {}, "heuristic"


def tuned_config(backend: str, q, cache, G: int, q_len: int = 1) -> dict:
    """The tuned launch config of ``backend`` for a decode of ``q`` over ``cache`` (``{}``: none tuned),
    keyed by GPU, format, GQA, page size, the batch (the cache's sequences) and capacity buckets and ``q_len`` (a
    step's tokens per sequence): host facts only, no device read. Each kernel's launcher reads its own keys from
    it. With ``FOSCAR_TUNING=0`` in the environment, ``{}`` always."""
    import torch
    if os.environ.get(ENV_OFF) == "0":
        return {}
    index = q.device.index
    if index is None:
        index = torch.cuda.current_device() if q.device.type == "cuda" else 0
    return _cached_lookup(backend, index, cache.fmt, G, cache.page_size, cache.batch_size, cache.table_capacity,
                          q_len)


@functools.lru_cache(maxsize=1024)
def _cached_lookup(backend: str, device_index: int, fmt, G: int, page: int, batch: int, capacity: int,
                   q_len: int = 1) -> dict:
    """Looked up once per process and call shape (files written later in the same process are not seen:
    :func:`clear_lookup_cache`)."""
    import torch
    return lookup(make_key(backend, torch.cuda.get_device_name(device_index), fmt, G, page, batch, capacity,
                           q_len))[0]


def clear_lookup_cache() -> None:
    _cached_lookup.cache_clear()


# --------------------------------------------------------------------------------------------
# The report of ``foscar info``
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BackendTuning:
    """One backend's entries in a file: how many, how many apply here, and ``(why, count)`` for the rest."""
    backend: str
    entries: int
    applicable: int
    not_applicable: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class TuningFile:
    """A file of the search path: where it comes from (:attr:`Source.origin`), its path (or the resource's
    location), whether it exists, why it is skipped as a whole (``None``: it is read), its metadata and
    its entries per backend."""
    origin: str
    location: str
    exists: bool
    skipped: str | None = None
    meta: dict = field(default_factory=dict)
    backends: tuple[BackendTuning, ...] = ()

    def applicable(self, backend: str) -> int:
        return sum(b.applicable for b in self.backends if b.backend == backend)


@dataclass(frozen=True)
class TuningReport:
    """:func:`tuning_report`: the GPU, the installed versions (:func:`current_meta`) and the files of the
    search path, in order."""
    gpu: str
    installed: dict
    files: tuple[TuningFile, ...]

    def in_use(self, backend: str) -> TuningFile | None:
        """The first file with an entry of ``backend`` that applies here (for a shape family it lacks,
        :func:`lookup` goes on to the next)."""
        return next((f for f in self.files if f.applicable(backend)), None)

    def lines(self) -> list[str]:
        """The report as text lines, for ``foscar info``."""
        names = {b: pkg[1] for b, pkg in BACKEND_PACKAGES.items()}
        installed = ", ".join(f"{names[b]} {self.installed.get(pkg[0]) or 'not installed'}"
                              for b, pkg in BACKEND_PACKAGES.items())
        out = [f"tuning files for {self.gpu} ({installed}), in lookup order:"]
        if not any(f.origin == f"${ENV_DIR}" for f in self.files):
            out.append(f"  ${ENV_DIR}: not set")
        for f in self.files:
            head = f"  {f.origin}: {f.location}"
            if not f.exists:
                out.append(f"{head}: none")
                continue
            if f.skipped:
                out.append(f"{head}: skipped as a whole: {f.skipped}")
                continue
            labels = {"foscar": "foscar", "triton": "triton", "cutlass_dsl": "nvidia-cutlass-dsl", "cuda": "CUDA"}
            written = ", ".join(f"{label} {f.meta[k]}" for k, label in labels.items() if f.meta.get(k))
            out.append(f"{head} (written with {written or 'no versions recorded'})")
            for b in f.backends:
                why = "; ".join(f"{n} {w}" for w, n in b.not_applicable)
                out.append(f"    {b.backend}: {_entries(b.entries)}, {b.applicable} apply here"
                           + (f"; not: {why}" if why else ""))
        used = "; ".join(f"{b}: {f.origin if f else 'none (the launcher heuristic)'}"
                         for b, f in ((b, self.in_use(b)) for b in BACKEND_PACKAGES))
        return out + [f"  in use: {used}"]


def tuning_report(gpu_name: str) -> TuningReport:
    """Which tuning files :func:`lookup` finds for the GPU ``gpu_name`` (e.g.
    ``torch.cuda.get_device_name()``), where each comes from, how many entries each has per backend, how
    many of them apply here (the installed Triton and nvidia-cutlass-dsl versions) and why the others do
    not. Reads the files; warns about nothing."""
    gpu = normalize_gpu_name(gpu_name)
    here = current_meta(gpu)
    files = []
    for source in search_path():
        file = source.file(gpu)
        loaded, why = _open(file, gpu)
        if loaded is None:
            files.append(TuningFile(source.origin, str(file), why is not None, why))
            continue
        meta, entries = loaded
        per: dict[str, dict] = {}
        for e in entries:
            mismatch = entry_mismatch(e.key.backend, e.versions, here)
            counts = per.setdefault(e.key.backend, {})
            counts[mismatch] = counts.get(mismatch, 0) + 1
        order = [b for b in BACKEND_PACKAGES if b in per] + sorted(set(per) - set(BACKEND_PACKAGES))
        backends = tuple(BackendTuning(b, sum(per[b].values()), per[b].get(None, 0),
                                       tuple((w, n) for w, n in per[b].items() if w is not None)) for b in order)
        files.append(TuningFile(source.origin, str(file), True, None, dict(meta), backends))
    return TuningReport(gpu, here, tuple(files))


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


def _sort_key(key: TuneKey) -> tuple:
    return tuple((type(v).__name__, v) for v in asdict(key).values())


def write_entries(directory: Path, gpu: str, entries: list[tuple[TuneKey, dict, dict]]) -> Path:
    """Merge ``(key, config, extra)`` entries into ``directory/<GPU>.json`` (replacing equal keys), under
    a lock, through a temporary file and ``os.replace``: readers see the old or the new file, whole.
    The new entries record the installed version of their backend's package; the entries kept keep
    theirs (those of another version included). An existing file that is not usable here as a whole is
    replaced (it was ignored anyway)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    gpu = normalize_gpu_name(gpu)
    path = directory / f"{gpu}.json"
    here = current_meta(gpu)
    with _locked(path):
        loaded, _ = _open(path, gpu)
        merged = {e.key: e for e in (loaded[1] if loaded else [])}
        for k, c, extra in entries:
            merged[k] = Entry(k, dict(c), entry_versions(k.backend, here),
                              {n: v for n, v in dict(extra).items() if n not in _RESERVED})
        doc = {"schema": SCHEMA, "meta": here, "entries": [merged[k].to_json() for k in sorted(merged, key=_sort_key)]}
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
