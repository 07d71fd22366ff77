"""Where channel-wise K with ``Q'`` built by the producer (``foscar.cute.config.PRODUCER_Q_FOLD``) stops: one decode
shape, repeated eagerly or as CUDA-graph replays, with or without the L2 flush between calls, each call's output held
to the Triton kernel's:

    python benchmarks/producer_fold_probe.py MODE [B L BITS [REPEATS [name=value ...]]]

``MODE``: ``eager`` (``foscar.decode`` REPEATS times, a synchronise after each), ``graph`` (one capture, REPEATS
replays) or ``graph_flush`` (512 MiB written between replays, as the benchmarks time). ``name=value``: ``splits`` (the
launch's split count, default foscar.decode's), ``v_axis`` (default token), ``fold`` (0: the switch off, the
consumers fold ``Q'``; default 1). A CUDA error ends the process: run one mode a process. Prints each call's error
until the first wrong or failed one.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fixed_cost import FLUSH_BYTES

import foscar
from foscar.bench import make_block_table, random_cache
from foscar.bench.common import as_graph, rel_l2
from foscar.cute import config


def main(mode: str, B: int = 8, L: int = 32768, bits: int = 2, repeats: int = 50, *extra: str) -> None:
    opts = dict(x.split("=", 1) for x in extra)
    config.PRODUCER_Q_FOLD = opts.get("fold", "1") == "1"
    config.clear_switch_caches()
    dev = torch.device("cuda")
    fmt = foscar.KVFormat(bits, 128, 128, k_axis="channel", v_axis=opts.get("v_axis", "token"))
    cache = random_cache(fmt, make_block_table(B, L // 64, "shuffled", 0).to(dev), L, kv_heads=8, page=64)
    q = torch.randn(B, 32, 128, dtype=torch.bfloat16, device=dev)
    kw = {"num_splits": int(opts["splits"])} if "splits" in opts else {}
    want = foscar.decode(q, cache, backend="triton").double()
    out = torch.full_like(q, float("nan"))
    call = lambda: foscar.decode(q, cache, out=out, **kw)  # noqa: E731
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev) if mode == "graph_flush" else None
    run = call if mode == "eager" else as_graph(call)
    print(f"{mode} B {B} L {L} INT{bits} {opts}: fold {config.PRODUCER_Q_FOLD}", flush=True)
    for i in range(int(repeats)):
        if flush is not None:
            flush.fill_(i & 0xFF)
        out.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        err = rel_l2(out.double(), want)
        if i < 3 or not err < 2e-2 or i == int(repeats) - 1:
            print(f"call {i}: error {err:.3e}", flush=True)
        if not err < 2e-2:
            sys.exit(1)
    print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *(int(x) for x in sys.argv[2:6] if "=" not in x), *(x for x in sys.argv[2:] if "=" in x))
