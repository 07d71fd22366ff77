"""Where a short decode's time goes: the timing floor of the benchmark's method, and the kernels of one call.

    python benchmarks/fixed_cost.py --shapes 1:8K,1:32K,8:8K --bits 2 4

Every figure is timed as ``foscar.bench.decode --cuda-graph`` times a decode (a CUDA-graph replay, the L2
flushed by writing 512 MiB before each, CUDA events, median of ``--iters``), so that the rows can be read
against its tables:

- ``floor, 1 kernel`` / ``floor, 2 kernels``: a graph of one (two) kernels that touch 4 bytes. What any
  decode of one (two) launches costs under this method, whatever it reads.
- ``read N MB``: a graph of one ``torch.sum`` over as many bytes as the decode reads, from DRAM (cold L2,
  dirty with the flush); and of the read-ceiling kernel (``foscar.bench.ceiling.read_kernel``) over them in
  16 KB per program, so that every SM streams at once (its output checked). The memory floor of that byte
  count, one launch.
- ``decode``: ``foscar.decode`` (backend ``auto``, the tuned launch), with the L2 flushed, and warm (a GPU
  sleep before each replay in place of the flush, so that the host stays ahead of the GPU).
- ``kernels``: each kernel of one decode (torch.profiler, L2 flushed): its duration, and its start after
  the previous kernel's end (the launch gap inside the graph).
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import Case, make_random_cache, parse_shapes

import foscar
from foscar.bench import as_graph, make_block_table, time_call
from foscar.bench.common import flush_l2
from foscar.bench.ceiling import checked_reader

FLUSH_BYTES = 512 * 2 ** 20


def shape_args(doc: str, shapes: str, bits: list):
    """The command line of the cost scripts: ``--shapes``, ``--bits``, ``--iters`` (median of)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes(shapes))
    p.add_argument("--bits", type=int, nargs="+", default=bits)
    p.add_argument("--iters", type=int, default=9)
    return p.parse_args()


def decode_inputs(B: int, L: int, bits: int, dev):
    """A random paged cache of the paper grid's problem (Hq 32, Hkv 8, D 128, shuffled pages), a query and an
    output for it."""
    cache = make_random_cache(Case(B, L, bits), make_block_table(B, L // 64, "shuffled", 0).to(dev))
    q = torch.randn(B, 32, 128, dtype=torch.bfloat16, device=dev)
    return cache, q, torch.empty_like(q)


def timed(fn, flush, iters):
    return time_call(as_graph(fn), iters=iters, warmup=5, flush=flush)["median_us"]


def timed_warm(fn, iters):
    """As :func:`timed`, the L2 left warm: a GPU sleep in place of the flush keeps the host ahead."""
    replay = as_graph(fn)
    for _ in range(5):
        replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        torch.cuda._sleep(200_000)
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in events)


READ_CHUNK = 4096  #: int32 a program of the streaming read: 16 KB, one 16-byte load a thread (BLOCK 4096)


def streaming_read(nbytes: int, dev):
    """The read-ceiling kernel over ``nbytes`` (rounded down to whole 16 KB chunks) of random int32, one chunk a
    program (:func:`foscar.bench.ceiling.checked_reader`: its result checked first)."""
    programs = max(1, nbytes // (4 * READ_CHUNK))
    x = torch.randint(-2 ** 31, 2 ** 31, (programs * READ_CHUNK,), dtype=torch.int32, device=dev)
    return checked_reader(x, READ_CHUNK, READ_CHUNK)


def kernel_rows(fn, flush, iters):
    """Per kernel of one graph replay: name, median duration and median gap after the previous kernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    replay = as_graph(fn)
    runs = []
    for _ in range(iters):
        flush_l2(flush)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replay()
            torch.cuda.synchronize()
        ks = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
        runs.append([(e.name, e.time_range.start, e.time_range.end) for e in ks])
    rows = []
    for i in range(min(len(r) for r in runs)):
        dur = statistics.median(r[i][2] - r[i][1] for r in runs)
        gap = statistics.median(r[i][1] - r[i - 1][2] for r in runs) if i else 0.0
        rows.append((runs[0][i][0][:60], dur, gap))
    return rows


def main():
    a = shape_args(__doc__, "1:8K,1:32K,8:8K", [2, 4])
    dev = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    tiny = torch.zeros(1, device=dev)
    print(f"GPU {torch.cuda.get_device_name(dev)}; CUDA-graph replays, L2 flushed ({FLUSH_BYTES >> 20} MiB), "
          f"median of {a.iters}\n")
    print("| what | µs |\n|---|---|")
    print(f"| floor, 1 kernel | {timed(lambda: tiny.add_(1), flush, a.iters):.1f} |")
    print(f"| floor, 2 kernels | {timed(lambda: (tiny.add_(1), tiny.mul_(1)), flush, a.iters):.1f} |")
    for (B, L) in a.shapes:
        for bits in a.bits:
            cache, q, out = decode_inputs(B, L, bits, dev)
            nbytes = B * L * cache.num_kv_heads * (bits * 2 * 128 // 8 + 16)  # codes and (s', z'), K and V
            blob = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
            dec = lambda: foscar.decode(q, cache, out=out)  # noqa: E731
            name = f"B {B}, L {L}, INT{bits}"
            print(f"| {name}: read {nbytes / 1e6:.1f} MB (torch.sum) | {timed(lambda: blob.sum(), flush, a.iters):.1f} |")
            print(f"| {name}: read {nbytes / 1e6:.1f} MB (Triton, {READ_CHUNK * 4 >> 10} KB a program) | "
                  f"{timed(streaming_read(nbytes, dev), flush, a.iters):.1f} |")
            print(f"| {name}: decode ({foscar.select_backend(q, cache)}) | {timed(dec, flush, a.iters):.1f} |")
            print(f"| {name}: decode, L2 warm (not flushed) | {timed_warm(dec, a.iters):.1f} |")
            for kname, dur, gap in kernel_rows(dec, flush, a.iters):
                print(f"| {name}: kernel `{kname}` | {dur:.1f} (starts {gap:.1f} after the previous) |")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
