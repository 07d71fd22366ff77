"""The accuracy study on the paper's synthetic stress input (Sec. 6.2, Fig. 11): for each context length
and seed, the relative L2 output error against exact attention over the unquantized cache of BF16
decode and of each quantized configuration (INT4 min-max, INT2 with the MSE-clipped quantizer, INT2
min-max by default), and each decode's arithmetic error against the dequantized cache next to BF16
attention's on that same cache. ``foscar demo`` prints one such row set; ``foscar bench accuracy`` runs
the grid, writes JSON and a Markdown table, and plots error against length (matplotlib, when present).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..cache_io import quantize_kv
from ..format import KVFormat
from ..reference import attend, decode_exact
from ..synthetic import stress_inputs
from .common import rel_l2


@dataclass(frozen=True)
class QuantConfig:
    """One quantized configuration of the study: a name, the bit width, the quantizer, the rotation
    (:attr:`foscar.KVFormat.rotation`) and the scheme (:attr:`foscar.KVFormat.scheme`: an FP4 block format
    takes its own block, not the study's group size)."""

    name: str
    bits: int
    quantizer: str
    rotation: str | None = None
    scheme: str = "affine"

    def fmt(self, head_dim: int, group_size: int) -> KVFormat:
        if self.scheme != "affine":
            return KVFormat.fp4(self.scheme, head_dim, rotation=self.rotation)
        return KVFormat(self.bits, head_dim, group_size, rotation=self.rotation)


#: The paper's Fig. 11 configurations and its reported error ranges against exact attention.
PAPER_CONFIGS = (QuantConfig("INT4 min-max", 4, "minmax"), QuantConfig("INT2 mse-clipped", 2, "mse"),
                 QuantConfig("INT2 min-max", 2, "minmax"))
PAPER_RANGES = {"BF16": (2e-3, 2.3e-3), "INT4 min-max": (0.16, 0.22), "INT2 mse-clipped": (0.52, 0.61),
                "INT2 min-max": (0.86, 1.03)}
#: The study's configurations: the paper's, then INT2 with K and V rotated (not in the paper), clipped by
#: the MSE search or by OSCAR's fixed ratios.
STUDY_CONFIGS = PAPER_CONFIGS + (QuantConfig("INT2 min-max + Hadamard", 2, "minmax", "hadamard"),
                                 QuantConfig("INT2 mse-clipped + Hadamard", 2, "mse", "hadamard"),
                                 QuantConfig("INT2 OSCAR clip + Hadamard", 2, "oscar", "hadamard"))
#: The FP4 block formats (``foscar bench accuracy --fp4``): NVFP4 with the block scale from the maximum and
#: with BitDecoding-FP4's two-candidate search, with and without the rotation; MXFP4 likewise searched.
FP4_CONFIGS = (QuantConfig("NVFP4 max", 4, "minmax", scheme="nvfp4"),
               QuantConfig("NVFP4 search", 4, "mse", scheme="nvfp4"),
               QuantConfig("NVFP4 search + Hadamard", 4, "mse", "hadamard", scheme="nvfp4"),
               QuantConfig("MXFP4 search", 4, "mse", scheme="mxfp4"),
               QuantConfig("MXFP4 search + Hadamard", 4, "mse", "hadamard", scheme="mxfp4"))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bf16: bool = False) -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` over all tokens of ``k, v [B, Hkv, L, D]`` (GQA), ``1/sqrt(D)`` scale.
    ``bf16=False``: exact, float64. ``bf16=True``: as SDPA/FlashAttention run it (q, k, v and P in BF16,
    float32 math); returns float32."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    dt, op = (torch.float32, torch.bfloat16) if bf16 else (torch.float64, None)
    return torch.stack([attend(q[b].to(dt).reshape(Hkv, Hq // Hkv, D), k[b], v[b], 1 / math.sqrt(D),
                               operand_dtype=op)[0].reshape(Hq, D) for b in range(B)])


def _timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    res = fn(*args, **kwargs)
    return res, (time.perf_counter() - t0) * 1e3


def held_bytes_per_token(cache) -> float:
    """Bytes per token per KV head, K and V together, that ``cache`` holds for its tokens: a quantized
    token its codes and FP32 ``(s', z')`` (:meth:`KVFormat.bytes_per_token`), a token of the sink or
    recent window ``head_dim`` values of the window dtype; averaged over every token of the batch."""
    n_sink, n_quant, n_recent = (int(x.sum()) for x in cache.split())
    tokens = n_sink + n_quant + n_recent
    window = 2 * cache.head_dim * cache.window_dtype.itemsize
    return (n_quant * cache.fmt.bytes_per_token() + (n_sink + n_recent) * window) / max(tokens, 1)


def error_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, formats: list[tuple[str, KVFormat, str]],
               decode: Callable, backend: str, page_size: int | None = None) -> list[dict]:
    """The study's rows for one input: BF16 decode, then each ``(name, format, quantizer)``, decoded by
    ``decode(q, cache)``. Errors: against exact attention over the unquantized cache, and (quantized)
    against exact attention over the dequantized cache, next to BF16 attention's on that cache. Bytes:
    what each cache holds per token (:func:`held_bytes_per_token`: window tokens at the window dtype's
    size)."""
    D = q.shape[-1]
    exact = attention(q, k, v)
    bf16_out, bf16_ms = _timed(attention, q, k, v, bf16=True)
    bf16_bytes = 2 * D * 2  # K and V, D values of 2 bytes each
    rows = [{"format": "bf16", "name": "BF16", "bits": 16, "backend": "torch-bf16", "bytes_per_token": float(bf16_bytes),
             "bf16_bytes_per_token": float(bf16_bytes), "compression": 1.0,
             "err_vs_unquantized": rel_l2(bf16_out, exact), "err_vs_dequantized": None,
             "bf16_err_vs_dequantized": None, "quantize_ms": None, "decode_ms": bf16_ms}]
    for name, fmt, quantizer in formats:
        cache, quant_ms = _timed(quantize_kv, k, v, fmt, quantizer=quantizer, page_size=page_size)
        out, decode_ms = _timed(decode, q, cache)
        oracle = decode_exact(q, cache)
        kd, vd = cache.dequantize(torch.float64)
        held = held_bytes_per_token(cache)
        rows.append({"format": fmt.scheme if fmt.is_fp4 else f"int{fmt.bits}", "name": name, "bits": fmt.bits, "backend": backend,
                     "bytes_per_token": held, "bf16_bytes_per_token": float(bf16_bytes),
                     "compression": bf16_bytes / held,
                     "err_vs_unquantized": rel_l2(out, exact), "err_vs_dequantized": rel_l2(out, oracle),
                     "bf16_err_vs_dequantized": rel_l2(attention(q, kd, vd, bf16=True), oracle),
                     "quantize_ms": quant_ms, "decode_ms": decode_ms})
    return rows


def study(lengths: list[int], seeds: list[int], *, decode: Callable, backend: str, device: torch.device,
          configs=STUDY_CONFIGS, batch: int = 1, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
          group_size: int = 128, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Every (length, seed) of the study: rows of :func:`error_rows` tagged with ``seq_len`` and ``seed``."""
    records = []
    for n in lengths:
        for seed in seeds:
            q, k, v = stress_inputs(batch, q_heads, kv_heads, n, head_dim, seed=seed, dtype=torch.bfloat16,
                                    device=device)
            formats = [(c.name, c.fmt(head_dim, group_size), c.quantizer) for c in configs]
            for row in error_rows(q, k, v, formats, decode, backend):
                records.append({"seq_len": n, "seed": seed, **row})
            progress(f"L={n} seed={seed} done")
    return records


def summary(records: list[dict]) -> list[dict]:
    """Per configuration and length: the range over seeds of each error, and the paper's range."""
    out = []
    for name in dict.fromkeys(r["name"] for r in records):
        for n in sorted({r["seq_len"] for r in records}):
            rs = [r for r in records if r["name"] == name and r["seq_len"] == n]
            if not rs:
                continue
            row = {"name": name, "seq_len": n, "seeds": len(rs), "paper": PAPER_RANGES.get(name)}
            for key in ("err_vs_unquantized", "err_vs_dequantized", "bf16_err_vs_dequantized"):
                vals = [r[key] for r in rs if r[key] is not None]
                row[key] = (min(vals), max(vals)) if vals else None
            out.append(row)
    return out


def render_markdown(summ: list[dict]) -> str:
    def rng(x, spec=".3g"):
        return "-" if x is None else (f"{x[0]:{spec}}" if x[0] == x[1] else f"{x[0]:{spec}}-{x[1]:{spec}}")
    lines = ["| configuration | L | seeds | error vs exact (unquantized) | paper Fig. 11 | arithmetic error vs "
             "dequantized | BF16 attention vs dequantized |", "|---|---|---|---|---|---|---|"]
    for r in summ:
        lines.append(f"| {r['name']} | {r['seq_len']} | {r['seeds']} | {rng(r['err_vs_unquantized'])} | "
                     f"{rng(r['paper'])} | {rng(r['err_vs_dequantized'])} | {rng(r['bf16_err_vs_dequantized'])} |")
    return "\n".join(lines)


def plot(summ: list[dict], path) -> bool:
    """Error against context length per configuration, log-log, with the paper's ranges shaded (Fig. 11).
    Returns ``False`` (and draws nothing) without matplotlib."""
    from .plots import pyplot, save
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in dict.fromkeys(r["name"] for r in summ):
        rs = [r for r in summ if r["name"] == name]
        xs = [r["seq_len"] for r in rs]
        lo = [r["err_vs_unquantized"][0] for r in rs]
        hi = [r["err_vs_unquantized"][1] for r in rs]
        line, = ax.plot(xs, [(a + b) / 2 for a, b in zip(lo, hi)], marker="o", label=name)
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2)
        if rs[0]["paper"]:
            ax.axhspan(*rs[0]["paper"], color=line.get_color(), alpha=0.08)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("relative L2 error vs exact attention")
    ax.set_title("Synthetic stress input (paper Sec. 6.2); bands: paper Fig. 11")
    ax.legend(fontsize=8)
    return save(fig, path)
