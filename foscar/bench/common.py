"""Pieces every timing tool shares: random packed caches at any size (no quantization pass), page tables,
timing with the L2 flushed and CUDA events, CUDA-graph capture, and slicing a cache for a float64 check.

Used by ``foscar tune`` (:mod:`foscar.tune`), ``benchmarks/bench_decode.py`` and
``benchmarks/sweep_triton.py``; the argparse types (:func:`int_in`, :func:`writable_dir`, ...) by the
``foscar`` command line, so that a bad option is refused while the arguments are parsed.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..cache import PageTable, QuantKVCache
from ..errors import FoscarError, InvalidArgumentError
from ..format import CHANNEL, KVFormat

L2_FLUSH_BYTES = 512 * 2 ** 20
#: How the L2 is flushed before each timed call (:func:`flush_l2`): ``"write"`` zeroes the flush buffer, whose dirty
#: lines are then written back inside the timed call (about 8 µs where it reads 151 MB or more on the H200,
#: ``docs/bench/h200/flush-writeback.md``); ``"read"`` reads it, leaving the L2 cold and clean, the state FlashInfer's
#: rotating-buffer benchmarks time in. Set by the environment's ``FOSCAR_L2_FLUSH`` or ``foscar bench speed --flush``.
L2_FLUSHES = ("write", "read")


def l2_flush_mode() -> str:
    """The flush :func:`flush_l2` does: ``FOSCAR_L2_FLUSH`` (one of :data:`L2_FLUSHES`), ``"write"`` when unset."""
    mode = os.environ.get("FOSCAR_L2_FLUSH", "write")
    if mode not in L2_FLUSHES:
        raise InvalidArgumentError("FOSCAR_L2_FLUSH", f"one of {L2_FLUSHES}", mode)
    return mode


def flush_l2(flush: torch.Tensor) -> None:
    """Evict the L2 before a timed call by streaming through ``flush`` (a buffer several times its size): written
    (zeroed) or read, as :func:`l2_flush_mode` says."""
    if l2_flush_mode() == "read":
        torch.sum(flush.view(torch.int32), dtype=torch.int32)
    else:
        flush.zero_()


def int_in(minimum: int, maximum: int | None = None, want: str | None = None):
    """An argparse type: an integer in ``[minimum, maximum]`` (no upper bound when ``maximum`` is None);
    ``want`` says so in the error message (default: the bounds)."""
    want = want or (f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected {want}, got {value}")
        return value
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


#: Seeds a ``torch.Generator`` takes.
parse_seed = int_in(-2 ** 63, 2 ** 64 - 1, "an integer in [-2**63, 2**64)")


def library_option(e: FoscarError, options: dict[str, str]) -> str | None:
    """The command-line option (``options``: library argument name -> option) a library error is about:
    an :class:`InvalidArgumentError`'s argument, or the ``name=value`` an :class:`UnsupportedError` names."""
    name = e.argument if isinstance(e, InvalidArgumentError) else getattr(e, "what", "").split("=")[0]
    return options.get(name)


def parse_heads(text: str) -> tuple[int, int]:
    """An argparse type: ``"Hq:Hkv"``, query heads a positive multiple of the KV heads."""
    try:
        hq, hkv = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected Hq:Hkv, e.g. 32:8, got {text!r}") from None
    if hkv < 1 or hq < hkv or hq % hkv:
        raise argparse.ArgumentTypeError(f"expected Hq:Hkv with Hq a positive multiple of Hkv >= 1, got {text!r}")
    return hq, hkv


def _probe_writable(folder: Path, text: str) -> None:
    """Create and remove a file in ``folder``: the one test of writability that holds for every user
    (root included) and file system."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot write in folder {str(folder)!r} "
                                         f"({e.strerror or e})") from None


def writable_dir(text: str) -> Path:
    """An argparse type: an output folder that is writable, or that can be made (its nearest existing
    parent is a writable folder). Nothing is created."""
    path = Path(text)
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r}: expected a folder, got a file")
        _probe_writable(path, text)
        return path
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(parent)!r} is a file, not a folder")
    _probe_writable(parent, text)
    return path


def writable_file(text: str) -> Path:
    """An argparse type: an output file whose folder exists and is writable (the file itself is neither
    a folder nor read-only). Nothing is created."""
    path = Path(text)
    parent = path.absolute().parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a file name, got a folder")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: folder {str(parent)!r} does not exist")
    _probe_writable(parent, text)
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the file is not writable")
    return path


def readable_file(text: str) -> Path:
    """An argparse type: an existing file this process can read."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a file, got a folder")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the file is not readable")
    return path


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocator's refusal (torch raises a plain RuntimeError for host memory)."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def first_line(e: BaseException) -> str:
    """An exception's message as one line (its first), for a command's one-line error."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def parse_tokens(text: str) -> int:
    """A token count as written on a command line: ``"128K"`` -> 131072, ``"1M"`` -> 1048576, ``"4096"``
    -> 4096. Raises ``ValueError`` for anything else."""
    t = text.strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


def make_block_table(batch: int, pages: int, order: str = "shuffled", seed: int = 0) -> torch.Tensor:
    """int32 ``[batch, pages]``: sequence ``b`` owns pool pages ``[b*pages, (b+1)*pages)``, in order
    (``"identity"``) or shuffled within its own range (``"shuffled"``: a dense read of the pool is then a
    per-sequence permutation of the tokens, which attention does not see)."""
    base = torch.arange(batch, dtype=torch.int64)[:, None] * pages
    if order == "identity":
        local = torch.arange(pages).expand(batch, pages)
    elif order == "shuffled":
        gen = torch.Generator().manual_seed(seed)
        local = torch.argsort(torch.rand(batch, pages, generator=gen), dim=1)
    else:
        raise ValueError(f"page order {order!r}: expected 'identity' or 'shuffled'")
    return (base + local).to(torch.int32)


def _random_params(fmt: KVFormat, tensor: str, block_table: torch.Tensor, page: int, kv_heads: int,
                   gen: torch.Generator) -> torch.Tensor:
    """FP32 ``(s', z')`` pool ``[pages, Hkv, rows, cols, 2]`` of min-max groups of values in about [-2, 2] (an FP4
    block format: its block-scale bytes).
    Channel-wise groups longer than a page are stored in each of their pages: drawn per group, repeated
    over its pages in token order, then scattered by the table."""
    B, pages = block_table.shape
    dev = block_table.device
    if fmt.is_fp4:  # block-scale bytes [pages, Hkv, page, D / block]: scales in about [0.5, 2]
        lo, hi = (0x30, 0x41) if fmt.fp4_spec.scale == "e4m3" else (126, 129)
        return torch.randint(lo, hi, (B * pages, kv_heads, page, fmt.head_dim // fmt.group_size), generator=gen,
                             device=dev).to(torch.uint8)
    rows, cols = fmt.param_shape(tensor, page)
    per_group = fmt.group_size // page if fmt.axis(tensor) == CHANNEL and page < fmt.group_size else 1
    shape = (B, pages // per_group, kv_heads, rows, cols)
    lo = -1.5 - 0.5 * torch.rand(shape, generator=gen, device=dev)
    hi = 1.5 + 0.5 * torch.rand(shape, generator=gen, device=dev)
    sp, zp = fmt.op.fold((hi - lo) / ((1 << fmt.bits) - 1), lo)
    par = torch.stack([sp, zp], dim=-1).repeat_interleave(per_group, dim=1)
    pool = torch.empty(B * pages, kv_heads, rows, cols, 2, dtype=torch.float32, device=dev)
    pool[block_table.reshape(-1).long()] = par.reshape(B * pages, kv_heads, rows, cols, 2)
    return pool


def random_cache(fmt: KVFormat, block_table: torch.Tensor, seq_len: int, *, kv_heads: int, page: int,
                 seed: int = 0) -> QuantKVCache:
    """A full cache of random packed codes (every int32 word is valid) and random finite ``(s', z')``, on
    ``block_table``'s device; every sequence ``seq_len`` tokens (whole pages and channel-wise groups), its BF16
    windows zeros (a ring of zeros in every slot: a step reads any of them). Decode speed does not depend on the
    values: no quantization pass needed."""
    B, pages = block_table.shape
    dev = block_table.device
    gen = torch.Generator(device=dev).manual_seed(seed)  # on the device: caches of many GB build in moments
    words = fmt.words_per_page("k", page)
    codes = [torch.randint(-2 ** 31, 2 ** 31, (B * pages, kv_heads, words), dtype=torch.int32, generator=gen,
                           device=dev) for _ in range(2)]

    def window(n):
        return torch.zeros(B, kv_heads, n, fmt.head_dim, dtype=torch.bfloat16, device=dev)
    cache = QuantKVCache(fmt, k_codes=codes[0], k_params=_random_params(fmt, "k", block_table, page, kv_heads, gen),
                         v_codes=codes[1], v_params=_random_params(fmt, "v", block_table, page, kv_heads, gen),
                         seq_lens=torch.full((B,), seq_len, dtype=torch.int32, device=dev),
                         page_table=PageTable.from_block_table(block_table),
                         k_sink=window(fmt.sink), v_sink=window(fmt.sink),
                         k_recent=window(fmt.recent_capacity), v_recent=window(fmt.recent_capacity))
    cache.ring_from = fmt.ring_keep_from(cache.seq_lens).to(torch.int32)
    return cache


_FIELDS = ("k_codes", "k_params", "v_codes", "v_params", "tensor_scales", "k_sink", "v_sink", "k_recent", "v_recent")


def cache_to(cache: QuantKVCache, device) -> QuantKVCache:
    """The same cache on another device."""
    pt = cache.page_table
    table = PageTable(pt.block_table.to(device), pt.num_pages.to(device),
                      None if pt.quantized_lens is None else pt.quantized_lens.to(device), pt.page_size)
    return QuantKVCache(cache.fmt, **{n: getattr(cache, n).to(device) for n in _FIELDS},
                        seq_lens=cache.seq_lens.to(device), page_table=table, contiguous=cache.contiguous)


def one_head_cache(cache: QuantKVCache, b: int, h: int) -> QuantKVCache:
    """Sequence ``b``, KV head ``h`` of a paged cache, as a cache of its own (copies of its pages only):
    what a float64 check of one slice of a large timed shape dequantizes."""
    pt = cache.page_table
    pages = pt.block_table[b, : int(pt.num_pages[b])].long()
    pooled = {n: getattr(cache, n)[pages, h: h + 1].contiguous() for n in ("k_codes", "k_params", "v_codes", "v_params")}
    windows = {n: getattr(cache, n)[b: b + 1, h: h + 1].contiguous() for n in ("k_sink", "v_sink", "k_recent", "v_recent")}
    table = PageTable.from_block_table(torch.arange(pages.numel(), dtype=torch.int32, device=cache.device)[None])
    return QuantKVCache(cache.fmt, **pooled, **windows, seq_lens=cache.seq_lens[b: b + 1].clone(), page_table=table,
                        tensor_scales=cache.tensor_scales.clone())


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``||a - ref||_2 / ||ref||_2`` over the whole tensor, in float64."""
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm())


def summarize_us(times_us: list[float]) -> dict:
    return {"median_us": statistics.median(times_us), "min_us": min(times_us), "all_us": list(times_us)}


def time_call(fn: Callable[[], object], *, iters: int, warmup: int, flush: torch.Tensor | None = None,
              before: Callable[[], object] | None = None) -> dict:
    """Median/min/all of ``iters`` calls (µs) after ``warmup``: the L2 flushed before each (:func:`flush_l2` of
    ``flush``), or ``before()`` run instead (a study of the flush itself), CUDA events around the call alone."""
    return time_interleaved({"call": fn}, iters=iters, warmup=warmup, flush=flush, before=before)["call"]


def time_interleaved(fns: dict, *, iters: int, warmup: int, flush: torch.Tensor | None = None,
                     before: Callable[[], object] | None = None) -> dict:
    """:func:`time_call` of several calls in rounds: each round times every call of ``fns`` (name -> call) once, in
    order, the L2 flushed (or ``before()`` run) before each, so that a slow spell of the GPU (its clocks after a heavy
    call, another process) touches every call alike and their ratios hold. Returns name -> median/min/all (µs)."""
    from .._checks import check_int
    if (flush is None) == (before is None):
        raise TypeError("give exactly one of flush and before")
    if not isinstance(fns, dict) or not fns or not all(callable(fn) for fn in fns.values()):
        raise InvalidArgumentError("fns", "a non-empty dict of name -> callable", type(fns).__name__)
    check_int("iters", iters, minimum=1)
    check_int("warmup", warmup, minimum=0)
    before = before if before is not None else functools.partial(flush_l2, flush)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before()
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: summarize_us([a.elapsed_time(b) * 1e3 for a, b in pairs]) for name, pairs in events.items()}


def as_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (warmed on a side stream first); returns its replay, which holds ``fn``: the
    tensors ``fn`` holds (its closure, its defaults) live as long as the replay that reads their memory does. (A
    replay of a graph whose input was freed reads whatever the allocator put there since, or, once the allocator has
    given that memory back to the driver, stops on an illegal address.)"""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay(_inputs=fn):
        graph.replay()
    return replay


def to_csv(rows: list[dict], columns: Sequence[str]) -> str:
    """``rows`` as CSV text with a header of ``columns`` (a missing field is empty)."""
    import csv
    import io
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def run_reporting(fn: Callable[[], int], where: str, *, oom_hint: str, options: dict | None = None) -> int:
    """``fn()``, with what stops a command reported as one line after ``where`` ("prog mode: error:"): a
    foscar error (exit 2; named by its option when ``options`` maps the library's argument names to the
    command's, :func:`library_option`), an OS error while it ran (exit 1), running out of memory (exit 1,
    with ``oom_hint``). Anything else is a bug and propagates."""
    try:
        return fn()
    except FoscarError as e:
        option = library_option(e, options) if options else None
        print(f"{where} {'argument ' + option + ': ' if option else ''}{first_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # the output folder made unwritable, or the disk full, while it ran
        print(f"{where} {first_line(e)}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as e:
        if not out_of_memory(e):
            raise
        print(f"{where} out of memory ({oom_hint}): {first_line(e)}", file=sys.stderr)
        return 1
