"""Decode steps of several tokens per sequence (speculative verification): time against one token, and
against FlashInfer BF16 with the same step, in one process:

    FLASHINFER_WORKSPACE_BASE=/tmp/fi python benchmarks/bench_steps.py --shapes 8:32K,8:128K,64:32K,64:128K \\
        --bits 2 4 --q-len 1 2 4 8

Per shape (Hq 32, Hkv 8, D 128, g 128, page 64, token-wise K and V unless ``--k-axis``/``--v-axis``, BF16 windows
with ``--sink``/``--recent``, a ring keeping the longest step's windows, random codes) and step length: the time of
``foscar.decode(q [B, q_len, Hq, D])`` (backend ``auto``, and ``triton``, which takes a step's tokens as rows
of one launch; ``--backends`` names them) as a CUDA-graph replay, the L2 flushed before each, every step length
timed in interleaved rounds (median of ``--iters``), its ratio to the same backend's one-token step (and, in
the same rounds, the one-token decode of ``q [B, Hq, D]``, the paper grid's call, a row of its own; then that call
timed alone by the grid's driver, another row), and after
them FlashInfer's paged prefill wrapper with ``q_len`` query tokens per sequence and the causal mask (BF16 KV; a
one-token step is its decode too).
First, at a small shape, each step's output against the float64 oracle (``foscar.decode_exact``).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import parse_shapes
from fixed_cost import FLUSH_BYTES, timed

import foscar
from foscar.bench import as_graph, make_block_table, measure, random_cache, time_call, time_interleaved
from foscar.bench.grid import FI_WORKSPACE_BYTES
from foscar.bench.inputs import make_bf16_inputs

HQ, HKV, D, PAGE = 32, 8, 128, 64


def flashinfer_step(inp, T: int):
    """A run of FlashInfer's paged prefill over ``inp``'s BF16 pages for ``T`` causal query tokens per
    sequence, or ``None`` where FlashInfer is not installed."""
    try:
        import flashinfer
    except Exception as e:  # reported, never skipped silently
        print(f"FlashInfer: not installed ({type(e).__name__}: {e})")
        return None
    B, pages = inp.block_table.shape
    dev = inp.q.device
    ws = torch.zeros(FI_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    qo = torch.arange(B + 1, dtype=torch.int32, device=dev) * T
    kv = torch.arange(B + 1, dtype=torch.int32, device=dev) * pages
    last = torch.full((B,), PAGE, dtype=torch.int32, device=dev)
    w.plan(qo, kv, inp.block_table.reshape(-1).contiguous(), last, HQ, HKV, D, PAGE, causal=True,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    q = torch.randn(B * T, HQ, D, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    return lambda: w.run(q, (inp.k_cache, inp.v_cache), out=out), (ws, w, qo, kv, last, q, out)


def step_cache(a, bits: int, bt: torch.Tensor, L: int):
    """The timed cache: random codes in the options' format (a ring keeping the longest step's windows)."""
    fmt = foscar.KVFormat(bits=bits, head_dim=D, group_size=128, k_axis=a.k_axis, v_axis=a.v_axis, sink=a.sink,
                          recent=a.recent, rollback=max(a.q_len) - 1)
    return random_cache(fmt, bt, L, kv_heads=HKV, page=PAGE)


def check(a, steps, dev) -> None:
    """Each step length's output against the oracle at B 2, L 1K (INT4 and INT2), through each of ``--backends``."""
    for bits in (4, 2):
        cache = step_cache(a, bits, make_block_table(2, 1024 // PAGE, "shuffled", 0).to(dev), 1024)
        for T in steps:
            q = torch.randn(2, T, HQ, D, dtype=torch.bfloat16, device=dev)
            exact = foscar.decode_exact(q, cache)
            for backend in a.backends:
                out = foscar.decode(q, cache, backend=backend, out=torch.empty(q.shape, device=dev))
                err = float((out.double() - exact).norm() / exact.norm())
                print(f"check INT{bits} q_len {T} {backend}: error {err:.2e} against the float64 oracle")


def foscar_steps(a, bits: int, bt, B: int, L: int, flush, dev) -> dict:
    """``(q_len, backend) -> µs`` of every step length and backend at one shape, timed in interleaved rounds
    (:func:`foscar.bench.time_interleaved`), so that a slow spell of the GPU touches the one-token decode and the
    steps alike and their ratios hold; ``("decode", backend)``: the one-token decode of ``q [B, Hq, D]``, the
    paper grid's call, beside the steps' ``q [B, 1, Hq, D]``; ``("alone", backend)``: that call timed after the rounds
    by the paper grid's driver (:func:`foscar.bench.measure`: a synchronized first call, its host-sync probe, then
    its own warm-ups and timed replays), so that a difference between the script's one-token time and the grid's
    shows whether it is the method's or the inputs'."""
    cache = step_cache(a, bits, bt, L)
    replays = {}
    for T in ("decode", *a.q_len):
        shape = (B, HQ, D) if T == "decode" else (B, T, HQ, D)
        q = torch.randn(shape, dtype=torch.bfloat16, device=dev)
        out = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        for backend in a.backends:
            if a.sync_each:
                print(f"INT{bits} B {B} L {L} q_len {T} {backend}: planned {plan_of(q, cache, backend)}", flush=True)
            replays[T, backend] = as_graph(lambda q=q, o=out, b=backend: foscar.decode(q, cache, out=o, backend=b))
    if a.sync_each:
        replays = {k: synced(k, fn) for k, fn in replays.items()}
    timed_ = time_interleaved(replays, iters=a.iters, warmup=5, flush=flush)
    times = {k: v["median_us"] for k, v in timed_.items()}
    q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device=dev)  # and the grid's call alone, as its driver times it
    out = torch.empty_like(q)
    for backend in a.backends:
        got = measure(lambda b=backend: foscar.decode(q, cache, out=out, backend=b), lambda o: {"status": "ok"},
                      iters=a.iters, warmup=5, flush=flush, cuda_graph=True, host_sync=True)
        times["alone", backend] = got.get("median_us", float("nan"))
    return times


def plan_of(q, cache, backend: str) -> dict:
    """The backend and launch config :func:`foscar.plan` takes for ``q`` over ``cache``."""
    p = foscar.plan(q, cache, backend=backend)
    return {"backend": p.backend, "num_splits": p.num_splits, **p.options}


def synced(key, fn):
    """``fn`` followed by a device synchronize; a CUDA error is printed with ``key`` (the replay that raised it)
    before it propagates (``--sync-each``: a diagnostic; the times then hold the host's waits)."""
    def run():
        fn()
        try:
            torch.cuda.synchronize()
        except Exception as e:
            print(f"replay {key}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
            raise
    return run


def flashinfer_steps(a, bt, L: int, flush, dev) -> dict:
    """``q_len -> µs`` of FlashInfer's causal prefill over BF16 pages of the same shape (None: not installed)."""
    inp = make_bf16_inputs(torch.zeros(bt.shape[0], HQ, D, dtype=torch.bfloat16, device=dev), bt, L, HKV)
    fi = {}
    for T in a.q_len:
        run = flashinfer_step(inp, T)
        try:
            fi[T] = timed(run[0], flush, a.iters) if run else None
        except Exception as e:  # a wrapper a CUDA graph cannot capture: timed eagerly, and said so
            print(f"FlashInfer q_len {T}: no CUDA-graph capture ({type(e).__name__}: {str(e)[:80]}), timed eagerly")
            fi[T] = time_call(run[0], iters=a.iters, warmup=5, flush=flush)["median_us"]
    return fi


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes("8:32K,8:128K,64:32K,64:128K"))
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    p.add_argument("--q-len", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--k-axis", default="token", choices=("token", "channel"))
    p.add_argument("--v-axis", default="token", choices=("token", "channel"))
    p.add_argument("--sink", type=int, default=0, help="BF16 sink tokens")
    p.add_argument("--recent", type=int, default=0, help="BF16 recent window")
    p.add_argument("--seed", type=int, default=None,
                   help="the queries' random seed, set before each shape (default: the process's generator as it runs)")
    p.add_argument("--sync-each", action="store_true",
                   help="a diagnostic: print each call's plan, synchronize after every replay and name the one a CUDA "
                        "error follows (the times then hold the host's waits)")
    p.add_argument("--backends", nargs="+", default=["auto", "triton"], choices=("auto", "triton", "cute"),
                   help="the foscar backends checked and timed (default: auto triton)")
    a = p.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    check(a, a.q_len, dev)
    print(f"\nGPU {torch.cuda.get_device_name(dev)}; CUDA-graph replays, L2 flushed, median of {a.iters}\n")
    print("| B | L | bits | q_len | " + " | ".join(f"{b} µs (x its q_len 1)" for b in a.backends)
          + " | FlashInfer BF16 µs (x its q_len 1) |\n|---|---|---|---|" + "---|" * (len(a.backends) + 1))
    for (B, L) in a.shapes:
        bt = make_block_table(B, L // PAGE, "shuffled", 0).to(dev)
        if a.seed is not None:
            torch.manual_seed(a.seed)
        times = {bits: foscar_steps(a, bits, bt, B, L, flush, dev) for bits in a.bits}  # before FlashInfer's
        fi = flashinfer_steps(a, bt, L, flush, dev)
        for bits in a.bits:
            t = times[bits]
            print(f"| {B} | {L // 1024}K | INT{bits} | decode, q [B, Hq, D] | "
                  + " | ".join(f"{t['decode', b]:.1f}" for b in a.backends) + " | - |")
            print(f"| {B} | {L // 1024}K | INT{bits} | decode, timed alone as the grid times it | "
                  + " | ".join(f"{t['alone', b]:.1f}" for b in a.backends) + " | - |")
            for T in a.q_len:
                row = [f"{t[T, b]:.1f} ({t[T, b] / t[a.q_len[0], b]:.2f}x)" for b in a.backends]
                f = fi[T]
                row.append("-" if f is None else f"{f:.1f} ({f / fi[a.q_len[0]]:.2f}x)")
                print(f"| {B} | {L // 1024}K | INT{bits} | {T} | " + " | ".join(row) + " |")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
