"""NVFP4 and MXFP4 KV caches: foscar's decode against FlashInfer's NVFP4 decode (the same bytes) and FlashInfer
BF16, in one process:

    FLASHINFER_WORKSPACE_BASE=/tmp/fi python benchmarks/bench_fp4.py --grid paper --out $OUT

Per shape (Hq 32, Hkv 8, D 128, page 64, random codes and block scales): the time of ``foscar.decode`` over an
NVFP4 and an MXFP4 cache (backend ``auto``, or ``--backend``) and over the INT4 affine cache (g 128, for
reference), FlashInfer's paged decode over its NVFP4 cache (fa2 backend, the wrapper the library serves NVFP4 KV
with on Hopper) and over the BF16 cache (tensor cores); each a CUDA-graph replay with the L2 flushed before it,
the median of ``--iters`` (``fixed_cost.timed``). Reported as time, the share of the streaming-read ceiling
measured in the same run, and the speed-ups over FlashInfer NVFP4 and BF16, with their geometric means. First, at
a small shape, foscar's FP4 outputs against the float64 oracle beside BF16 attention's error on the same
dequantized cache.
"""
import argparse
import json
import math
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fixed_cost import FLUSH_BYTES, timed

import foscar
from foscar.bench import make_block_table, time_call
from foscar.bench.ceiling import measure_read_ceiling
from foscar.bench.common import random_cache
from foscar.bench.grid import PAPER_SHAPES, QUICK_SHAPES, parse_shapes
from foscar.bench.inputs import make_bf16_inputs
from foscar.bench.kernels import KernelMissing, build_flashinfer, build_flashinfer_nvfp4

HQ, HKV, D, PAGE = 32, 8, 128, 64
FORMATS = {"nvfp4": foscar.KVFormat.fp4("nvfp4", D), "mxfp4": foscar.KVFormat.fp4("mxfp4", D),
           "int4": foscar.KVFormat(bits=4, head_dim=D, group_size=128)}


def check(dev, backend: str) -> None:
    """foscar's FP4 decode of a quantized cache (B 3, ragged lengths up to 3K, GQA 4) against the oracle."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(3, HKV, 3000, D, generator=gen) * torch.rand(1, HKV, 1, D, generator=gen) * 4
    v = torch.randn(3, HKV, 3000, D, generator=gen) + 0.5
    lens = torch.tensor([3000, 1, 1537], dtype=torch.int32)
    q = torch.randn(3, HQ, D, generator=gen).bfloat16().to(dev)
    for name in ("nvfp4", "mxfp4"):
        cache = foscar.quantize_kv(k.to(dev), v.to(dev), FORMATS[name], seq_lens=lens.to(dev), page_size=PAGE,
                                   quantizer="mse")
        exact = foscar.decode_exact(q, cache)
        out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=dev)
        foscar.decode(q, cache, out=out, backend=backend)
        kd, vd = cache.dequantize(torch.float32)
        base = []
        for b in range(3):
            n = int(lens[b])
            o = torch.nn.functional.scaled_dot_product_attention(q[b, :, None], kd[b, :, :n].bfloat16(),
                                                                 vd[b, :, :n].bfloat16(), enable_gqa=True)
            base.append(o[:, 0])
        bf16 = torch.stack(base)
        rel = lambda a: float((a.double() - exact).norm() / exact.norm())  # noqa: E731
        print(f"check {name}: finite {bool(torch.isfinite(out).all())}, error {rel(out):.3e} against the float64 "
              f"oracle (BF16 attention on the same dequantized cache: {rel(bf16):.3e})")


def graph_or_eager(fn, flush, iters, label):
    try:
        return timed(fn, flush, iters)
    except Exception as e:  # a call a CUDA graph cannot capture: timed eagerly, and said so
        print(f"{label}: no CUDA-graph capture ({type(e).__name__}: {str(e)[:80]}), timed eagerly")
        return time_call(fn, iters=iters, warmup=5, flush=flush)["median_us"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", choices=("paper", "quick"), default="paper")
    p.add_argument("--shapes", type=parse_shapes, default=None, metavar="B:L,...")
    p.add_argument("--backend", default="auto")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp")
    a = p.parse_args()
    dev = torch.device("cuda")
    shapes = a.shapes or (PAPER_SHAPES if a.grid == "paper" else QUICK_SHAPES)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    check(dev, a.backend)
    ceiling = measure_read_ceiling(8.0, iters=10, warmup=3, flush=flush, device=dev)
    peak = ceiling["tbps"] * 1e12
    print(f"\nGPU {torch.cuda.get_device_name(dev)}; read ceiling {peak / 1e12:.2f} TB/s ({ceiling['source']}); "
          f"CUDA-graph replays, L2 flushed, median of {a.iters}; backend {a.backend}\n")
    print("| B | L | FI BF16 µs | FI NVFP4 µs | foscar NVFP4 µs (ceiling) | vs FI NVFP4 | vs FI BF16 | "
          "foscar MXFP4 µs (ceiling) | vs FI BF16 | foscar INT4 µs |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for (B, L) in shapes:
        bt = make_block_table(B, L // PAGE, "shuffled", 0).to(dev)
        inp = make_bf16_inputs(torch.randn(B, HQ, D, dtype=torch.bfloat16, device=dev), bt, L, HKV)
        args = SimpleNamespace(num_splits=None)
        t = {}
        for name, build in (("fi_bf16", build_flashinfer(True)), ("fi_nvfp4", build_flashinfer_nvfp4)):
            run = None
            try:
                run = build(inp, args)
                t[name] = graph_or_eager(run.fn, flush, a.iters, name)
            except KernelMissing as e:
                print(f"{name}: missing ({e})")
                t[name] = math.nan
            del run
        q = inp.q
        del inp
        torch.cuda.empty_cache()
        for name, fmt in FORMATS.items():
            cache = random_cache(fmt, bt, L, kv_heads=HKV, page=PAGE)
            out = torch.empty(B, HQ, D, dtype=torch.bfloat16, device=dev)
            t[name] = graph_or_eager(lambda c=cache: foscar.decode(q, c, out=out, backend=a.backend), flush, a.iters,
                                     name)
            t[name + "_share"] = B * L * HKV * fmt.bytes_per_token() / (t[name] * 1e-6) / peak
            del cache
            torch.cuda.empty_cache()
        rows.append({"B": B, "L": L, **t})
        print(f"| {B} | {L // 1024}K | {t['fi_bf16']:.1f} | {t['fi_nvfp4']:.1f} | {t['nvfp4']:.1f} "
              f"({t['nvfp4_share']:.0%}) | {t['fi_nvfp4'] / t['nvfp4']:.2f}x | {t['fi_bf16'] / t['nvfp4']:.2f}x | "
              f"{t['mxfp4']:.1f} ({t['mxfp4_share']:.0%}) | {t['fi_bf16'] / t['mxfp4']:.2f}x | {t['int4']:.1f} |",
              flush=True)
    geo = lambda key, base: math.exp(sum(math.log(r[base] / r[key]) for r in rows) / len(rows))  # noqa: E731
    print(f"\ngeomean over {len(rows)} shapes: foscar NVFP4 {geo('nvfp4', 'fi_nvfp4'):.2f}x FlashInfer NVFP4, "
          f"{geo('nvfp4', 'fi_bf16'):.2f}x FlashInfer BF16; foscar MXFP4 {geo('mxfp4', 'fi_bf16'):.2f}x FlashInfer "
          f"BF16; foscar INT4 {geo('int4', 'fi_bf16'):.2f}x FlashInfer BF16; FlashInfer NVFP4 "
          f"{geo('fi_nvfp4', 'fi_bf16'):.2f}x FlashInfer BF16")
    with open(os.path.join(a.out, "bench_fp4.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "ceiling_bytes_per_s": peak, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
