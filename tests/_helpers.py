"""Shared test helpers: random cache values, relative error and BF16 attention's error, the CuTe kernels'
switches set for a test, ptxas's report of a CuTe kernel, the decode benchmark's records."""
import contextlib
import math

import torch

import foscar


def random_values(shape, mag: float, offset: float, const_frac: float, gen: torch.Generator) -> torch.Tensor:
    """float32 values ``N(offset*mag, mag^2)``; with ``const_frac``, that share of tokens and of
    channels made constant (constant token-wise and channel-wise groups)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * mag + offset * mag
    if const_frac:
        rows = torch.rand(shape[:-1], generator=gen) < const_frac  # constant tokens -> constant token groups
        x = torch.where(rows[..., None], x[..., :1], x)
        cols = torch.rand(shape[-1], generator=gen) < const_frac  # constant channels -> constant channel groups
        x = torch.where(cols, x[..., :1, :], x)
    return x.float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def bf16_attention(q: torch.Tensor, cache, *, sdpa: bool = False) -> torch.Tensor:
    """BF16 attention over the dequantized cache (the baseline a kernel's error is held to): q, K, V
    cast to BF16. ``sdpa=True`` runs torch's scaled_dot_product_attention (on the GPU); otherwise the
    emulation of :func:`foscar.reference.attend` (BF16 operands and P, FP32 math)."""
    B, Hq, D = q.shape
    Hkv = cache.num_kv_heads
    kd, vd = cache.dequantize(torch.float32)
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        L = int(cache.seq_lens[b])
        if sdpa:
            o = torch.nn.functional.scaled_dot_product_attention(
                q[b, :, None].bfloat16(), kd[b, :, :L].bfloat16(), vd[b, :, :L].bfloat16(), enable_gqa=True)
            out[b] = o[:, 0].float()
        else:
            o, _ = foscar.reference.attend(q[b].float().reshape(Hkv, Hq // Hkv, D), kd[b, :, :L], vd[b, :, :L],
                                           1 / math.sqrt(D), operand_dtype=torch.bfloat16)
            out[b] = o.reshape(Hq, D).bfloat16().float()  # a BF16 kernel writes BF16
    return out


def kernel_error_bound(fmt, base: float) -> float:
    """What a GPU kernel's error against the float64 oracle is held to, given BF16 attention's ``base`` on
    the same dequantized cache: 1.05x for token-wise K; 1.25x for channel-wise K, where the operand-folded
    ``Q' = Q s'`` is itself a BF16 operand (measured on the H200: 1.1-1.2x BF16 attention's error when the
    cache was quantized from BF16 values, whose group extremes BF16 attention then holds exactly)."""
    return base * (1.25 if fmt.k_axis == "channel" else 1.05) + 1e-4


#: V of every magnitude the library takes, and constant V groups with an offset (scales 0) before tiny ones.
V_MAGNITUDES = (1e-30, 1e-12, 1e12, 1e24, "constant-then-tiny")


def magnitude_cache(fmt, magnitude, device, seed: int = 0):
    """``(q, cache)``: 2 sequences (700 and 333 tokens), 2 KV heads, GQA 4, K standard normal and V
    standard normal times ``magnitude`` (:data:`V_MAGNITUDES`; ``"constant-then-tiny"``: the first 320
    tokens' V all 5.0, the rest 1e-30 times a standard normal)."""
    gen = torch.Generator().manual_seed(seed)
    B, Hkv, G, L, D = 2, 2, 4, 700, fmt.head_dim
    k = torch.randn(B, Hkv, L, D, generator=gen)
    v = torch.randn(B, Hkv, L, D, generator=gen)
    if magnitude == "constant-then-tiny":
        v = v * 1e-30
        v[:, :, :320] = 5.0
    else:
        v = v * magnitude
    q = torch.randn(B, Hkv * G, D, generator=gen).bfloat16()
    cache = foscar.quantize_kv(k.to(device), v.to(device), fmt,
                               seq_lens=torch.tensor([L, 333], dtype=torch.int32, device=device))
    return q.to(device), cache


@contextlib.contextmanager
def cute_switches(monkeypatch, **values):
    """``foscar.cute.config``'s kernel switches (``NAME=value``) set through ``monkeypatch`` for the ``with``
    block, the caches of what the switches decide cleared on entry and on exit (no config or variant of other
    switches is served: ``clear_switch_caches``)."""
    import foscar.cute.config as cfg_mod
    for name, value in values.items():
        monkeypatch.setattr(cfg_mod, name, value)
    cfg_mod.clear_switch_caches()
    try:
        yield
    finally:
        cfg_mod.clear_switch_caches()


def assert_pipelined_without_spills(cfg, ctas_per_sm: int) -> None:
    """The v1 kernel of ``cfg`` compiled for sm_90a at ``ctas_per_sm``: ptxas serializes none of its wgmma and
    spills nothing (``benchmarks/ptxas_info.py``'s report)."""
    import sys
    from pathlib import Path

    from foscar.cute.compile import compile_stage1
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from ptxas_info import ptxas_report
    finally:
        sys.path.pop(0)
    report = ptxas_report(compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=ctas_per_sm).__ptx__)
    assert "serialized" not in report and "0 bytes spill stores, 0 bytes spill loads" in report, report


def block_a_matrix(cfg):
    """V^T's extra m64 block's A for one k16 step (64 rows x 16 tokens, float64) as PTX's ``m64nNk16`` A fragment
    lays out each thread's values (:func:`foscar.cute.pivot.block_element` of ``sum_values(cfg)``), independently
    of the kernel's indexing: lane ``l`` of warp ``w`` holds rows ``16 w + l // 4 + 8 r``, tokens ``2 (l % 4) + c +
    8 h`` for element ``c + 2 r + 4 h``; every entry written once."""
    import torch

    from foscar.cute.pivot import block_element, sum_values
    values = sum_values(cfg)
    A = torch.full((64, 16), float("nan"), dtype=torch.float64)
    for warp in range(4):
        for lane in range(32):
            for i in range(8):
                row = 16 * warp + lane // 4 + 8 * ((i >> 1) & 1)
                k = 2 * (lane % 4) + (i & 1) + 8 * ((i >> 2) & 1)
                assert A[row, k].isnan()
                A[row, k] = float(torch.tensor(block_element(values, i), dtype=torch.float16))
    assert not A.isnan().any()
    return A


def constant_a_operands(cfg, ctas_per_sm: int) -> list:
    """The A operands of the v1 kernel's FP16 wgmma whose four registers are constants in its PTX (V^T's extra
    m64 block, :mod:`foscar.cute.pivot`), each as four values (a register's low FP16 half; None where its halves
    differ), traced back through moves to their immediates."""
    import re
    import struct

    from foscar.cute.compile import compile_stage1
    ptx = compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=ctas_per_sm).__ptx__
    known, found = {}, []
    for line in ptx.split("\n"):
        m = re.search(r"mov\.b32\s+(%r\d+),\s+(%r\d+|\d+);", line)
        if m:
            src = m.group(2)
            if src.isdigit() or src in known:
                known[m.group(1)] = int(src) if src.isdigit() else known[src]
        if "wgmma.mma_async" in line and ".f16.f16" in line:
            regs = re.search(r"\},\s*\{(%r\d+), (%r\d+), (%r\d+), (%r\d+)\}", line).groups()
            if all(r in known for r in regs):
                words = [known[r] for r in regs]
                found.append([struct.unpack("<e", struct.pack("<H", w & 0xFFFF))[0] if w >> 16 == w & 0xFFFF
                              else None for w in words])
    return found


def bench_record(B, L, bits, kernel, us, status="ok", axes=("token", "token")) -> dict:
    """One record of the decode benchmark (``foscar.bench.decode``): a kernel timed ``us`` at every run."""
    ka, va = (None, None) if bits == 16 else axes
    return {"B": B, "L": L, "bits": bits, "k_axis": ka, "v_axis": va, "kernel": kernel, "status": status,
            "median_us": us, "min_us": us, "all_us": [us] * 5}


def bench_result(records, **extra) -> dict:
    """A decode benchmark's result of ``records`` (an H200 run, a 4 TB/s ceiling), annotated and with its bars."""
    import foscar.bench.decode as bd
    result = {"meta": {"gpu": "NVIDIA H200", "timing": "eager", "command": "python3 bench_decode.py"},
              "ceiling": {"tbps": 4.0, "source": "triton, 8 GiB"}, "checks": [], "records": records,
              "skipped": [], "fatal": []}
    result.update(extra)
    bd.annotate(result["records"], 4.0)
    result["bars"] = bd.evaluate_bars(result["records"])
    return result
