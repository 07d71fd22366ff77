"""Split count and CTAs per SM of the CuTe v1 kernel by query rows per KV head (GQA ratios and decode steps):

    python benchmarks/sweep_rows.py --shapes 8:128K --heads 32:1 32:2 --q-len 1 --bits 2 4 --splits 0.5 1 2 4 --ctas 1 2
    FLASHINFER_WORKSPACE_BASE=/tmp/fi python benchmarks/sweep_rows.py --shapes 8:32K,64:32K --heads 16:8 8:4 \
        --head-dim 256 --bits 4 --splits 1 --ctas 1 --flashinfer

Per shape, heads (``Hq:Hkv``), step length and bits: ``foscar.cute.launch.run`` of a step problem (random
codes, D 128 (``--head-dim``), g 128, token-wise K and V, BF16 K operands and one tile a pass where the rows exceed 4) at each
split count (multiples of :func:`foscar.cute.launch.default_num_splits`), CTAs per SM and K operands, timed as a CUDA-graph
replay with the L2 flushed (``fixed_cost.timed``, median of ``--iters``), with and without the lazy rescale in
one-tile passes (``--lazy-one-tile off on``); each candidate's output is first
held to the Triton kernel's on the same step (a wrong one is printed and not timed); the Triton kernel's own
time is the last line of each case, and with ``--flashinfer`` FlashInfer's BF16 decode (tensor cores) of the
same shape, timed the same way in the same process. A working tool for the
defaults of 16 and 32 columns; the product's tuned configs come from ``foscar tune``.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import parse_shapes
from fixed_cost import FLUSH_BYTES, timed

import foscar
from foscar.bench import make_block_table, random_cache
from foscar.cute import config as cute_config
from foscar.cute import launch
from foscar.multitoken import step_problem


SHIPPED_LAZY_ONE_TILE = cute_config.LAZY_ONE_TILE


def set_lazy_one_tile(choice: str) -> None:
    """``foscar.cute.config.LAZY_ONE_TILE`` for the next candidates: as shipped (``default``), ``off`` or ``on``
    (the configs are cached: the cache is cleared; the compile cache keys on the config, which holds the flag)."""
    cute_config.LAZY_ONE_TILE = {"default": SHIPPED_LAZY_ONE_TILE, "off": False, "on": True}[choice]
    cute_config.clear_switch_caches()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("8:128K"))
    p.add_argument("--heads", nargs="+", default=["32:1", "32:2"], help="Hq:Hkv")
    p.add_argument("--q-len", type=int, nargs="+", default=[1])
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    p.add_argument("--splits", type=float, nargs="+", default=[0.5, 1, 2], help="multiples of the default")
    p.add_argument("--ctas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256))
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--flashinfer", action="store_true", help="time FlashInfer's BF16 decode (tensor cores) too")
    p.add_argument("--k-operands", nargs="+", default=["bf16"], choices=("bf16", "e4m3"),
                   help="the K operands of each candidate (e4m3 beyond 4 rows: Q's terms in separate column blocks)")
    p.add_argument("--lazy-one-tile", nargs="+", default=["default"], choices=("default", "off", "on"),
                   help="one-tile passes with the lazy rescale (foscar.cute.config.LAZY_ONE_TILE) or without, each "
                        "a candidate")
    a = p.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    print("| B | L | Hq:Hkv | q_len | bits | CTAs/SM | K operands | lazy one tile | splits (base of the multiples) "
          "| µs |\n|---|---|---|---|---|---|---|---|---|---|")
    for (B, L) in a.shapes:
        bt = make_block_table(B, L // 64, "shuffled", 0).to(dev)
        for heads in a.heads:
            hq, hkv = (int(x) for x in heads.split(":"))
            if a.flashinfer:
                from foscar.bench.inputs import make_bf16_inputs
                from foscar.bench.kernels import build_flashinfer
                inp = make_bf16_inputs(torch.randn(B, hq, a.head_dim, dtype=torch.bfloat16, device=dev), bt, L, hkv)
                fi = build_flashinfer(True)(inp, None)
                t = timed(fi.fn, flush, a.iters)
                print(f"| {B} | {L // 1024}K | {heads} | 1 | BF16 | FlashInfer | - | - | - | {t:.1f} |", flush=True)
                del inp, fi
            for bits in a.bits:
                fmt = foscar.KVFormat(bits, a.head_dim, 128)
                cache = random_cache(fmt, bt, L, kv_heads=hkv, page=64)
                for T in a.q_len:
                    q = torch.randn(B, T, hq, a.head_dim, dtype=torch.bfloat16, device=dev)
                    want = foscar.decode(q, cache, backend="triton")
                    out = torch.empty(q.shape, dtype=torch.bfloat16, device=dev)
                    problem = step_problem(q, cache, out=out)
                    base = launch.default_num_splits(B, hkv, L // 64, dev, 1)
                    for ctas, kop, lazy in ((c, k, z) for c in a.ctas for k in a.k_operands for z in a.lazy_one_tile):
                        set_lazy_one_tile(lazy)
                        for s in sorted({max(1, round(base * m)) for m in a.splits}):
                            out.fill_(float("nan"))
                            launch.run(problem, num_splits=s, ctas_per_sm=ctas, warp_specialized=True, k_operand=kop)
                            err = float((out.double() - want.double()).norm() / want.double().norm())
                            label = (f"| {B} | {L // 1024}K | {heads} | {T} | INT{bits} | {ctas} | {kop} | {lazy} | "
                                     f"{s} ({base}) |")
                            if not err < 2e-2:
                                print(f"{label} wrong: {err:.2e} from the Triton kernel's output |", flush=True)
                                continue
                            t = timed(lambda s=s, c=ctas, k=kop: launch.run(problem, num_splits=s, ctas_per_sm=c,
                                                                             warp_specialized=True, k_operand=k),
                                      flush, a.iters)
                            print(f"{label} {t:.1f} |", flush=True)
                    t = timed(lambda: foscar.decode(q, cache, out=out, backend="triton"), flush, a.iters)
                    print(f"| {B} | {L // 1024}K | {heads} | {T} | INT{bits} | Triton | - | - | - | {t:.1f} |",
                          flush=True)
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
