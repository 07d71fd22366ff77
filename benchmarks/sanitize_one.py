"""One small decode per backend, for ``compute-sanitizer`` (memcheck, racecheck, synccheck):

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 benchmarks/sanitize_one.py cute
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 benchmarks/sanitize_one.py triton
    compute-sanitizer --tool synccheck --error-exitcode 1 python3 benchmarks/sanitize_one.py cute_ws
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 benchmarks/sanitize_one.py cute_pair

Kinds: ``triton``, ``cute`` (``foscar.decode``'s pick), ``cute_ws`` / ``cute_ws2`` (v1 at one / two CTAs per
SM), ``cute_pair`` (v1, E4M3 K, two tiles a pass with the lazy rescale; ``cute_pair1``: the same at one CTA per
SM), ``cute_digits`` (v1, E4M3 K with Q as four integer digits, one tile a pass) and ``cute_lazy1`` (v1, one
tile a pass, with
``foscar.cute.config.LAZY_ONE_TILE`` set); ``cute_vcha`` and ``cute_kvcha``: v1 over channel-wise V (the lazy
rescale with the acc-fold), token-wise or channel-wise K (runs of two tiles a consumer); ``cute_nvfp4``,
``cute_mxfp4`` (v1 over an FP4 block format, one tile a pass) and ``cute_nvfp4_pair``, ``cute_mxfp4_pair`` (two);
``cute_fused`` (v1 as ``cute_pair``, no windows, its last CTA of each KV head merging the splits:
``foscar.cute.config.FUSED_MERGE``); ``cute_own``, ``cute_own_kcha``, ``cute_own_vcha``, ``cute_own_kvcha``: v1 at
INT2, E4M3 K, two tiles a pass (their own wgmma) on each axis pair; ``cute_rows16``, ``cute_rows32``: v1 at 16 and 32
query rows a KV head (GQA 16 and 32, one CTA an SM, E4M3 K: Q's stacked terms with one scale for every row;
``cute_rows32_vcha``: channel-wise V); ``cute_step8``, ``cute_step8_int2``: a step of 8 tokens at GQA 4 through
``foscar.decode`` (32 columns: three consumers, INT4 on one copy of their code, INT2 on one each);
``triton_step_ring``: the Triton kernel's step of 4 tokens over a channel-wise K ring at head dim 128 (B 2, L 1K,
Hq 32, Hkv 8, random codes: ``benchmarks/bench_steps.py``'s check, where the H200 stopped on an illegal address).

(``--report-api-errors no`` hides the host API errors cuda-python's driver binding raises on import.)

A paged INT4 cache, lengths ending mid-tile and mid-page (one of a single token), BF16 windows, and more
splits than some sequences have tiles. Prints the error against the float64 oracle.
"""
import sys

import torch

import foscar
from foscar.bench.common import rel_l2


def step_over_a_ring() -> None:
    """``triton_step_ring``: INT4 then INT2, one token then four, each against the float64 oracle."""
    import foscar.triton as ft
    from foscar.bench import make_block_table, random_cache
    for bits in (4, 2):
        fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, k_axis="channel", recent=32, rollback=3)
        cache = random_cache(fmt, make_block_table(2, 16, "shuffled", 0).cuda(), 1024, kv_heads=8, page=64)
        for T in (1, 4):
            q = torch.randn(2, T, 32, 128, dtype=torch.bfloat16, device="cuda")
            for fused in (True, False):
                out = ft.decode(q, cache, out=torch.full(q.shape, float("nan"), device="cuda"), fused_combine=fused)
                torch.cuda.synchronize()
                print(f"INT{bits} q_len {T} fused {fused}: error {rel_l2(out, foscar.decode_exact(q, cache)):.3e}",
                      flush=True)


def main(backend: str) -> None:
    if backend == "triton_step_ring":
        return step_over_a_ring()
    windows = {} if backend == "cute_fused" else {"sink": 4, "recent": 32}  # the CuTe combine attends them
    axes = {"v_axis": "channel"} if backend.endswith("vcha") else {}
    if backend.endswith(("_kvcha", "_kcha")):
        axes["k_axis"] = "channel"
    step = 8 if backend.startswith("cute_step8") else 1  # a step's ring keeps its tokens' windows (rollback)
    bits = 2 if backend.endswith("int2") or backend.startswith("cute_own") else 4
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128, **axes, **windows, rollback=step - 1)
    fp4 = backend.split("_")[1] if "fp4" in backend else None
    if fp4:
        fmt = foscar.KVFormat.fp4(fp4, 128, **windows)
    gen = torch.Generator().manual_seed(0)
    lens = [1000, 77, step]
    rows = backend.startswith("cute_rows")  # cute_rows16, cute_rows32 (_vcha: channel-wise V)
    B, Hkv, G, D = len(lens), 2, int(backend[len("cute_rows"):].split("_")[0]) if rows else 4, 128
    k, v = (torch.randn(B, Hkv, max(lens), D, generator=gen).cuda() for _ in range(2))
    cache = foscar.quantize_kv(k, v, fmt, seq_lens=torch.tensor(lens, dtype=torch.int32).cuda(), page_size=64)
    shape = (B, step, Hkv * G, D) if step > 1 else (B, Hkv * G, D)  # a step's query, else one token's
    q = torch.randn(*shape, generator=gen).bfloat16().cuda()
    if fp4:
        from foscar.cute.launch import decode
        out = decode(q, cache, num_splits=5, warp_specialized=True, ctas_per_sm=2,
                     tiles_per_pass=2 if backend.endswith("pair") else 1)
    elif backend.startswith("cute_own"):  # INT2, E4M3 K, two tiles a pass: the own wgmma on every axis pair
        from foscar.cute.launch import decode
        out = decode(q, cache, num_splits=5, warp_specialized=True, ctas_per_sm=2, k_operand="e4m3", tiles_per_pass=2)
    elif backend.startswith("cute_ws") or (backend.endswith("vcha") and step == 1 and not rows):  # v1 (ws2: 2 CTAs)
        from foscar.cute.launch import decode
        out = decode(q, cache, num_splits=5, warp_specialized=True, ctas_per_sm=2 if backend == "cute_ws2" else 1)
    elif backend == "cute_digits":  # Q as four integer digits (E4M3 K, one tile a pass)
        from foscar.cute.launch import decode
        out = decode(q, cache, num_splits=5, warp_specialized=True, ctas_per_sm=2, k_operand="e4m3d4",
                     tiles_per_pass=1)
    elif rows:  # 16 or 32 columns
        from foscar.cute.launch import decode
        out = decode(q, cache, num_splits=5, warp_specialized=True, ctas_per_sm=1, k_operand="e4m3", tiles_per_pass=1)
    elif backend in ("cute_pair", "cute_pair1", "cute_lazy1", "cute_fused"):
        from foscar.cute import config
        from foscar.cute.launch import decode
        if backend in ("cute_lazy1", "cute_fused"):
            setattr(config, "LAZY_ONE_TILE" if backend == "cute_lazy1" else "FUSED_MERGE", True)
            config.clear_switch_caches()
        out = decode(q, cache, num_splits=5, warp_specialized=True, ctas_per_sm=1 if backend == "cute_pair1" else 2,
                     k_operand="e4m3", tiles_per_pass=1 if backend == "cute_lazy1" else 2)
    else:
        out = foscar.decode(q, cache, backend="cute" if step > 1 else backend, num_splits=5)
    torch.cuda.synchronize()
    print(f"{backend}: error {rel_l2(out, foscar.decode_exact(q, cache)):.3e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "triton")
