"""What the launch-config sweeps (``sweep_triton.py``, ``sweep_cute.py``) share: the common flags, and
the loop that builds a random paged cache per (shape, bits) and runs every candidate through the
benchmark's driver (:func:`foscar.bench.measure.measure`): checked against the float64 slice reference
first (a candidate that fails is printed and never timed), then timed as CUDA-graph replays (L2 flushed,
CUDA events, median). It prints one line each and the best per case, and writes the records."""
import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import Case, bytes_read, make_random_cache, parse_shapes

from foscar.bench import make_block_table, measure, slice_check


def add_common_args(p: argparse.ArgumentParser, default_shape: str) -> None:
    p.add_argument("--shapes", type=parse_shapes, nargs="+", default=[parse_shapes(default_shape)])
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ceiling-tbps", type=float, default=4.6)
    p.add_argument("--json", help="write the records here")


#: ``candidates(B, L, device)``: ``(fields, run)`` pairs, ``fields`` the candidate's record entries and
#: ``run(q, cache, out)`` one decode with it into ``out``.
Candidates = Callable[[int, int, torch.device], Iterable[tuple[dict, Callable]]]


def sweep(a: argparse.Namespace, candidates: Candidates, k_axis: str = "token", v_axis: str = "token",
          kv_heads: int = 8) -> None:
    """Each shape and width of ``a``: every candidate checked, then timed (Hq 32, ``kv_heads`` KV heads)."""
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=dev)
    records = []
    for (B, L), bits in itertools.product([s for group in a.shapes for s in group], a.bits):
        cache = make_random_cache(Case(B, L, bits, k_axis, v_axis, kv_heads=kv_heads),
                                  make_block_table(B, L // 64, "shuffled", 0).to(dev))
        q = torch.randn(B, 32, 128, dtype=torch.bfloat16, device=dev)
        check = slice_check(q, cache)
        best = None
        for fields, run in candidates(B, L, dev):
            out = torch.full_like(q, float("nan"))
            got = measure(lambda run=run, out=out: run(q, cache, out), check, iters=a.iters, warmup=3, flush=flush,
                          cuda_graph=True)
            if got["status"] != "ok":  # a config that does not compile, or a wrong output: reported, not timed
                print(f"B={B} L={L} INT{bits} {fields}: {got['status'][:160]}", flush=True)
                continue
            t = got["median_us"]
            frac = bytes_read(B, L, bits) / (t * 1e-6) / (a.ceiling_tbps * 1e12)
            rec = dict(batch=B, seq_len=L, bits=bits, k_axis=k_axis, v_axis=v_axis, **fields, us=t, frac=frac)
            records.append(rec)
            print(f"B={B:3d} L={L:7d} INT{bits} " + " ".join(f"{k}={v}" for k, v in fields.items())
                  + f": {t:9.1f} us  {100 * frac:5.1f}%", flush=True)
            if best is None or t < best["us"]:
                best = rec
        print(f"BEST {best}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
