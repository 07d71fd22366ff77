"""v1's kernel switches (``foscar.cute.config``) timed through ``foscar.decode`` (the tuned configs) on the paper grid:

    python benchmarks/sweep_switches.py --variants shipped "PROLOGUE_BY_BITS=2:q_first" "COMBINE_PDL=1" \
        [--shapes 1:8K,8:32K] [--bits 2 4] [--heads 32:1] [--axes token:token channel:token] [--choose FILE]

Each variant is ``shipped`` (the switches as committed) or ``run_with.py`` words (``NAME=VALUE`` separated by
spaces, one argument), set on top of the shipped switches. Per shape and bits (random codes, Hq 32, Hkv 8 or
``--heads``, D 128, g 128, token-wise K and V or each ``--axes`` K:V pair, page 64, shuffled pages): each variant's
output is first held to the Triton kernel's
(a wrong one is printed and not timed), then timed as a CUDA-graph replay with the L2 flushed
(``fixed_cost.timed``, median of ``--iters``), all in one process. The last columns: each variant's time over the
first's. With ``--kernels`` the kernels' own durations (torch profiler, ``fixed_cost.kernel_rows``) follow each
time. Last, each variant's geomean over the first's per bit width; ``--choose FILE`` writes the fastest
variant's words (every case correct, over both bit widths).
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import parse_shapes
from fixed_cost import FLUSH_BYTES, kernel_rows, timed
from run_with import SWITCHES, apply, settings

import foscar
from foscar.bench import make_block_table, random_cache
from foscar.bench.common import parse_heads
from foscar.cute import config as cute_config

PAPER = "1:8K,1:32K,1:128K,1:512K,8:8K,8:32K,8:128K,8:512K,64:8K,64:16K,64:32K,64:64K,64:128K"
SHIPPED = {name: getattr(cute_config, name) for name in SWITCHES}


def set_variant(variant: str) -> None:
    """The shipped switches, then the variant's (the configs are cached: the cache is cleared; the compile cache
    keys on the config, which holds every switch)."""
    apply({} if variant == "shipped" else settings(variant.split()), SHIPPED)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes(PAPER))
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    p.add_argument("--heads", type=parse_heads, default=(32, 8), help="HQ:HKV (default 32:8)")
    p.add_argument("--axes", nargs="+", default=["token:token"], help="K:V quantization axes (default token:token)")
    p.add_argument("--variants", nargs="+", default=["shipped"], help="'shipped' or run_with.py words")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--kernels", action="store_true", help="each kernel's own duration too (torch profiler)")
    p.add_argument("--choose", help="write the fastest variant here as run_with.py words")
    p.add_argument("--warm", action="store_true", help="decode each case once per variant and time nothing: the "
                   "kernels compiled into the disk cache (processes of one variant each at once, then the timed run)")
    a = p.parse_args()
    for v in a.variants:
        set_variant(v)  # a bad variant fails here, before any timing
    dev = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    axes = [tuple(x.split(":")) for x in a.axes]
    print(f"| B | L | bits | K/V | {' | '.join(a.variants)} µs | {' | '.join(v + ' / first' for v in a.variants[1:])} |")
    print("|" + "---|" * (4 + 2 * len(a.variants) - 1))
    logs = {(v, bits): [] for v in a.variants for bits in a.bits}
    for (B, L) in a.shapes:
        bt = make_block_table(B, L // 64, "shuffled", 0).to(dev)
        for bits, (k_axis, v_axis) in ((b, x) for b in a.bits for x in axes):
            fmt = foscar.KVFormat(bits, 128, 128, k_axis=k_axis, v_axis=v_axis)
            cache = random_cache(fmt, bt, L, kv_heads=a.heads[1], page=64)
            q = torch.randn(B, a.heads[0], 128, dtype=torch.bfloat16, device=dev)
            if a.warm:
                for v in a.variants:
                    set_variant(v)
                    foscar.decode(q, cache)
                continue
            want = foscar.decode(q, cache, backend="triton").double()
            out = torch.empty_like(q)
            times, notes = [], []
            for v in a.variants:
                set_variant(v)
                out.fill_(float("nan"))
                foscar.decode(q, cache, out=out)
                err = float((out.double() - want).norm() / want.norm())
                if not err < 2e-2:
                    times.append(float("nan"))
                    notes.append(f"{v} wrong: {err:.2e}")
                    continue
                times.append(timed(lambda: foscar.decode(q, cache, out=out), flush, a.iters))
                if a.kernels:
                    rows = kernel_rows(lambda: foscar.decode(q, cache, out=out), flush, a.iters)
                    notes.append(f"{v}: " + ", ".join(f"{name[:24]} {us:.1f} (gap {gap:.1f})" for name, us, gap in rows))
            for v, t in zip(a.variants, times):
                logs[v, bits].append(math.log(t / times[0]))
            ratios = " | ".join(f"{t / times[0]:.3f}" for t in times[1:])
            print(f"| {B} | {L // 1024}K | INT{bits} | {k_axis[:3]}/{v_axis[:3]} | {' | '.join(f'{t:.1f}' for t in times)} "
                  f"| {ratios} |", flush=True)
            for n in notes:
                print(f"    {n}", flush=True)
            del cache
            torch.cuda.empty_cache()
    set_variant("shipped")
    if a.warm:
        return
    geo = {k: math.exp(sum(x) / len(x)) for k, x in logs.items()}  # NaN where a case was wrong
    print("\ngeomean over the first: " + ", ".join(f"{v} INT{b} {g:.3f}" for (v, b), g in geo.items()))
    if a.choose:
        both = {v: math.exp(sum(sum(logs[v, b]) for b in a.bits) / sum(len(logs[v, b]) for b in a.bits))
                for v in a.variants}
        best = min((v for v in a.variants if both[v] == both[v]), key=both.get)
        with open(a.choose, "w") as f:
            f.write(("" if best == "shipped" else best) + "\n")
        print(f"chosen: {best}")


if __name__ == "__main__":
    main()
