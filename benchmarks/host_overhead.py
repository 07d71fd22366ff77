"""Host time of one eager decode call per backend, and of a planned run, on the present GPU:

    python benchmarks/host_overhead.py --shape 1:8K --bits 4

A decode step outside a CUDA graph (a Hugging Face ``generate`` loop, say) costs the larger of its host
time and its GPU time. For each path this prints the mean wall time per call of ``--calls``
back-to-back calls (one synchronize at the end: when the host time is the larger, this is the host
time; the median and range of ``--rounds`` rounds, the paths interleaved) beside the GPU time of one
call as a CUDA-graph replay (L2 flushed, median of 10). Where the first is well above the second,
eager decoding is host-bound on that path.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import Case, make_random_cache, parse_shapes

import foscar
from foscar.bench import as_graph, make_block_table
from foscar.bench import time_call as time_fn


def per_call_us(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=parse_shapes, default=parse_shapes("1:8K"))
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--calls", type=int, default=200, help="calls per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--profile", action="store_true", help="also print each path's top host functions (cProfile)")
    a = p.parse_args()
    (B, L), = a.shape
    dev = torch.device("cuda")
    cache = make_random_cache(Case(B, L, a.bits), make_block_table(B, L // 64, "shuffled", 0).to(dev))
    q = torch.randn(B, 32, 128, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=dev)
    status = {s.name: s.usable for s in foscar.backend_status(dev, cache.fmt, 4, cache.page_size)}
    print(f"B={B} L={L} INT{a.bits}; auto = {foscar.select_backend(q, cache)}")
    print(f"| path | eager µs per call, back to back: median (range) of {a.rounds} rounds | GPU µs (graph replay) |")
    print("|---|---|---|")
    runs = [("decode (auto)", lambda: foscar.decode(q, cache, out=out)),
            ("decode (triton)", lambda: foscar.decode(q, cache, out=out, backend="triton"))]
    if status["cute"]:
        from foscar.cute.launch import decode as cute_decode
        runs += [("cute v0", lambda: cute_decode(q, cache, out=out, warp_specialized=False)),
                 ("cute v1", lambda: cute_decode(q, cache, out=out, warp_specialized=True))]
    for backend in [b for b in ("triton", "cute") if status[b]]:
        plan = foscar.plan(q, cache, backend=backend)
        runs.append((f"plan.run ({backend})", lambda plan=plan: plan.run(q, cache, out)))
    eager = {name: [] for name, _ in runs}
    for _ in range(a.rounds):  # interleaved rounds: a slow spell of the host touches every path alike
        for name, fn in runs:
            eager[name].append(per_call_us(fn, a.calls))
    for name, fn in runs:
        gpu = time_fn(as_graph(fn), iters=10, warmup=3, flush=flush)["median_us"]
        e = sorted(eager[name])
        print(f"| {name} | {e[len(e) // 2]:.1f} ({e[0]:.1f}-{e[-1]:.1f}) | {gpu:.1f} |", flush=True)
    if a.profile:
        import cProfile
        import pstats
        for name, fn in runs:
            prof = cProfile.Profile()
            prof.runcall(lambda: [fn() for _ in range(a.calls)])
            print(f"\n### {name}: {a.calls} calls, by own time")
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
